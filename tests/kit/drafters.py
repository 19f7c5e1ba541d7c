"""Drafters whose drafts a test chooses, so it knows which ones the target must accept."""

from __future__ import annotations

from client.drafting import Drafter


class ScriptedDrafter(Drafter):
    """Drafts from a known continuation, right or deliberately wrong at chosen offsets."""

    def __init__(self, truth: list[int], prompt_len: int, wrong_at: set[int] = frozenset(), length: int = 4):
        self.truth, self.prompt_len, self.wrong_at, self.length = truth, prompt_len, wrong_at, length
        self.position = 0

    def reset(self, context):
        self.position = len(context) - self.prompt_len

    def extend(self, new_tokens):
        self.position += len(new_tokens)

    def draft(self, max_tokens, after=()):
        start = self.position + len(after)  # the script ignores what `after` holds
        drafts = self.truth[start : start + min(max_tokens, self.length)]
        return [(t + 1) % 1000 if start + i in self.wrong_at else t for i, t in enumerate(drafts)]

    def observe(self, drafted, accepted):
        pass

    def finish(self):
        pass
