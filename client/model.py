"""``AutoDistributedModel``: a transformers-style causal LM whose blocks live in the swarm.

The client holds the config and tokenizer only, never weights. ``generate`` takes transformers'
argument names and returns what transformers returns; speculation and routing are internal.
Calling the model (``forward``) returns transformers' ``CausalLMOutputWithPast``: logits of every
position (or the last N), the loss for ``labels``, and optionally the final hidden state.
A padded batch (``attention_mask``) runs its rows as concurrent sessions, each without its padding.
``AutoDistributedModelForCausalLM`` is the same class under transformers' naming.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, Sequence, TypeVar, Union

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast

from client import _loop
from client._forward import forward_row
from client._generation import GenerationStats, SessionState, SpeculativeDecoder
from client._options import GenerationOptions
from client._trees import TreeSizer
from client._spot_checks import DEFAULT_SPOT_CHECK_RATE, SpotChecker, check_rate
from client._verdict_audits import DEFAULT_AUDIT_EVERY, Audits, VerdictAuditor
from client.draft_model import ModelDrafter, check_draft_model
from client._swarm import SwarmClient
from client.drafting import SuffixStore, make_drafter
from client.warm_corpus import load_warm_corpus
from protocol.limits import DEFAULT_MAX_POSITIONS_PER_STEP, MAX_TREE_NODES
from protocol.messages import SamplingParams, TokenLogprobs
from protocol.sampling import validate_sampling
from protocol.config import no_initial_peers_message, resolve_initial_peers
from protocol.models import config_fingerprint, resolve_model, weights_revision

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048


@dataclass
class GeneratedChunk:
    """One lap's output from ``agenerate_stream``: the tokens it accepted (several with speculation),
    their log-probs when asked for, and the generation's running stats (final once the stream ends)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    stats: GenerationStats
    # tokens yielded earlier that this chunk replaces: drop that many from the end of what you have,
    # then append token_ids (a spot-check caught a server of the route lying, and the tokens it may
    # have corrupted were re-verified on an honest route: docs/reliability.md, "Spot-checks")
    retracted: int = 0


