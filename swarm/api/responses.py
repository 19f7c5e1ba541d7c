"""Response bodies and stream chunks of /v1/chat/completions and /v1/completions.

Both endpoints share the envelope (id, object, created, model) and the speculation stats; they
differ in how a choice carries its text (``message``/``delta`` vs ``text``) and its log-probs.
A request has one choice per prompt and per ``n`` (``choices[i].index`` is its place in that
order); ``usage`` adds them up, each prompt counted once. Speculation stats ride in a ``specswarm``
field (clients ignore unknown fields) and, for non-streamed responses, in ``x-specswarm-*`` headers.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Optional, Sequence

from client import GenerationStats
from protocol.messages import TokenLogprobs
from swarm.api.engine import Delta, ServedModel, TextGeneration
from swarm.api.llama_tools import PYTHON_TAG
from swarm.api.tools import (
    FORMATS,
    LLAMA3_FORMAT,
    leading_calls,
    leading_tagged_calls,
    may_be_call,
    streams_builtin_calls,
    tool_calls,
)

STAT_COUNTS = ("laps", "drafted", "accepted", "failovers")
# how the returned tokens were confirmed (docs/reliability.md, "Disputes and witnesses")
CONFIRMATION_COUNTS = ("tokens_confirmed_trusted", "tokens_confirmed_untrusted", "tokens_unconfirmed")


def speculation_stats(stats: Sequence[GenerationStats]) -> dict[str, Any]:
    """The counts of all the choices' generations added up; tokens per lap over all their laps."""
    totals = {key: sum(getattr(s, key) for s in stats) for key in STAT_COUNTS + CONFIRMATION_COUNTS}
    per_lap = (totals["accepted"] + totals["laps"]) / totals["laps"] if totals["laps"] else 0.0
    return {
        "laps": totals["laps"],
        "accepted_per_lap": round(per_lap, 3),
        "drafted": totals["drafted"],
        "accepted": totals["accepted"],
        "failovers": totals["failovers"],
        **{key: totals[key] for key in CONFIRMATION_COUNTS},
    }


# how a pass's log-probs were confirmed, weakest first (client/_output_audits.py); a response reports its weakest
PROMPT_CONFIRMATION = ("unconfirmed", "unaudited", "untrusted", "trusted")


def with_prompt_confirmation(specswarm: dict[str, Any], generations: Sequence[Any]) -> dict[str, Any]:
    """``specswarm`` plus ``prompt_logprobs``: how the echo log-probs were confirmed, when some were scored."""
    found = [g.prompt_confirmed for g in generations if g.prompt_confirmed]
    if found:
        specswarm["prompt_logprobs"] = min(found, key=PROMPT_CONFIRMATION.index)
    return specswarm


def speculation_headers(stats: Sequence[GenerationStats]) -> dict[str, str]:
    return {f"x-specswarm-{key.replace('_', '-')}": str(value) for key, value in speculation_stats(stats).items()}


class _Format:
    prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(self, served: ServedModel, generations: list[TextGeneration], shown_logprobs: int):
        self.served, self.generations = served, generations
        self.shown = shown_logprobs  # top log-probs shown per token; -1: log-probs not asked for
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.text_offsets = [0] * len(generations)  # per choice: characters of text before the next token

    def _envelope(self, object_name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.served.name,
            "choices": choices,
            **extra,
        }

    def stats(self) -> list[GenerationStats]:
        return [g.stats for g in self.generations]

    def usage(self) -> dict[str, int]:
        prompts = {g.params.prompt_index: len(g.params.prompt_ids) for g in self.generations}
        prompt, completion = sum(prompts.values()), sum(g.completion_tokens for g in self.generations)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def wants_chunk(self, index: int, delta: Delta) -> bool:
        return bool(delta.text) or (self.shown >= 0 and bool(delta.token_ids))

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [], usage=self.usage())

    def _top(self, entry: TokenLogprobs) -> list[tuple[str, float]]:
        pairs = zip(entry.top_ids[: self.shown], entry.top_logprobs[: self.shown])
        return [(self.served.token_text(i), lp) for i, lp in pairs]


