"""Tokens to text, one token at a time: incremental detokenization and stop strings.

Streaming and non-streaming responses both build their text from these pieces, in the same
order, so a streamed answer's deltas concatenate to exactly the non-streamed text.
"""

from __future__ import annotations

from typing import Any, Sequence

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first new ones (spaces depend on them)


class IncrementalDetokenizer:
    """Text of each new token, decoded in a short window of context (the method of vLLM and TGI).

    A token's text depends on its neighbours (leading spaces, multi-byte characters split over
    tokens), so each step decodes the window ``ids[prefix:]`` and emits what it adds to the text of
    ``ids[prefix:read]``. A window that ends inside a UTF-8 character (U+FFFD at its end) emits
    nothing until the character is complete.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], keep: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix, self.read = 0, len(self.ids)
        # special tokens whose text stays (skip_special_tokens drops the others): Llama 3.1's
        # <|python_tag|>, which says what follows is a tool call (swarm/api/llama_tools.py)
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        self.kept = {tokenizer.convert_tokens_to_ids(t): t for t in keep if t in special}

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before, after = self._window()
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character stays U+FFFD)."""
        before, after = self._window()
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""

    def _window(self) -> tuple[str, str]:
        return self._decode(self.ids[self.prefix : self.read]), self._decode(self.ids[self.prefix :])

    def _decode(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        if not self.kept or not any(i in self.kept for i in ids):
            return decode(ids, skip_special_tokens=True)
        text, start = "", 0
        for at, token in enumerate(ids):
            if token in self.kept:
                text += decode(ids[start:at], skip_special_tokens=True) + self.kept[token]
                start = at + 1
        return text + decode(ids[start:], skip_special_tokens=True)


class StopMatcher:
    """Cuts the text exactly before the first stop string, whatever tokens it spans.

    ``feed`` returns the text that is safe to send now: text that could still turn out to be the
    start of a stop string is held back until the next piece settles it (or ``finish``).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        search_from = max(0, len(self.text) - self.longest + 1)  # a stop may begin in old text
        self.text += piece
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def finish(self) -> str:
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        for length in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self.stops):
                return length
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out
