"""One served model, and one request's generation turned into text as the swarm accepts tokens.

Data path of a request, top to bottom (``TextGeneration.deltas``):
  1) ``model.agenerate_stream`` yields each lap's accepted tokens (several with speculation);
  2) each token is detokenized in context and fed to the stop-string matcher;
  3) the lap's settled text, tokens and log-probs go out as one :class:`Delta`;
  4) a stop string ends the generation early: closing the stream cancels the decoder and closes
     the session on every server.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from client import AutoDistributedModelForCausalLM, GenerationStats
from client._calls import call_constraint, compiler_for
from client._options import GenerationOptions
from protocol.constraints import with_stops
from protocol.messages import TokenLogprobs
from swarm.api.errors import RetractedError, bad_request
from swarm.api.llama_tools import PYTHON_TAG
from swarm.api.prompt_logprobs import MAX_CONCURRENT_FORWARDS, prompt_logprobs
from swarm.api.text import IncrementalDetokenizer, StopMatcher

CHAT_ROLES = {"system", "user", "assistant", "tool"}
# finish_reason of a constrained reply that ended at a dead end: its constraint allowed no token, so the
# tail chose the stop token where the constraint could not end (the text does not match it)
DEAD_END = "constraint_dead_end"
DEFAULT_MAX_TOKENS = 1024  # a request without max_tokens generates at most this many (GatewayConfig)


@dataclass(frozen=True)
class GenerationParams:
    """A validated request, in the client library's terms."""

    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()
    num_logprobs: int = 0  # top-K asked of the swarm; 0: none
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # agenerate_stream's sampling and drafting arguments
    prompt_index: int = 0  # which of the request's prompts (several choices may share one)
    echo: Optional[str] = None  # the prompt's text, returned before the completion (completions' echo)
    prompt_logprobs: int = -1  # with echo: score the prompt's tokens, with this many alternatives; -1: no
    # tool calls (swarm/api/tools.py): "forced" (the reply is a constrained call), "auto" (a reply that
    # is one call of ``tool_names`` becomes tool_calls, any other is text), "" (no tools)
    tool_call: str = ""
    tool_names: tuple[str, ...] = ()
    tool_format: str = "json"  # how calls are written: a key of swarm.api.tools.FORMATS
    parallel_tool_calls: bool = True  # OpenAI's parallel_tool_calls: false allows at most one call
    # tokens that end the reply as EOS does, besides the model's: Llama 3.1's <|eom_id|> with built-in tools
    stop_token_ids: tuple[int, ...] = ()

    @property
    def kept_tokens(self) -> tuple[str, ...]:
        """Special tokens kept in the text: a Llama 3.1 call's <|python_tag|> (swarm/api/llama_tools.py)."""
        return (PYTHON_TAG,) if self.tool_call and self.tool_format == "llama3" else ()


@dataclass
class Delta:
    """What one lap adds: settled text, and the tokens (with log-probs when asked) it came from."""

    text: str
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]
    # this delta replaces every earlier one but the echo: the whole text so far (a spot-check
    # replaced tokens already yielded; only a buffered, non-streamed response can take that)
    restart: bool = False
    echo: bool = False  # the echoed prompt (its log-probs: None for the first token, which has no context)


class ServedModel:
    """A model the gateway serves under ``name``: one client-library model shared by all requests."""

    def __init__(self, name: str, model: AutoDistributedModelForCausalLM, default_max_tokens: int = DEFAULT_MAX_TOKENS):
        self.name, self.model, self.tokenizer = name, model, model.tokenizer
        self.default_max_tokens = default_max_tokens  # the cap on a request that names no max_tokens
        self.forward_slots = asyncio.Semaphore(MAX_CONCURRENT_FORWARDS)  # prompt-logprob passes at once
        eos = model.config.eos_token_id
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.vocab_size = int(model.config.vocab_size)

    @property
    def context_length(self) -> int:
        return self.model.context_length

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[Any]] = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The conversation formatted by the model's own chat template, ready for the reply (``tools``:
        given to a template that renders them itself, swarm/api/tools.py; ``template_kwargs``: more of
        the template's variables, such as Llama 3.1's ``builtin_tools``)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(f"model {self.name!r} has no chat template; use /v1/completions", "messages")
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=True,
                tools=tools,
                **template_kwargs,
            )
        except Exception as e:  # jinja raises on conversations the template rejects
            raise bad_request(f"the chat template of {self.name!r} rejected the messages: {e}", "messages") from None
        return list(encoded["input_ids"])