class ChatFormat(_Format):
    prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, served: ServedModel, generations: list[TextGeneration], shown_logprobs: int):
        super().__init__(served, generations, shown_logprobs)
        self.call_texts: dict[int, str] = {}  # streamed tool calls: their text not yet sent
        self.texts: set[int] = set()  # "auto" choices known to be text: streamed from then on
        self.released: dict[int, str] = {}  # an "auto" choice's held text, sent with its next chunk
        self.ready_calls: dict[int, list[dict[str, Any]]] = {}  # complete calls, sent with the next chunk
        self.sent_calls: dict[int, int] = {}  # calls of each choice sent so far (the next call's index)
        self.pending: dict[int, str] = {}  # a Llama 3.1 text's end that may be the start of <|python_tag|>

    def opening_chunk(self, index: int) -> dict[str, Any]:
        opening = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": opening, "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def wants_chunk(self, index: int, delta: Delta) -> bool:
        """A tool call's text is held until the call is complete: then it is sent (where a reply may
        hold several, each as soon as it is complete; else whole in the choice's last chunk). With
        "auto", text is held while it may still be a call (empty, or from a leading "{"); a Llama 3.1
        reply streamed as text still becomes calls at ``<|python_tag|>`` (:meth:`_until_tag`)."""
        params = self.generations[index].params
        if params.tool_call and index in self.texts and params.tool_format == LLAMA3_FORMAT.name:
            return self._until_tag(index, delta.text) or (self.shown >= 0 and bool(delta.token_ids))
        if not params.tool_call or index in self.texts:
            return super().wants_chunk(index, delta)
        return self._hold(index, delta.text)

    def _hold(self, index: int, text: str) -> bool:
        """Add ``text`` to what a tool-call choice holds; whether a chunk goes out now (complete calls,
        or held text released once it cannot be a call)."""
        params = self.generations[index].params
        held, fmt = self.call_texts.get(index, "") + text, FORMATS[params.tool_format]
        calls, used = self._leading(index, held)
        if calls:
            first = self.sent_calls.get(index, 0)
            self.ready_calls[index] = [{"index": first + i, **c} for i, c in enumerate(calls)]
            self.sent_calls[index], held = first + len(calls), held[used:]
        # after Llama 3.1 built-in calls, the rest is held to the end: more calls, or the reply's text
        in_body = fmt is LLAMA3_FORMAT and self.sent_calls.get(index, 0) > 0
        if params.tool_call == "forced" or in_body or may_be_call(held, fmt):
            self.call_texts[index] = held
            return index in self.ready_calls
        self.texts.add(index)
        self.call_texts.pop(index, None)
        if fmt is LLAMA3_FORMAT:
            return self._until_tag(index, held) or index in self.ready_calls
        self.released[index] = held
        return True

    def _until_tag(self, index: int, text: str) -> bool:
        """An "auto" Llama 3.1 choice streamed as text: the text before ``<|python_tag|>`` is content (a
        possible start of the tag at its end is kept back until settled); from the tag on it is held as
        calls are (``_message`` splits a whole reply the same way). Whether there is something to send."""
        text = self.pending.pop(index, "") + text
        at = text.find(PYTHON_TAG)
        if at < 0:
            keep = next(
                (n for n in range(min(len(text), len(PYTHON_TAG) - 1), 0, -1) if PYTHON_TAG.startswith(text[-n:])), 0
            )
            if keep:
                self.pending[index], text = text[-keep:], text[:-keep]
            self.released[index] = self.released.get(index, "") + text
            return bool(text)
        self.texts.discard(index)
        self.released[index] = self.released.get(index, "") + text[:at]
        return self._hold(index, text[at:]) or bool(text[:at])

    def _leading(self, index: int, text: str, sent: Optional[int] = None) -> tuple[list[dict], int]:
        """The complete calls at the start of a choice's ``text`` (its held text: ``sent`` calls of it
        went out before it), where a reply may hold several, and the characters they take."""
        params = self.generations[index].params
        fmt = FORMATS[params.tool_format]
        sent = self.sent_calls.get(index, 0) if sent is None else sent
        if params.parallel_tool_calls and streams_builtin_calls(
            params.tool_call, params.tool_format, params.tool_names
        ):
            return leading_tagged_calls(text, params.tool_names, in_body=sent > 0)
        if params.tool_call and params.parallel_tool_calls and fmt.parallel:
            return leading_calls(text, params.tool_names, fmt)
        return [], 0

    def chunk(self, index: int, delta: Delta) -> dict[str, Any]:
        calls = self.ready_calls.pop(index, None)
        streamed_text = index in self.texts or not self.generations[index].params.tool_call
        body: dict[str, Any] = {"tool_calls": calls} if calls else {}
        content = self.released.pop(index, delta.text if streamed_text else "")
        if streamed_text or content:
            body["content"] = content
        logprobs = self._logprobs(delta.logprobs) if streamed_text else None
        choice = {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def closing_chunk(self, index: int) -> dict[str, Any]:
        generation = self.generations[index]
        sent = self.sent_calls.get(index, 0)
        delta, finish = {}, self._finish(index, sent > 0)
        if index in self.pending:  # the end of a text that looked like the start of <|python_tag|>
            delta["content"] = self.pending.pop(index)
        if index in self.call_texts:  # what is held: a call, held text that turned out not to be one, or nothing
            message, finish = self._message(index, self.call_texts[index], sent)
            calls = message.get("tool_calls")
            delta = {"tool_calls": [{"index": sent + i, **c} for i, c in enumerate(calls)]} if calls else {}
            if message["content"]:
                delta["content"] = message["content"]
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope(self.chunk_object, [choice], specswarm=speculation_stats([generation.stats]))

    def _finish(self, index: int, calls: bool) -> Optional[str]:
        """A reply that ended by itself with calls in it finishes with "tool_calls"."""
        reason = self.generations[index].finish_reason
        return "tool_calls" if calls and reason == "stop" else reason

    def _message(self, index: int, text: str, sent: int = 0) -> tuple[dict[str, Any], Optional[str]]:
        """The assistant message and finish reason: complete tool calls become ``tool_calls`` (where a
        reply may hold several, the complete ones before any other text, that text the content);
        ``sent``: calls of this choice already streamed before ``text``."""
        generation = self.generations[index]
        params = generation.params
        fmt = FORMATS[params.tool_format]
        prefix, text = self._before_tag(index, text, sent)
        calls, used = self._leading(index, text, sent)
        rest = text[used:]
        ended = params.tool_call and generation.finish_reason == "stop" and rest.strip()
        # the rest of built-in calls whose tag came before it: parsed as the tagged reply it ends
        body = fmt.name == "llama3" and (used > 0 or sent > 0) and not rest.lstrip().startswith(PYTHON_TAG)
        last_text = PYTHON_TAG + rest if body else rest
        last = tool_calls(last_text, params.tool_names, fmt, params.parallel_tool_calls) if ended else None
        calls += last or []
        if calls or sent:
            content = prefix + (rest if last is None and rest.strip() else "")
            return {"role": "assistant", "content": content or None, "tool_calls": calls}, self._finish(index, True)
        return {"role": "assistant", "content": prefix + text}, generation.finish_reason

    def _before_tag(self, index: int, text: str, sent: int) -> tuple[str, str]:
        """An "auto" Llama 3.1 reply's text before ``<|python_tag|>`` (its content) and the rest, where
        text that is not blank comes before the tag; else ("", text)."""
        params = self.generations[index].params
        at = text.find(PYTHON_TAG)
        if params.tool_call != "auto" or params.tool_format != LLAMA3_FORMAT.name or sent or at < 0:
            return "", text
        return (text[:at], text[at:]) if text[:at].strip() else ("", text)

    def response(self, deltas: list[list[Delta]]) -> dict[str, Any]:
        choices = []
        for index, (generation, own) in enumerate(zip(self.generations, deltas)):
            message, finish = self._message(index, "".join(d.text for d in own))
            logprobs = self._logprobs([lp for d in own for lp in d.logprobs])
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return self._envelope(self.object_name, choices, usage=self.usage(), specswarm=speculation_stats(self.stats()))

    def _logprobs(self, entries: list[Optional[TokenLogprobs]]) -> Optional[dict[str, Any]]:
        if self.shown < 0:
            return None
        content = []
        for entry in entries:
            text = self.served.token_text(entry.token_id)
            top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in self._top(entry)]
            content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}