class AutoDistributedModel:
    def __init__(self, config: PretrainedConfig, tokenizer: Any, swarm: SwarmClient):
        self.config, self.tokenizer, self.swarm = config, tokenizer, swarm
        self.last_generation_stats: Optional[GenerationStats] = None
        self.last_batch_stats: list[GenerationStats] = []  # one per row of the last generate()
        self.last_logprobs: list = []
        self.spot_check_rate = DEFAULT_SPOT_CHECK_RATE  # generate()'s default; from_pretrained sets it
        self.verdict_audit_every = DEFAULT_AUDIT_EVERY  # tokens per verdict audit; 0: none; from_pretrained sets it
        self._session: Optional[SessionState] = None
        self.warm_corpus: list[list[int]] = []  # the model's own answers a new suffix store starts with
        self._suffix_store = SuffixStore()
        self._tree_sizer = TreeSizer()  # lap-time model for token trees, shared by this model's generations
        self._closed = False
        atexit.register(self.shutdown)

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str,
        initial_peers: Sequence[str] = (),
        *,
        dht_prefix: Optional[str] = None,
        request_timeout: float = 60.0,
        max_positions_per_step: int = DEFAULT_MAX_POSITIONS_PER_STEP,
        spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE,
        warm_draft_store: bool = False,
        verdict_audit_every: int = DEFAULT_AUDIT_EVERY,
        **kwargs: Any,
    ) -> "AutoDistributedModel":
        """Fetch the config and tokenizer (never weights) and join the swarm as a client.

        Without ``initial_peers``, the machine's configured ones are used (protocol.config:
        $SPECSWARM_INITIAL_PEERS, then the user's config file), as the server CLI does.
        ``max_positions_per_step``: the most positions one Step carries; longer prompts are sent
        as several Steps (chunked prefill), at first and in failover replays.
        ``spot_check_rate``: the default of ``generate``'s (audits per verdict; 1/50; 0: none).
        ``verdict_audit_every``: every generated token is re-verified by a second tail on a shadow
        session, in one Step per this many tokens and once more before the output is returned; a
        tail caught lying in its verdicts is excluded and its tokens re-verified (client/_verdict_audits.py;
        0 turns the audits off).
        ``warm_draft_store``: start the suffix drafter's memory with the model's own answers to
        prompts of its kind, where the package has them (client/warm_corpus.py; SmolLM2-135M);
        drafts only, so the output is the same either way. Off by default: on the 2-core CPU
        machine it raised tokens per lap a little and tokens/s not at all (docs/benchmarks.md).
        """
        check_rate(spot_check_rate)
        initial_peers = resolve_initial_peers(initial_peers).peers
        if not initial_peers:
            raise ValueError(no_initial_peers_message("connect to", 'initial_peers=["MADDR", ...]'))
        model = resolve_model(model_name_or_path)
        config = AutoConfig.from_pretrained(model.source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(model.source, **kwargs)
        swarm = _loop.run(
            SwarmClient.connect(
                list(initial_peers), dht_prefix or model.dht_name, config.num_hidden_layers, request_timeout=request_timeout,
                max_positions_per_step=max_positions_per_step,
                config_fingerprint=config_fingerprint(config), revision=weights_revision(model.source),
            )
        )
        model = cls(config, tokenizer, swarm)
        model.spot_check_rate = float(spot_check_rate)
        if isinstance(verdict_audit_every, bool) or not isinstance(verdict_audit_every, int) or verdict_audit_every < 0:
            raise ValueError(f"verdict_audit_every must be an int >= 0 (0: no verdict audits), got {verdict_audit_every!r}")
        model.verdict_audit_every = verdict_audit_every
        if warm_draft_store:
            model.warm_corpus = load_warm_corpus(config)
            model.reset_draft_store()
        return model

    @contextlib.contextmanager
    def inference_session(self, max_length: int = DEFAULT_MAX_LENGTH) -> Iterator[SessionState]:
        """Keep the servers' caches across several ``generate`` calls, as in Petals.

        Each call passes the whole conversation so far (as with transformers); the servers
        reuse the cache of the longest prefix they already hold.
        """
        if self._session is not None:
            raise RuntimeError("an inference session is already open on this model")
        self._session = SessionState(max_length=max_length)
        try:
            yield self._session
        finally:
            session, self._session = self._session, None
            if session.remote is not None:
                _loop.run(self.swarm.close_session(session.remote))

    def generate(
        self,
        input_ids: Optional[torch.Tensor] = None,
        *,
        max_length: Optional[int] = None,
        streamer: Any = None,
        return_dict_in_generate: bool = False,
        attention_mask: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> Union[torch.Tensor, GenerateDecoderOnlyOutput]:
        """transformers-compatible ``generate``: returns ``[batch, input + new]`` token ids.

        The generation arguments (below) and their defaults are ``client._options.GenerationOptions``,
        shared with ``agenerate_stream``; arguments neither knows are ignored with a warning, as
        transformers-style callers pass some this model has no use for.

        ``speculation``: "suffix" (default), "ngram", "tail" (the tail's drafter), "suffix+tail"
        (tail drafts merged with retrieval's, per lap by measured acceptance) or None; ``num_draft_tokens`` caps drafts per
        lap; ``draft_corpus`` adds texts or token lists the answer is likely to repeat.
        ``async_speculation=True`` keeps up to ``max_inflight_runs`` runs in flight, each assuming
        the ones before it are accepted whole; refuted runs are cancelled hop by hop.
        ``draft_tree=True`` sends a token tree per lap instead of a chain: the drafter's chain plus
        the alternatives it ranks at each position (and the tail's drafts, with "+tail"), as
        many nodes as a cost model of the measured lap times finds worth it (more when the lap is
        network-bound); every server computes the tree in one pass and keeps only the accepted path.
        The output is unchanged. Synchronous speculation only (not with ``async_speculation`` or
        ``verification="rejection"``); Llama-family models (DeepSeek-V4 servers refuse trees). Stats:
        ``last_generation_stats.tree_nodes_per_lap``, ``tree_accepted_per_lap``, ``tree_sizes``.
        ``loop_runs`` (default None: on wherever it applies) shortens each lap by one link: the
        tail starts the next run at the head itself instead of the client, with the client's
        retrieval drafts for that verdict (offered to the head while the run before is in flight)
        or the tail's drafts; the client still receives every verdict and cancels the run it
        does not need at the end. It applies to one run at a time verified by token match without a
        ``draft_model``: True with ``async_speculation``, ``draft_tree`` or
        ``verification="rejection"`` is a ValueError (docs/protocol.md, "Looped runs").
        ``num_logprobs=K`` (K <= 20) returns the top-K log-probs of each new token in
        ``model.last_logprobs`` (and as ``.logprobs`` when ``return_dict_in_generate=True``); for a
        batch of several rows, one list per row.

        ``draft_model``: a local transformers causal LM with the target's tokenizer (same
        vocabulary) drafts instead of ``speculation``, ``num_draft_tokens`` per lap, keeping its own
        KV cache. Greedy, or sampling with ``verification="match"`` (the default, exact for any
        drafter): it drafts its argmax and the tail keeps drafts equal to its own seeded choices.
        Sampling with ``verification="rejection"`` (one run at a time): it samples each draft from
        its q (the same temperature/top-k/top-p processing), sends q(x) up, and the tail accepts with
        probability min(1, p/q); on a rejection the client draws the token from norm(max(0, p - q))
        over the top-K of p the tail sends (K = top_k if <= 64, else 64). Exact in distribution when
        top_k <= 64, an approximation otherwise; with a seed the output is reproducible, but it is
        not the token sequence that plain sampling with that seed gives (token match's guarantee).

        A batch runs its rows as concurrent sessions. ``attention_mask`` (left or right padding,
        or zeros anywhere) removes each row's masked positions before it is sent, so every row gets
        exactly the tokens it gets alone. The result is laid out as transformers lays it out: row i
        is ``input_ids[i]`` (padding included) followed by its new tokens, and rows that end
        earlier (EOS, or nothing left) are filled with the pad token to the longest. Without
        ``attention_mask`` every position is a token: unlike transformers, no mask is guessed from
        ``pad_token_id`` (SmolLM2's pad token is its ``<|im_end|>``, which chat prompts contain).

        ``spot_check_rate`` (default: ``from_pretrained``'s, 1/50; 0 disables): after each verdict,
        with this probability, one hop of the route is audited against another server of the same
        blocks and precision; a server outvoted by a third is excluded, and the tokens it may have
        corrupted are re-verified on an honest route (``last_generation_stats.liars_excluded``,
        ``tokens_retracted``). A ``streamer`` may have been given tokens that this replaced; the
        returned ids never hold them (docs/reliability.md, "Spot-checks").
        """
        options, unused = GenerationOptions.split(kwargs)
        if unused:
            logger.warning(f"generate() ignores unsupported arguments: {sorted(unused)}")
        input_ids = self._check_input(input_ids)
        if max_length is not None:
            options = dataclasses.replace(options, max_new_tokens=max_length - input_ids.shape[1])
        call = self._checked(options)
        if streamer is not None and input_ids.shape[0] > 1:
            raise ValueError("a streamer takes one sequence (as in transformers): pass input_ids of batch size 1")
        eos = call.eos
        pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else (eos[0] if eos else 0)
        rows = _unpadded(input_ids, _checked_mask(input_ids, attention_mask))
        if len(rows) == 1:
            new_rows = [self._generate_row(rows[0], call, streamer)]
            self.last_batch_stats = [self.last_generation_stats]
        else:
            new_rows = self._generate_batch(rows, call)
        width = max(map(len, new_rows))
        filled = [row + new + [pad_id] * (width - len(new)) for row, new in zip(input_ids.tolist(), new_rows)]
        sequences = torch.tensor(filled, dtype=torch.long)
        if return_dict_in_generate:
            output = GenerateDecoderOnlyOutput(sequences=sequences)
            output.logprobs = self.last_logprobs
            return output
        return sequences

    def _generate_row(self, row: list[int], call: "_Call", streamer: Any) -> list[int]:
        own_session = self._session is None
        state = self._session or self._new_session_state(row, call)
        if streamer is not None:
            streamer.put(torch.tensor(row))
        on_tokens = (lambda new: streamer.put(torch.tensor(new))) if streamer is not None else None
        decoder = self._make_decoder(state, call, on_tokens)
        self.last_generation_stats = decoder.stats  # live while generating (route, failovers, ...)
        try:
            new = _loop.run(decoder.generate(row, call.options.max_new_tokens))
        finally:
            self.last_logprobs = decoder.logprobs
            if own_session and state.remote is not None:
                _loop.run(self.swarm.close_session(state.remote))
            if streamer is not None:
                streamer.end()
        return new

    def _generate_batch(self, rows: list[list[int]], call: "_Call") -> list[list[int]]:
        """Each row in its own session, all at once on the client loop; the new tokens of each."""
        states = [self._new_session_state(row, call) for row in rows]
        decoders = [self._make_decoder(state, call, None) for state in states]

        async def decode(decoder: SpeculativeDecoder, state: SessionState, row: list[int]) -> list[int]:
            try:
                return await decoder.generate(row, call.options.max_new_tokens)
            finally:
                if state.remote is not None:
                    await self.swarm.close_session(state.remote)

        began = time.perf_counter()
        try:
            return _loop.run(_all_or_none([decode(*args) for args in zip(decoders, states, rows)]))
        finally:
            self.last_batch_stats = [decoder.stats for decoder in decoders]
            self.last_generation_stats = _merged_stats(self.last_batch_stats, time.perf_counter() - began)
            self.last_logprobs = [decoder.logprobs for decoder in decoders]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        **unused: Any,
    ) -> CausalLMOutputWithPast:
        """transformers-style forward pass (also ``model(input_ids, ...)``): ``logits`` ``[batch,
        length, vocab]`` float32 for every position, or the last ``logits_to_keep`` of them.

        Each row is one prefill session through the swarm (rows run concurrently), with the
        positions ``attention_mask`` marks 0 removed first, so a row's logits are those of the row
        alone (as in ``generate``); masked positions get zero logits. The tail sends the logits in
        chunks of at most 64 MiB. ``labels`` gives transformers' ``loss`` (mean cross-entropy of
        each next token; -100 is ignored, and so is any target predicted from a masked position):
        ``exp(loss)`` is the perplexity. ``output_hidden_states=True`` sets ``hidden_states`` to a
        1-tuple: the final hidden state (after the final norm: transformers' ``hidden_states[-1]``)
        at the positions ``logits`` covers; the other layers' states never leave the servers.
        """
        if unused:
            logger.warning(f"forward() ignores unsupported arguments: {sorted(unused)}")
        input_ids = self._check_ids(input_ids)
        mask = _checked_mask(input_ids, attention_mask)
        batch, width = input_ids.shape
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        keep = width if logits_to_keep == 0 else min(logits_to_keep, width)
        if labels is not None and keep != width:
            raise ValueError("labels need the logits of every position: leave logits_to_keep at 0")
        first = width - keep  # the first column the outputs cover
        rows = _unpadded(input_ids, mask)
        if max(map(len, rows)) > self._context_limit():
            raise ValueError(f"a row has {max(map(len, rows))} tokens; the model's context is {self._context_limit()}")
        columns = [mask[i].nonzero().flatten() for i in range(batch)]  # where each row's tokens sit
        kept = [cols[cols >= first] - first for cols in columns]
        wanted = [i for i in range(batch) if len(kept[i])]
        vocab, hidden_size = self.config.vocab_size, self.config.hidden_size
        results = _loop.run(
            _all_or_none(
                [forward_row(self.swarm, rows[i], len(kept[i]), vocab_size=vocab, hidden_size=hidden_size,
                             return_hidden=output_hidden_states) for i in wanted]  # fmt: skip
            )
        )
        logits = torch.zeros(batch, keep, vocab)
        hidden = torch.zeros(batch, keep, hidden_size) if output_hidden_states else None
        for i, result in zip(wanted, results):
            logits[i, kept[i]] = result.logits
            if hidden is not None:
                hidden[i, kept[i]] = result.hidden
        loss = _causal_lm_loss(logits, torch.as_tensor(labels), mask) if labels is not None else None
        states = (hidden,) if hidden is not None else None
        output = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=states)
        return output if return_dict else output.to_tuple()

    __call__ = forward

    async def aforward_logits(self, input_ids: Sequence[int]) -> torch.Tensor:
        """The asyncio twin of ``forward`` for one sequence of ids: float32 logits ``[length, vocab]``
        of every position, from one prefill session (chunked like any long prompt, with failover).
        Usable from any event loop (the swarm I/O stays on the client's loop thread); cancelling the
        awaiting task cancels the pass, which closes its session."""
        row = self._check_ids(torch.as_tensor([list(input_ids)]))[0].tolist()
        if len(row) > self._context_limit():
            raise ValueError(f"the sequence has {len(row)} tokens; the model's context is {self._context_limit()}")
        config = self.config
        coro = forward_row(self.swarm, row, len(row), vocab_size=config.vocab_size, hidden_size=config.hidden_size)
        future = asyncio.run_coroutine_threadsafe(coro, _loop.get_loop())
        try:
            return (await asyncio.wrap_future(future)).logits
        finally:
            future.cancel()  # a no-op once done

    async def agenerate_stream(self, input_ids: Sequence[int], **kwargs: Any) -> AsyncIterator[GeneratedChunk]:
        """The asyncio twin of ``generate`` for one sequence of ids: yields each lap's tokens as soon
        as the tail accepts them. Same arguments and seed handling, so the tokens equal ``generate``'s.

        Usable from any event loop (the swarm I/O stays on the client's loop thread), and safe to run
        many at once on one model; it never touches ``inference_session`` or ``last_*``. Closing it
        early (``aclose()``, or cancelling the task iterating it) stops the decoder and returns only
        after the session is closed on every server.
        """
        options, unknown = GenerationOptions.split(kwargs)
        if unknown:
            raise TypeError(f"agenerate_stream() got unexpected keyword arguments: {sorted(unknown)}")
        row = self._check_input(torch.as_tensor([list(input_ids)]))[0].tolist()
        call = self._checked(options)
        state = self._new_session_state(row, call)
        caller, laps = asyncio.get_running_loop(), asyncio.Queue()

        def post(item: Optional[GeneratedChunk]) -> None:  # client loop -> caller's loop
            caller.call_soon_threadsafe(laps.put_nowait, item)

        retracted = [0]  # tokens_retracted already reported

        def on_tokens(new: list[int]) -> None:
            gone, retracted[0] = decoder.stats.tokens_retracted - retracted[0], decoder.stats.tokens_retracted
            post(GeneratedChunk(new, decoder.logprobs[-len(new) :] if options.num_logprobs else [], decoder.stats, gone))

        decoder = self._make_decoder(state, call, on_tokens)
        control: dict[str, Any] = {}

        async def decode() -> None:  # runs on the client loop; always ends by posting None
            control["task"] = asyncio.current_task()
            try:
                if not control.get("cancelled"):
                    await decoder.generate(row, options.max_new_tokens)
            except Exception as e:
                control["error"] = e
            finally:
                try:
                    if state.remote is not None:
                        await self.swarm.close_session(state.remote)
                finally:
                    post(None)

        def cancel() -> None:  # runs on the client loop, so it cannot race decode()'s first line
            control["cancelled"] = True
            if control.get("task") is not None:
                control["task"].cancel()

        asyncio.run_coroutine_threadsafe(decode(), _loop.get_loop())
        ended = False
        try:
            while (chunk := await laps.get()) is not None:
                yield chunk
            ended = True
            if "error" in control:
                raise control["error"]
        finally:
            if not ended:
                _loop.get_loop().call_soon_threadsafe(cancel)
                while await laps.get() is not None:  # the session is closed once None arrives
                    pass

    def _checked(self, options: GenerationOptions) -> "_Call":
        """Check a call's options before any session opens (client/_options.py holds the rules the
        decoding modes share), and work out what they imply."""
        rate = check_rate(self.spot_check_rate if options.spot_check_rate is None else options.spot_check_rate)
        sampling = _sampling_params(options.do_sample, options.temperature, options.top_k, options.top_p,
                                    options.min_p, options.repetition_penalty, options.seed)  # fmt: skip
        if options.draft_model is not None:
            check_draft_model(options.draft_model, self.config.vocab_size)
        options = options.checked()
        return _Call(options, sampling, self._eos_ids(options.eos_token_id), self._corpus(options.draft_corpus), rate)

    def _new_session_state(self, row: list[int], call: "_Call") -> SessionState:
        """A one-call session: room for the prompt, the new tokens and one run's drafts (a tree's nodes)."""
        options = call.options
        drafts = max(options.num_draft_tokens, MAX_TREE_NODES) if options.draft_tree else options.num_draft_tokens
        return SessionState(max_length=min(len(row) + options.max_new_tokens + drafts + 1, self._context_limit()))

    def _make_decoder(self, state: SessionState, call: "_Call", on_tokens: Optional[Callable[[list[int]], None]]) -> SpeculativeDecoder:
        """The one place generate() and agenerate_stream() build their decoder and drafter."""
        options = call.options
        if options.draft_model is not None:  # one ModelDrafter (own KV cache) per stream; the model is shared
            sample = options.verification == "rejection"
            drafter = ModelDrafter(options.draft_model, call.sampling, options.num_draft_tokens, sample=sample)
        else:
            drafter = make_drafter(options.speculation, num_draft_tokens=options.num_draft_tokens, corpus=call.corpus,
                                   store=self._suffix_store, eos_token_ids=call.eos)  # fmt: skip
        return SpeculativeDecoder(
            self.swarm,
            state,
            call.sampling,
            drafter=drafter,
            num_draft_tokens=options.num_draft_tokens,
            max_inflight_runs=options.inflight,
            eos_token_ids=call.eos,
            num_logprobs=options.num_logprobs,
            on_tokens=on_tokens,
            verification=options.verification,
            spot_checker=self._audits(call.spot_check_rate),
            draft_tree=options.draft_tree,
            tree_sizer=self._tree_sizer,
            loop_runs=options.loop_runs,
        )

    def _audits(self, spot_check_rate: float) -> Optional[Audits]:
        spot = SpotChecker(self.swarm, spot_check_rate, self.config.vocab_size) if spot_check_rate else None
        verdicts = VerdictAuditor(self.swarm, self.config.vocab_size, self.verdict_audit_every) if self.verdict_audit_every else None
        return Audits(spot, verdicts) if spot or verdicts else None

    def _corpus(self, draft_corpus: Sequence[Union[str, Sequence[int]]]) -> list[list[int]]:
        return [self.tokenizer.encode(c, add_special_tokens=False) if isinstance(c, str) else list(c) for c in draft_corpus]

    @property
    def context_length(self) -> int:
        """The most positions (prompt + new tokens) one sequence may hold."""
        return self._context_limit()

    def _check_input(self, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        if input_ids is None:
            if self._session is None or not self._session.history:
                raise ValueError("input_ids is required (outside an inference session that already has tokens)")
            input_ids = torch.tensor([self._session.history])
        input_ids = self._check_ids(input_ids)
        if self._session is not None and input_ids.shape[0] != 1:
            raise ValueError("an inference session holds one sequence; pass input_ids with batch size 1")
        return input_ids

    def _check_ids(self, input_ids: Any) -> torch.Tensor:
        """[batch, length] (or [length]) token ids inside the vocabulary, as a long tensor."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.ndim == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, length] with length >= 1, got shape {tuple(input_ids.shape)}")
        vocab = self.config.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids contain token ids outside the vocabulary [0, {vocab})")
        return input_ids

    def _eos_ids(self, eos_token_id) -> list[int]:
        if eos_token_id is None:
            eos_token_id = self.config.eos_token_id
        if eos_token_id is None:
            return []
        return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)

    def _context_limit(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH)

    def reset_draft_store(self, warm: bool = True) -> None:
        """Forget earlier outputs the suffix drafter learned from (benchmarks compare modes fairly);
        the new store starts with the model's warm corpus (client/warm_corpus.py; empty unless
        ``from_pretrained(warm_draft_store=True)`` loaded it) unless ``warm`` is False."""
        self._suffix_store = SuffixStore()
        for sequence in self.warm_corpus if warm else ():
            self._suffix_store.add(sequence)

    def shutdown(self) -> None:
        """Leave the swarm (also done at interpreter exit)."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self.shutdown)
            _loop.run(self.swarm.aclose())


