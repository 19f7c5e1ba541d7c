"""GrammarDrafts: the tokens a constraint forces, drafted ahead of another drafter's.

Under a constraint (docs/design.md, "Constraints at the tail") the next tokens are often forced: a
schema's keys, quotes, braces and separators, the end of an enum value, the stop token after a
complete answer. The client tracks the same constraint the tail masks with (a Guide of its own,
protocol/constraints.py) and drafts those tokens first: the ids whose mask allows nothing else (the
tail must choose them, greedy or sampled), then xgrammar's tokenization of the text forced after them
(``find_jump_forward_tokens``: likely, not certain). After them the inner drafter (suffix, n-gram, ...)
drafts under its own adaptive cap, its drafts cut at the first id the constraint forbids (the tail
could not choose it), and the forced tokens after those follow. Drafts never change the output
(the tail's exact rule decides); they only save laps (jump-forward decoding, as SGLang calls it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from client.drafting.base import Drafter
from protocol.constraints import Guide
from protocol.messages import Constraint
from protocol.tail_costs import TailCosts


class GrammarDrafts(Drafter):
    """Forced tokens, then ``inner``'s drafts (None: forced tokens only). ``compiled``: the
    constraint compiled by the client's ConstraintCompiler; the Guide starts at each reset's context."""

    def __init__(self, inner: Optional[Drafter], compiled: Any, constraint: Constraint, vocab_size: int):
        self.inner, self._compiled, self._constraint, self._vocab = inner, compiled, constraint, vocab_size
        self._context: list[int] = []
        self._guide: Optional[Guide] = None
        self._last_forced = 0  # forced ids at the head of the last draft (not the inner's to learn from)
        self.forced_drafted = 0  # ids this drafter proposed from the grammar, over the stream

    # the inner drafter's abilities, passed through
    @property
    def tail_tokens(self) -> int:  # type: ignore[override]
        return self.inner.tail_tokens if self.inner is not None else 0

    @property
    def fresh(self) -> bool:  # type: ignore[override]
        return self.inner.fresh if self.inner is not None else False

    def offer(self, position: int, drafts: Sequence[int]) -> None:
        if self.inner is not None:
            self.inner.offer(position, drafts)

    def tail_sent_none(self) -> None:
        if self.inner is not None:
            self.inner.tail_sent_none()

    def source_stats(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        return self.inner.source_stats() if self.inner is not None else ({}, {})

    def alternatives(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """The inner drafter's, less those the constraint forbids (the tail can never choose them)."""
        found = self.inner.alternatives(k, after) if self.inner is not None else []
        return [t for t in found if self._allows(after, t)]

    def ranked(self, k: int, after: Sequence[int] = ()) -> list[tuple[int, float]]:
        found = self.inner.ranked(k, after) if self.inner is not None else []
        return [(t, p) for t, p in found if self._allows(after, t)]

    def _allows(self, after: Sequence[int], token: int) -> bool:
        try:
            return self._guide is None or self._guide.valid_prefix(self._context + list(after), [token]) == 1
        except ValueError:  # ``after`` itself breaks the constraint
            return False

    def extra_chains(self, max_tokens: int) -> list[list[int]]:
        return self.inner.extra_chains(max_tokens) if self.inner is not None else []

    # the stream
    def reset(self, context: Sequence[int]) -> None:
        self._context = list(context)
        self._guide = Guide(self._compiled, self._constraint, len(context), self._vocab)
        if self.inner is not None:
            self.inner.reset(context)

    def extend(self, new_tokens: Sequence[int]) -> None:
        self._context.extend(new_tokens)
        if self.inner is not None:
            self.inner.extend(new_tokens)

    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        if self._guide is None or max_tokens <= 0:
            return []
        context = self._context + list(after)
        try:
            drafts = self._guide.forced(context, max_tokens)
        except ValueError:  # an outcome the constraint rules out (a hedge on a forbidden id): nothing to draft
            return []
        self._last_forced = len(drafts)
        if self.inner is not None and len(drafts) < max_tokens:
            room = min(max_tokens - len(drafts), self.inner.draft_cap)
            guessed = self.inner.draft(room, list(after) + drafts)
            kept = self._guide.valid_prefix(context + drafts, guessed)
            drafts += guessed[:kept]
            if kept and len(drafts) < max_tokens:
                drafts += self._guide.forced(context + drafts, max_tokens - len(drafts))
        self.forced_drafted += self._last_forced
        return drafts

    def observe_lap(self, positions: int, seconds: float, tail: Optional[TailCosts] = None) -> None:
        if self.inner is not None:
            self.inner.observe_lap(positions, seconds, tail)

    def observe(self, drafted: int, accepted: int) -> None:
        """The inner drafter learns from its own part of the last draft only (forced ids are the grammar's)."""
        if self.inner is not None:
            forced = min(self._last_forced, drafted)
            self.inner.observe(drafted - forced, max(0, accepted - forced))

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()


def with_grammar_drafts(
    drafter: Optional[Drafter], constraint: Optional[Constraint], tokenizer: Any, vocab_size: int
) -> Optional[Drafter]:
    """``drafter`` with the constraint's forced tokens ahead of its drafts; as it was without a
    constraint, or without speculation (None: the caller asked for no drafts at all)."""
    if drafter is None or constraint is None:
        return drafter
    from client._calls import compiler_for  # the client's compiler cache (one per tokenizer)

    compiled = compiler_for(tokenizer, vocab_size).compile(constraint)
    return GrammarDrafts(drafter, compiled, constraint, vocab_size)
