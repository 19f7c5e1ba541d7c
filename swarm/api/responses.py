"""Response bodies and stream chunks of /v1/chat/completions and /v1/completions.

Both endpoints share the envelope (id, object, created, model) and the speculation stats; they
differ in how a choice carries its text (``message``/``delta`` vs ``text``) and its log-probs.
Speculation stats ride in a ``specswarm`` field (clients ignore unknown fields) and, for
non-streamed responses, in ``x-specswarm-*`` headers.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Optional

from client import GenerationStats
from protocol.messages import TokenLogprobs
from swarm.api.engine import Delta, ServedModel, TextGeneration


def speculation_stats(stats: GenerationStats) -> dict[str, Any]:
    return {
        "laps": stats.laps,
        "accepted_per_lap": round(stats.accepted_per_lap, 3),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "failovers": stats.failovers,
    }


def speculation_headers(stats: GenerationStats) -> dict[str, str]:
    return {f"x-specswarm-{key.replace('_', '-')}": str(value) for key, value in speculation_stats(stats).items()}


class _Format:
    prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(self, served: ServedModel, generation: TextGeneration, shown_logprobs: int):
        self.served, self.generation = served, generation
        self.shown = shown_logprobs  # top log-probs shown per token; -1: log-probs not asked for
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.text_offset = 0

    def _envelope(self, object_name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.served.name,
                "choices": choices, **extra}  # fmt: skip

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.generation.params.prompt_ids), self.generation.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def wants_chunk(self, delta: Delta) -> bool:
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

    def opening_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": delta.text}, "logprobs": self._logprobs(delta.logprobs), "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def closing_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.generation.finish_reason}
        return self._envelope(self.chunk_object, [choice], specswarm=speculation_stats(self.generation.stats))

    def response(self, deltas: list[Delta]) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(d.text for d in deltas)}
        logprobs = self._logprobs([lp for d in deltas for lp in d.logprobs])
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self.generation.finish_reason}
        return self._envelope(self.object_name, [choice], usage=self.usage(), specswarm=speculation_stats(self.generation.stats))

    def _logprobs(self, entries: list[TokenLogprobs]) -> Optional[dict[str, Any]]:
        if self.shown < 0:
            return None
        content = []
        for entry in entries:
            text = self.served.token_text(entry.token_id)
            top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in self._top(entry)]
            content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}


class CompletionFormat(_Format):
    prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def opening_chunk(self) -> None:
        return None

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice = {"index": 0, "text": delta.text, "logprobs": self._logprobs(delta.logprobs), "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def closing_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": self.generation.finish_reason}
        return self._envelope(self.chunk_object, [choice], specswarm=speculation_stats(self.generation.stats))

    def response(self, deltas: list[Delta]) -> dict[str, Any]:
        logprobs = self._logprobs([lp for d in deltas for lp in d.logprobs])
        choice = {"index": 0, "text": "".join(d.text for d in deltas), "logprobs": logprobs,
                  "finish_reason": self.generation.finish_reason}  # fmt: skip
        return self._envelope(self.object_name, [choice], usage=self.usage(), specswarm=speculation_stats(self.generation.stats))

    def _logprobs(self, entries: list[TokenLogprobs]) -> Optional[dict[str, Any]]:
        if self.shown < 0:
            return None
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(self.served.token_text(entry.token_id))
            offsets.append(self.text_offset)
            self.text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(self._top(e)) for e in entries],
            "text_offset": offsets,
        }