class TextGeneration:
    """Runs one request; after ``deltas`` ends, ``finish_reason``, ``completion_tokens`` and
    ``stats`` describe it. Tokens after a stop string are neither returned nor counted."""

    def __init__(self, served: ServedModel, params: GenerationParams, buffered: bool = False):
        self.served, self.params = served, params
        self.buffered = buffered  # the caller keeps every delta until the end (not streamed)
        self.finish_reason: Optional[str] = None
        self.completion_tokens = 0
        self.stats = GenerationStats()
        self.prompt_confirmed = ""  # how the echo log-probs' pass was confirmed (client/_output_audits.py); "": none

    async def deltas(self) -> AsyncIterator[Delta]:
        params, served = self.params, self.served
        if params.echo is not None:
            scored: list[Optional[TokenLogprobs]] = []
            if params.prompt_logprobs >= 0:
                async with served.forward_slots:
                    audit = params.sampling.get("audit", "warn")
                    scored, self.prompt_confirmed = await prompt_logprobs(
                        served.model, params.prompt_ids, params.prompt_logprobs, audit
                    )
            yield Delta(params.echo, list(params.prompt_ids), scored, echo=True)
        if params.max_tokens == 0:  # echo alone: scoring a text, nothing to generate
            self.finish_reason = "length"
            return
        detokenizer = IncrementalDetokenizer(served.tokenizer, params.prompt_ids, params.kept_tokens)
        stops = StopMatcher(params.stop)
        stream = served.model.agenerate_stream(
            params.prompt_ids,
            max_new_tokens=params.max_tokens,
            eos_token_id=self._stop_ids(),
            num_logprobs=params.num_logprobs,
            **params.sampling,
        )
        last_token: Optional[int] = None
        tokens: list[int] = []  # what the deltas so far hold, and their log-probs
        logprobs: list[TokenLogprobs] = []
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                self.stats = chunk.stats
                restart = False
                if chunk.retracted:
                    if not self.buffered:
                        raise RetractedError(
                            f"a server of the route was caught returning wrong results after {len(tokens)} tokens "
                            f"were streamed; {chunk.retracted} of them were replaced: retry the request"
                        )
                    keep = max(0, len(tokens) - chunk.retracted)  # re-read the kept tokens from the start
                    tokens, logprobs, restart = tokens[:keep], logprobs[:keep], True
                    detokenizer = IncrementalDetokenizer(served.tokenizer, params.prompt_ids, params.kept_tokens)
                    stops = StopMatcher(params.stop)
                    replayed = "".join(stops.feed(detokenizer.push(t)) for t in tokens)
                    self.completion_tokens = len(tokens)
                text, taken = (replayed if restart else ""), 0
                for token in chunk.token_ids:
                    taken += 1
                    last_token = token
                    text += stops.feed(detokenizer.push(token))
                    if stops.stopped:
                        break
                self.completion_tokens += taken
                tokens += chunk.token_ids[:taken]
                logprobs += chunk.logprobs[:taken]
                if restart:
                    yield Delta(text, list(tokens), list(logprobs), restart=True)
                else:
                    yield Delta(text, chunk.token_ids[:taken], chunk.logprobs[:taken])
                if stops.stopped:
                    self.finish_reason = "stop"
                    return  # leaving the block closes the stream: the decoder stops, the session closes
        text = stops.feed(detokenizer.flush())
        text += stops.finish()
        self.finish_reason = "stop" if stops.stopped or self._ended_by_eos(last_token) else "length"
        if self.finish_reason == "stop" and not stops.stopped and last_token in self._stop_set():
            if constraint_unfinished(served, params, self._stop_set(), tokens):
                self.finish_reason = DEAD_END
        if text:
            yield Delta(text, [], [])

    def _stop_ids(self) -> Optional[list[int]]:
        """agenerate_stream's eos_token_id: none with ignore_eos, the model's (None) unless the request
        adds stop tokens (``stop_token_ids``), then the model's and those."""
        if self.params.ignore_eos:
            return []
        if not self.params.stop_token_ids:
            return None
        return sorted(self.served.eos_token_ids | set(self.params.stop_token_ids))

    def _stop_set(self) -> frozenset[int]:
        """The ids that end this reply as EOS does: the model's and the request's stop tokens."""
        return self.served.eos_token_ids | frozenset(self.params.stop_token_ids)

    def _ended_by_eos(self, last_token: Optional[int]) -> bool:
        if self.params.ignore_eos:
            return False
        ended = last_token in self.served.eos_token_ids or last_token in self.params.stop_token_ids
        return ended or self.completion_tokens < self.params.max_tokens


def constraint_unfinished(
    served: ServedModel, params: GenerationParams, stops: frozenset[int], tokens: list[int]
) -> bool:
    """Whether a reply that ended at a stop token did so where its constraint could not end: the
    tail's mask allowed no id at all there (a dead end), so the stop token was its only choice
    (protocol/constraints.py, ``Guide.apply``). Read with the gateway's own matcher over the reply,
    the constraint and stop ids the client sent; False without a constraint."""
    options, _ = GenerationOptions.split(dict(params.sampling))
    constraint = call_constraint(options, served.tokenizer, served.vocab_size)
    if constraint is None:
        return False
    compiler = compiler_for(served.tokenizer, served.vocab_size)
    guide = compiler.guide(with_stops(constraint, compiler, sorted(stops)), len(params.prompt_ids))
    try:
        return not guide.ended(list(params.prompt_ids) + list(tokens))
    except ValueError:  # a token the constraint refuses: the stop token where the grammar cannot end
        return True


def check_prompt_ids(ids: Sequence[Any], served: ServedModel, param: str) -> list[int]:
    if not ids:
        raise bad_request("the prompt is empty", param)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad_request("a token-id prompt must be a list of integers", param)
    if min(ids) < 0 or max(ids) >= served.vocab_size:
        raise bad_request(f"the prompt has token ids outside the vocabulary [0, {served.vocab_size})", param)
    return list(ids)