def _sampling_params(do_sample, temperature, top_k, top_p, min_p, repetition_penalty, seed) -> SamplingParams:
    """transformers' arguments -> the wire's SamplingParams; no seed draws a random one."""
    sampling = SamplingParams(
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k or 0,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()),
    )
    validate_sampling(sampling)
    if not do_sample:  # argmax: only the repetition penalty can change it; the rest stays off the wire
        return SamplingParams(repetition_penalty=repetition_penalty)
    return sampling


AutoDistributedModelForCausalLM = AutoDistributedModel  # transformers' naming; the same class


@dataclass(frozen=True)
class _Call:
    """One generate() or agenerate_stream() call's checked arguments and what they imply."""

    options: GenerationOptions  # with loop_runs decided
    sampling: SamplingParams  # with the call's seed
    eos: list[int]
    corpus: list[list[int]]  # draft_corpus as token ids
    spot_check_rate: float


T = TypeVar("T")


async def _all_or_none(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Run coroutines concurrently; if one fails (or the caller gives up), cancel the others and
    wait for them (each closes its own session) before raising."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _checked_mask(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The attention mask as a 0/1 long tensor of input_ids' shape, every row with a token."""
    if attention_mask is None:
        return torch.ones_like(input_ids)
    mask = torch.as_tensor(attention_mask)
    if mask.ndim == 1:
        mask = mask.unsqueeze(0)
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; input_ids has {tuple(input_ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    if not bool(mask.any(dim=1).all()):
        raise ValueError("attention_mask leaves a row without any token")
    return mask.long()


def _unpadded(input_ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [ids[keep.bool()].tolist() for ids, keep in zip(input_ids, mask)]


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss (mean cross-entropy of position i's logits against label
    i + 1, -100 ignored), except that targets predicted from a masked position are ignored too."""
    if tuple(labels.shape) != tuple(mask.shape):
        raise ValueError(f"labels have shape {tuple(labels.shape)}; input_ids has {tuple(mask.shape)}")
    targets = torch.nn.functional.pad(labels.long(), (0, 1), value=-100)[:, 1:].masked_fill(mask == 0, -100)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def _merged_stats(stats: Sequence[GenerationStats], wall_time: float) -> GenerationStats:
    """A batch's stats: every row's counts added up; the wall time of the whole call; row 0's route."""
    merged = GenerationStats()
    for row in stats:
        for f in dataclasses.fields(GenerationStats):
            value, total = getattr(row, f.name), getattr(merged, f.name)
            if isinstance(value, Counter):
                total.update(value)
            elif isinstance(value, list) and f.name != "route":
                total.extend(value)
            elif isinstance(value, (int, float)) and f.name != "wall_time":
                setattr(merged, f.name, total + value)
    merged.route = list(stats[0].route) if stats else []
    merged.wall_time = wall_time
    return merged
