"""``AutoDistributedModel``: a transformers-style causal LM whose blocks live in the swarm.

The client holds the config and tokenizer only, never weights. ``generate`` takes transformers'
argument names and returns what transformers returns; speculation and routing are internal.
Calling the model (``forward``) returns transformers' ``CausalLMOutputWithPast``: logits of every
position (or the last N), the loss for ``labels``, and optionally the final hidden state.
A padded batch (``attention_mask``) runs its rows as concurrent sessions, each without its padding.
``AutoDistributedModelForCausalLM`` is the same class under transformers' naming.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence, Union

import torch
from transformers import AutoTokenizer, PretrainedConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast

from client import _loop
from client._adapters import call_adapter, checked_adapter, per_call_adapter
from client._audits import make_audits
from client._calls import DEFAULT_MAX_LENGTH, Call, check_audit_every, context_limit, one_call_session, plan_call
from client._confirmation import check_audit_policy
from client._drafter_choice import call_drafter
from client._forward import RowOutputs, forward_batch, forward_row
from client._generation import GenerationStats, SessionState, SpeculativeDecoder
from client._lm_head import LMHeadRows
from client._masks import causal_lm_loss, checked_ids, checked_mask, kept_columns, kept_width, session_input, unpadded
from client._options import GenerationOptions
from client._output_audits import DEFAULT_OUTPUT_AUDIT_RATE, OutputAuditor
from client._pretrained import load_config
from client._prompts import attach_prompts, check_tuning, prompt_tuned_loss, share_prompts
from client._spot_checks import DEFAULT_SPOT_CHECK_RATE, check_rate
from client._stats import merged_stats
from client._swarm import SwarmClient
from client._token_stream import GeneratedChunk, stream_laps
from client._trees import TreeSizer
from client._verdict_audits import DEFAULT_AUDIT_EVERY
from client._witnesses import trusted_set
from client.drafting import SuffixStore
from client.warm_corpus import load_warm_corpus
from protocol.config import no_initial_peers_message, resolve_initial_peers
from protocol.limits import DEFAULT_MAX_POSITIONS_PER_STEP
from protocol.models import config_fingerprint, resolve_model, weights_revision

logger = logging.getLogger(__name__)


class AutoDistributedModel(torch.nn.Module):
    """A transformers-style causal LM whose blocks run in the swarm: ``from_pretrained``,
    ``generate``, ``forward`` and their asyncio twins, with transformers' argument names, so code
    written for a local model runs against the swarm unchanged; a ``torch.nn.Module`` (client/_prompts.py)."""

    def __init__(self, config: PretrainedConfig, tokenizer: Any, swarm: SwarmClient):
        super().__init__()
        # "ptune"/"deep_ptune" and its trainable prompts: before the ids, and per block (client/_prompts.py)
        self.tuning_mode, self.prompt_embeddings, self.intermediate_prompt_embeddings = None, None, None
        self.config, self.tokenizer, self.swarm = config, tokenizer, swarm
        self.last_generation_stats: Optional[GenerationStats] = None
        self.last_batch_stats: list[GenerationStats] = []  # one per row of the last generate()
        self.last_logprobs: list = []
        self.spot_check_rate = DEFAULT_SPOT_CHECK_RATE  # generate()'s default; from_pretrained sets it
        self.verdict_audit_every = DEFAULT_AUDIT_EVERY  # tokens per verdict audit; 0: none; from_pretrained sets it
        self.trusted_peers: frozenset[str] = frozenset()  # from_pretrained's; generate(trusted_peers=) overrides
        self.output_audits = OutputAuditor(swarm, 0.0)  # forward passes' audits; from_pretrained sets the rate
        self.lm_head_rows: Optional[LMHeadRows] = None  # the checkpoint's LM-head rows; from_pretrained sets it
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
        trusted_peers: Sequence[str] = (),
        output_audit_rate: float = DEFAULT_OUTPUT_AUDIT_RATE,
        tuning_mode: Optional[str] = None,
        pre_seq_len: int = 0,
        active_adapter: Optional[str] = None,
        **kwargs: Any,
    ) -> "AutoDistributedModel":
        """Fetch the config and tokenizer (never weights) and join the swarm as a client.

        Without ``initial_peers``, the machine's configured ones are used ($SPECSWARM_INITIAL_PEERS, then
        the user's config file; protocol.config), as the server CLI does. ``max_positions_per_step``: the
        most positions one Step carries; longer prompts go as several Steps (chunked prefill).
        ``spot_check_rate``: the default of ``generate``'s (audits per verdict; 1/50; 0: none).
        ``verdict_audit_every``: every generated token is re-verified by a second tail on a shadow
        session, in one Step per this many tokens and once more before the output is returned; a
        dispute is settled by a trusted server or the disputed servers are avoided and the tokens
        re-verified (client/_verdict_audits.py; 0 turns the audits off). ``trusted_peers``: peer ids
        of servers you trust to settle disputes and confirm tokens (``generate`` may override it).
        ``output_audit_rate``: forward passes (logits, ``echo`` log-probs) re-computed on an independent route (0.1;
        every pass under ``forward(audit="required")``; client/_output_audits.py).
        ``warm_draft_store``: seed the suffix drafter with the model's own answers (client/warm_corpus.py,
        SmolLM2-135M); drafts only, same output; off: it did not raise tokens/s here (docs/benchmarks.md).
        ``tuning_mode="ptune"`` / ``"deep_ptune"``, ``pre_seq_len=N``: trainable prompts (docs/fine_tuning.md).
        ``active_adapter="name"``: a LoRA adapter that servers announce, at every block.
        """
        tuning_mode = check_tuning(tuning_mode, pre_seq_len)
        check_rate(spot_check_rate)
        initial_peers = resolve_initial_peers(initial_peers).peers
        if not initial_peers:
            raise ValueError(no_initial_peers_message("connect to", 'initial_peers=["MADDR", ...]'))
        model = resolve_model(model_name_or_path)
        source = model.source
        config = load_config(source, kwargs)  # unknown keywords: a TypeError naming them
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        swarm = _loop.run(
            SwarmClient.connect(
                list(initial_peers),
                dht_prefix or model.dht_name,
                config.num_hidden_layers,
                request_timeout=request_timeout,
                max_positions_per_step=max_positions_per_step,
                config_fingerprint=config_fingerprint(config),
                revision=weights_revision(source),
                active_adapter=active_adapter or "",
            )
        )
        model = cls(config, tokenizer, swarm)
        model.spot_check_rate = float(spot_check_rate)
        model.verdict_audit_every = check_audit_every(verdict_audit_every)
        model.trusted_peers = trusted_set(trusted_peers)
        model.lm_head_rows = LMHeadRows(source, config)  # disputes settled by evidence (client/_evidence.py)
        model.output_audits = OutputAuditor(swarm, output_audit_rate, model.trusted_peers, model.lm_head_rows)
        attach_prompts(model, tuning_mode, pre_seq_len, config)
        if warm_draft_store:
            model.warm_corpus = load_warm_corpus(config)
            model.reset_draft_store()
        return model

    @contextlib.contextmanager
    def inference_session(
        self, max_length: int = DEFAULT_MAX_LENGTH, active_adapter: Optional[str] = None
    ) -> Iterator[SessionState]:
        """Keep the servers' caches across several ``generate`` calls, as in Petals.

        Each call passes the whole conversation so far (as with transformers); the servers
        reuse the cache of the longest prefix they already hold. ``active_adapter``: the LoRA adapter
        of every call in the session instead of the model's ("": none; client/_adapters.py).
        """
        if self._session is not None:
            raise RuntimeError("an inference session is already open on this model")
        self._session = SessionState(max_length=max_length, adapter=checked_adapter(active_adapter))
        try:
            with call_adapter(active_adapter):
                yield self._session
        finally:
            session, self._session = self._session, None
            if session.remote is not None:
                _loop.run(self.swarm.close_session(session.remote))

    @per_call_adapter
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
        (tail drafts merged with retrieval's, per lap by measured acceptance) or None;
        ``num_draft_tokens`` caps drafts per lap; ``draft_corpus`` adds texts or token lists the
        answer is likely to repeat.
        ``async_speculation=True`` keeps up to ``max_inflight_runs`` runs in flight, each assuming
        the ones before it are accepted whole; refuted runs are cancelled hop by hop.
        ``draft_tree=True`` sends a token tree per lap instead of a chain: the drafter's chain plus the alternatives
        it ranks at each position (and the tail's drafts, with "+tail"), as many nodes as a cost model of the
        measured lap times finds worth it (more when the lap is network-bound); every server computes the tree in
        one pass and keeps only the accepted path. The output is unchanged. Synchronous speculation only (not with
        ``async_speculation`` or ``verification="rejection"``); Llama-family models (DeepSeek-V4 servers refuse
        trees). Stats: ``last_generation_stats.tree_nodes_per_lap``, ``tree_accepted_per_lap``, ``tree_sizes``.
        ``loop_runs`` (default None: on wherever it applies) shortens each lap by one link: the tail starts the next
        run at the head itself instead of the client, with the client's retrieval drafts for that verdict (offered
        to the head while the run before is in flight) or the tail's drafts; the client still receives every verdict
        and cancels the run it does not need at the end. It applies to one run at a time verified by token match
        without a ``draft_model``: True with ``async_speculation``, ``draft_tree`` or ``verification="rejection"``
        is a ValueError (docs/protocol.md, "Looped runs").
        ``num_logprobs=K`` (K <= 20) returns the top-K log-probs of each new token in
        ``model.last_logprobs`` (and as ``.logprobs`` when ``return_dict_in_generate=True``); for a
        batch of several rows, one list per row.

        ``draft_model``: a local transformers causal LM with the target's tokenizer (same vocabulary) drafts instead
        of ``speculation``, ``num_draft_tokens`` per lap, keeping its own KV cache. Greedy, or sampling with
        ``verification="match"`` (the default, exact for any drafter): it drafts its argmax and the tail keeps
        drafts equal to its own seeded choices. Sampling with ``verification="rejection"`` (one run at a time): it
        samples each draft from its q (the same temperature/top-k/top-p processing), sends q(x) up, and the tail
        accepts with probability min(1, p/q); on a rejection the client draws the token from norm(max(0, p - q))
        over the top-K of p the tail sends (K = top_k if <= 64, else 64). Exact in distribution when top_k <= 64, an
        approximation otherwise; with a seed the output is reproducible, but it is not the token sequence that plain
        sampling with that seed gives (token match's guarantee).

        A batch runs its rows as concurrent sessions. ``attention_mask`` (left or right padding,
        or zeros anywhere) removes each row's masked positions before it is sent, so every row gets
        exactly the tokens it gets alone. The result is laid out as transformers lays it out: row i
        is ``input_ids[i]`` (padding included) followed by its new tokens, and rows that end
        earlier (EOS, or nothing left) are filled with the pad token to the longest. Without
        ``attention_mask`` every position is a token: unlike transformers, no mask is guessed from
        ``pad_token_id`` (SmolLM2's pad token is its ``<|im_end|>``, which chat prompts contain).

        ``spot_check_rate`` (default: ``from_pretrained``'s, 1/50; 0 disables): after each verdict,
        with this probability, one hop of the route is audited against another server of the same
        blocks and precision (docs/reliability.md, "Spot-checks"); a re-verification may replace
        tokens a ``streamer`` was given, never the returned ids. ``trusted_peers`` (default
        ``from_pretrained``'s) and ``audit`` ("warn": unconfirmed tokens give an
        UnconfirmedTokensWarning; "required": UnconfirmedTokensError) in docs/api.md.
        ``active_adapter``: this call's LoRA adapter instead of the model's ("": none; docs/fine_tuning.md).
        """
        options, unused = GenerationOptions.split(kwargs)
        if unused:
            logger.warning(f"generate() ignores unsupported arguments: {sorted(unused)}")
        input_ids = session_input(self._session, self.num_prompts, input_ids, self.config.vocab_size)
        if max_length is not None:
            options = dataclasses.replace(options, max_new_tokens=max_length - input_ids.shape[1])
        call = plan_call(options, self.config, self.tokenizer, self.spot_check_rate)
        prefix = share_prompts(self.swarm, self, call.sampling.repetition_penalty)
        if streamer is not None and input_ids.shape[0] > 1:
            raise ValueError("a streamer takes one sequence (as in transformers): pass input_ids of batch size 1")
        eos = call.eos
        pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else (eos[0] if eos else 0)
        rows = [prefix + row for row in unpadded(input_ids, checked_mask(input_ids, attention_mask))]
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

    def _generate_row(self, row: list[int], call: Call, streamer: Any) -> list[int]:
        """One row in the open inference session (or a session of its own), streamed to ``streamer``."""
        own_session = self._session is None
        state = self._session or one_call_session(row, call, self.context_length)
        if streamer is not None:
            streamer.put(torch.tensor(row[self.num_prompts :]))
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

    def _generate_batch(self, rows: list[list[int]], call: Call) -> list[list[int]]:
        """Each row in its own session, all at once on the client loop; the new tokens of each."""
        states = [one_call_session(row, call, self.context_length) for row in rows]
        decoders = [self._make_decoder(state, call, None) for state in states]

        async def decode(decoder: SpeculativeDecoder, state: SessionState, row: list[int]) -> list[int]:
            try:
                return await decoder.generate(row, call.options.max_new_tokens)
            finally:
                await self._close(state)

        began = time.perf_counter()
        try:
            return _loop.run(_loop.all_or_none([decode(*args) for args in zip(decoders, states, rows)]))
        finally:
            self.last_batch_stats = [decoder.stats for decoder in decoders]
            self.last_generation_stats = merged_stats(self.last_batch_stats, time.perf_counter() - began)
            self.last_logprobs = [decoder.logprobs for decoder in decoders]

    @per_call_adapter
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        audit: str = "warn",
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
        at the positions ``logits`` covers. Tuned prompts precede every row; ``labels`` with grad
        enabled run a training step instead (the loss only: docs/fine_tuning.md). ``audit``: as generate's, for
        the forward passes' audits (client/_output_audits.py): "required" audits every row and raises if unconfirmed.
        ``active_adapter``: this call's LoRA adapter instead of the model's."""
        if unused:
            logger.warning(f"forward() ignores unsupported arguments: {sorted(unused)}")
        input_ids = checked_ids(input_ids, self.config.vocab_size)
        mask = checked_mask(input_ids, attention_mask)
        if self.prompt_embeddings is not None and labels is not None and torch.is_grad_enabled():
            loss = prompt_tuned_loss(self.swarm, self, input_ids, mask, labels)
            return CausalLMOutputWithPast(loss=loss) if return_dict else (loss,)  # a training step: no logits
        width = input_ids.shape[1]
        keep = kept_width(width, logits_to_keep, labels is not None)
        rows = [share_prompts(self.swarm, self, 1.0) + row for row in unpadded(input_ids, mask)]
        if max(map(len, rows)) > self.context_length:
            raise ValueError(f"a row has {max(map(len, rows))} tokens; the model's context is {self.context_length}")
        kept = kept_columns(mask, width - keep)
        audits = dict(auditor=self.output_audits, audit=check_audit_policy(audit))
        coro = forward_batch(self.swarm, self.config, rows, kept, keep, output_hidden_states, **audits)
        logits, hidden = _loop.run(coro)
        loss = causal_lm_loss(logits, torch.as_tensor(labels), mask) if labels is not None else None
        states = (hidden,) if hidden is not None else None
        output = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=states)
        return output if return_dict else output.to_tuple()

    __call__ = forward

    async def aforward_logits(self, input_ids: Sequence[int], audit: str = "warn") -> torch.Tensor:
        """The asyncio twin of ``forward`` for one sequence of ids: float32 logits ``[length, vocab]``
        of every position, from one prefill session (chunked like any long prompt, with failover).
        Usable from any event loop (the swarm I/O stays on the client's loop thread); cancelling the
        awaiting task cancels the pass, which closes its session. ``audit``: as ``forward``'s."""
        return (await self.aforward_outputs(input_ids, audit)).logits

    async def aforward_outputs(self, input_ids: Sequence[int], audit: str = "warn") -> RowOutputs:
        """``aforward_logits``, with the route and how its audit confirmed the logits (``.confirmed``)."""
        row = checked_ids(torch.as_tensor([list(input_ids)]), self.config.vocab_size)[0].tolist()
        if len(row) > self.context_length:
            raise ValueError(f"the sequence has {len(row)} tokens; the model's context is {self.context_length}")
        sizes = dict(vocab_size=self.config.vocab_size, hidden_size=self.config.hidden_size)
        audits = dict(auditor=self.output_audits, audit=check_audit_policy(audit))
        return await _loop.arun(forward_row(self.swarm, row, len(row), **sizes, **audits))

    async def agenerate_stream(self, input_ids: Sequence[int], **kwargs: Any) -> AsyncIterator[GeneratedChunk]:
        """The asyncio twin of ``generate`` for one sequence of ids: yields each lap's tokens as soon
        as the tail accepts them. Same arguments and seed handling, so the tokens equal ``generate``'s.

        Usable from any event loop (the swarm I/O stays on the client's loop thread), and safe to run
        many at once on one model; it never touches ``inference_session`` or ``last_*``. Closing it
        early (``aclose()``, or cancelling the task iterating it) stops the decoder and returns only
        after the session is closed on every server.
        """
        adapter = checked_adapter(kwargs.pop("active_adapter", None))  # this stream's LoRA adapter, if not the model's
        options, unknown = GenerationOptions.split(kwargs)
        if unknown:
            raise TypeError(f"agenerate_stream() got unexpected keyword arguments: {sorted(unknown)}")
        row = session_input(
            self._session, self.num_prompts, torch.as_tensor([list(input_ids)]), self.config.vocab_size
        )[0].tolist()
        call = plan_call(options, self.config, self.tokenizer, self.spot_check_rate)
        row = share_prompts(self.swarm, self, call.sampling.repetition_penalty) + row
        state = one_call_session(row, call, self.context_length)
        make_decoder, close = functools.partial(self._make_decoder, state, call), functools.partial(self._close, state)
        laps = stream_laps(make_decoder, row, options.max_new_tokens, bool(options.num_logprobs), close, adapter)
        async with contextlib.aclosing(laps) as chunks:
            async for chunk in chunks:
                yield chunk

    def _make_decoder(
        self, state: SessionState, call: Call, on_tokens: Optional[Callable[[list[int]], None]]
    ) -> SpeculativeDecoder:
        """The one place generate() and agenerate_stream() build their decoder and drafter."""
        options = call.options
        trusted = trusted_set(options.trusted_peers, self.trusted_peers)
        drafter = call_drafter(call, self._suffix_store, self.tokenizer, self.config.vocab_size)
        rate, every, pool = call.spot_check_rate, self.verdict_audit_every, options.audit_witnesses
        audits = make_audits(self.swarm, self.config.vocab_size, rate, every, trusted, self.lm_head_rows, pool)
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
            audits=audits,
            trusted_peers=trusted,
            audit=options.audit,
            draft_tree=options.draft_tree,
            tree_sizer=self._tree_sizer if options.draft_lap_costs is None else TreeSizer(options.draft_lap_costs),
            loop_runs=options.loop_runs,
        )

    @property
    def num_prompts(self) -> int:  # tuned prompt positions before every sequence's ids
        return 0 if self.prompt_embeddings is None else self.prompt_embeddings.num_embeddings

    @property
    def context_length(self) -> int:
        """The most positions (prompt + new tokens) one sequence may hold."""
        return context_limit(self.config)

    def reset_draft_store(self, warm: bool = True) -> None:
        """Forget what the suffix drafter learned (benchmarks compare modes fairly); the new store starts
        with the warm corpus (client/warm_corpus.py; ``warm_draft_store=True``) unless ``warm`` is False."""
        self._suffix_store = SuffixStore()
        for sequence in self.warm_corpus if warm else ():
            self._suffix_store.add(sequence)

    async def _close(self, state: SessionState) -> None:
        """Close a one-call session on every server of its route, if it was opened (on the client loop)."""
        if state.remote is not None:
            await self.swarm.close_session(state.remote)

    def shutdown(self) -> None:
        """Leave the swarm (also done at interpreter exit)."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self.shutdown)
            _loop.run(self.swarm.aclose())


AutoDistributedModelForCausalLM = AutoDistributedModel  # transformers' naming; the same class
