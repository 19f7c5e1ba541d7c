"""TailDrafts: the tail's drafts merged with a retrieval drafter's, per lap the better source."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from client.drafting.base import Drafter, _AdaptiveDrafter
from client.drafting.cost_model import ChainCosts
from protocol.tail_costs import TailCosts


class TailDrafts(Drafter):
    """The tail's drafter-drafter ids (``StepResult.drafts``) merged with a retrieval drafter's.

    The tail drafts with a drafter over the final hidden states it has just computed
    (server/tail_drafter.py); its ids arrive with a verdict and continue the committed text after
    that verdict's next token. Each lap this drafter proposes one source's drafts, the one whose
    proposals have matched the committed text for more tokens lately (an EMA of the tokens each
    proposal got right, measured on every proposal of both sources, sent or not: the verdicts'
    exact rule accepts a draft iff it equals the target's own token, so the committed text says
    how many a proposal would have had accepted). Where the chosen one proposes nothing, the other.
    `inner` None: tail drafts only.

    The tail's drafts are priced as a retrieval drafter's are (client/drafting/cost_model.py): their
    own acceptance by depth, measured on the laps that carried them, and the lap times; once those
    are fitted, a lap carries at most the count that maximizes expected tokens per lap time of them.
    """

    SOURCES = ("tail", "retrieval")
    DECAY = 0.3

    def __init__(self, inner: Drafter | None, tail_tokens: int = 4) -> None:
        self.inner = inner
        self.tail_tokens = tail_tokens  # asked of the tail per run (Step.tail_drafts)
        self._context: list[int] = []
        self._tail_drafts: tuple[int, list[int]] | None = (
            None  # the tail's last drafts: (position of the first id, ids)
        )
        self._pending: list[tuple[int, str, list[int]]] = []  # proposals waiting for committed text
        self._score = {source: 1.0 for source in self.SOURCES}
        self._last_source = "retrieval"
        self.fresh = False  # drafter ids arrived with the last verdict and no draft has used them yet
        # per source: proposals measured, ids proposed, ids that matched the committed text
        self.sources = {source: [0, 0, 0] for source in self.SOURCES}
        self.chosen = {source: 0 for source in self.SOURCES}  # laps whose run carried that source's drafts
        self.costs = ChainCosts()  # the tail's drafts' acceptance by depth, and the lap times

    def reset(self, context: Sequence[int]) -> None:
        self._context = list(context)
        self._tail_drafts, self._pending, self.fresh = None, [], False
        self._score = {source: 1.0 for source in self.SOURCES}
        if self.inner is not None:
            self.inner.reset(context)

    def offer(self, position: int, drafts: Sequence[int]) -> None:
        """Drafter ids continuing the committed text from ``position`` (where the verdict's next token ends)."""
        self._tail_drafts = (position, list(drafts))
        self.fresh = bool(drafts)

    def tail_sent_none(self) -> None:
        self.tail_tokens = 0

    def source_stats(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        return {k: list(v) for k, v in self.sources.items()}, dict(self.chosen)

    def extend(self, new_tokens: Sequence[int]) -> None:
        self._context.extend(new_tokens)
        if self.inner is not None:
            self.inner.extend(new_tokens)
        still = []
        for position, source, ids in self._pending:
            seen = self._context[position : position + len(ids)]
            matched = next((i for i, (a, b) in enumerate(zip(ids, seen)) if a != b), len(seen))
            if matched < len(seen) or len(seen) == len(ids):
                stats = self.sources[source]
                stats[0], stats[1], stats[2] = stats[0] + 1, stats[1] + len(ids), stats[2] + matched
                self._score[source] += self.DECAY * (matched - self._score[source])
            else:
                still.append((position, source, ids))
        self._pending = still

    def _tail_after(self, after: Sequence[int]) -> list[int]:
        """The drafter's ids that continue context + ``after``, if the text so far follows them."""
        if self._tail_drafts is None:
            return []
        position, ids = self._tail_drafts
        context = self._context + list(after)
        if not position <= len(context) <= position + len(ids) or context[position:] != ids[: len(context) - position]:
            return []
        return ids[len(context) - position :]

    def price_laps(self, lap_costs: tuple[float, float]) -> None:
        """Price laps at fixed costs (ChainCosts), here and in the retrieval drafter inside."""
        self.costs = ChainCosts(lap_costs)
        if isinstance(self.inner, _AdaptiveDrafter):
            self.inner.price_laps(lap_costs)

    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        offered = self._tail_after(after)[:max_tokens]
        priced = self.costs.cap(len(offered)) if offered else None
        tail = offered if priced is None else offered[:priced]  # what the lap carries of the tail's ids
        retrieval = self.inner.draft(max_tokens, after) if self.inner is not None else []
        if not after:  # a lap's own proposal: measure both (the tail's as offered), whichever is sent
            position = len(self._context)
            self._pending += [
                (position, source, ids) for source, ids in (("tail", offered), ("retrieval", retrieval)) if ids
            ]
            self.fresh = False
        source = "tail" if self._score["tail"] >= self._score["retrieval"] else "retrieval"
        chosen = tail if source == "tail" else retrieval
        if not chosen:
            source, chosen = ("retrieval", retrieval) if source == "tail" else ("tail", tail)
        if not after and chosen:
            self._last_source = source
            self.chosen[source] += 1
        return chosen

    @property
    def draft_cap(self) -> int:
        cap = self.inner.draft_cap if self.inner is not None else 0
        return max(cap, len(self._tail_after(())), 1)

    def alternatives(self, k: int, after: Sequence[int] = ()) -> list[int]:
        return self.inner.alternatives(k, after) if self.inner is not None else []

    def ranked(self, k: int, after: Sequence[int] = ()) -> list[tuple[int, float]]:
        return self.inner.ranked(k, after) if self.inner is not None else []

    def extra_chains(self, max_tokens: int) -> list[list[int]]:
        """The source the last `draft` did not send: a token tree carries both (no measurement)."""
        if self._last_source == "tail":
            other = self.inner.draft(max_tokens) if self.inner is not None else []
        else:
            other = self._tail_after(())[:max_tokens]
        return [other] if other else []

    def cap_after(self, drafted: int, accepted: int) -> int:
        return self.inner.cap_after(drafted, accepted) if self.inner is not None else self.tail_tokens

    def observe_lap(self, positions: int, seconds: float, tail: Optional[TailCosts] = None) -> None:
        self.costs.observe_lap(positions, seconds, tail)
        if self.inner is not None:
            self.inner.observe_lap(positions, seconds, tail)

    def observe(self, drafted: int, accepted: int) -> None:
        if self._last_source == "tail" or drafted == 0:
            self.costs.observe(drafted, accepted)
        if self.inner is not None and self._last_source == "retrieval":
            self.inner.observe(drafted, accepted)

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()