class CompletionFormat(_Format):
    """OpenAI's legacy completions shape, as vLLM returns it: with ``echo`` the prompt's tokens come
    first in ``logprobs`` (the first with ``null`` log-prob and alternatives: it has no context),
    then the generated ones; ``top_logprobs`` holds the K likeliest and the token itself (so up to
    K + 1 entries, as OpenAI documents); ``text_offset`` counts characters from the choice's text start."""

    prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def opening_chunk(self, index: int) -> None:
        return None

    def chunk(self, index: int, delta: Delta) -> dict[str, Any]:
        choice = {"index": index, "text": delta.text, "logprobs": self._logprobs(index, [delta]), "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def closing_chunk(self, index: int) -> dict[str, Any]:
        generation = self.generations[index]
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": generation.finish_reason}
        specswarm = with_prompt_confirmation(speculation_stats([generation.stats]), [generation])
        return self._envelope(self.chunk_object, [choice], specswarm=specswarm)

    def response(self, deltas: list[list[Delta]]) -> dict[str, Any]:
        choices = []
        for index, (generation, own) in enumerate(zip(self.generations, deltas)):
            text, logprobs, finish = "".join(d.text for d in own), self._logprobs(index, own), generation.finish_reason
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        specswarm = with_prompt_confirmation(speculation_stats(self.stats()), self.generations)
        return self._envelope(self.object_name, choices, usage=self.usage(), specswarm=specswarm)

    def _logprobs(self, index: int, deltas: list[Delta]) -> Optional[dict[str, Any]]:
        if self.shown < 0:
            return None
        tokens: list[str] = []
        offsets: list[int] = []
        token_logprobs: list[Optional[float]] = []
        top_logprobs: list[Optional[dict[str, float]]] = []
        for delta in deltas:
            for token_id, entry in zip(delta.token_ids, delta.logprobs):
                tokens.append(self.served.token_text(token_id))
                offsets.append(self.text_offsets[index])
                self.text_offsets[index] += len(tokens[-1])
                token_logprobs.append(None if entry is None else entry.logprob)
                top_logprobs.append(None if entry is None else self._top_with_token(entry))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _top_with_token(self, entry: TokenLogprobs) -> dict[str, float]:
        top = dict(self._top(entry))
        top.setdefault(self.served.token_text(entry.token_id), entry.logprob)
        return top
