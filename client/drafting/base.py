"""The drafter interface the decoder calls, and the adaptive draft length most drafters share.

Every ability a caller may use is declared here with a safe default (a drafter that cannot
rank, take the tail's drafts or sample from its q says so by not overriding it), so no caller
guesses with ``hasattr``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Optional

from client.drafting.cost_model import ChainCosts
from protocol.tail_costs import TailCosts


class Drafter(abc.ABC):
    """One stream's draft source. The client calls, per stream:
    `reset(prompt)`, then per lap `propose(k)` -> send -> `observe(len(draft), accepted)` ->
    `extend(committed_tokens)`, and `finish()` when the stream ends.

    `after` (in `draft`, `propose`, `alternatives`) is a list of tokens assumed to follow the
    committed context without being committed: asynchronous speculation drafts past runs still
    in flight, and outcome hedging drafts past verdicts not yet received. The drafter's own
    state never holds uncommitted tokens, so a refuted assumption costs nothing to undo.

    What a drafter can do beyond drafting is declared here, with the default of a drafter that
    cannot: the decoder and the modes ask these, never ``hasattr``.
    """

    fresh: bool = False
    """Whether ids that arrived with the last verdict (the tail's drafts) are not yet drafted from:
    they postdate every hedge, so the next run drafts afresh instead of taking a hedge."""
    tail_tokens: int = 0
    """Drafts to ask of the tail per run (``Step.tail_drafts``); 0: this drafter takes none."""
    last_q: Sequence[float] = ()
    """q(x) of each id the last ``draft`` call drew (a drafter that ``samples`` only)."""
    last_dists: Sequence[Any] = ()
    """The drafter's whole q at each of those positions (a drafter that ``samples`` only)."""

    @property
    def samples(self) -> bool:
        """Whether drafts are drawn from the drafter's own q, recorded in ``last_q`` and
        ``last_dists``: what the rejection rule needs (client/draft_model.py)."""
        return False

    def offer(self, position: int, drafts: Sequence[int]) -> None:
        """The tail's drafts, continuing the committed text from ``position``; ignored unless the
        drafter merges them (TailDrafts)."""

    def tail_sent_none(self) -> None:
        """The tail sent no drafts when asked (it has no drafter): stop asking (2 bytes up per lap)."""

    def source_stats(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Per draft source, [proposals measured, ids proposed, ids that matched], and the laps that
        carried each source's drafts; empty for a drafter with one source."""
        return {}, {}

    @abc.abstractmethod
    def reset(self, context: Sequence[int]) -> None:
        """Start a new stream whose context (prompt) is `context`."""

    @abc.abstractmethod
    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append committed tokens to the context, incrementally (no rebuild)."""

    @abc.abstractmethod
    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `max_tokens` ids that continue context + `after`; [] when there is no guess."""

    def propose(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        """`draft` under the drafter's current adaptive length limit."""
        return self.draft(min(max_tokens, self.draft_cap), after)

    @property
    def draft_cap(self) -> int:
        """The adaptive limit on `propose`; none unless a subclass adapts."""
        return 1 << 30

    def alternatives(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `k` likeliest next tokens after context + `after`, best first (what outcome
        hedging prepares drafts for). Default: none known."""
        return []

    def ranked(self, k: int, after: Sequence[int] = ()) -> list[tuple[int, float]]:
        """Up to `k` likeliest next tokens with an estimate of each one's probability, best first
        (what token trees branch on, client/_trees.py). Default: `alternatives` at 1/2, 1/3, 1/4,
        ... by rank; a drafter that knows better (SuffixDrafter: empirical frequencies) overrides it."""
        return [(tok, 1.0 / (rank + 2)) for rank, tok in enumerate(self.alternatives(k, after))]

    def cap_after(self, drafted: int, accepted: int) -> int:
        """What `draft_cap` will be after `observe(drafted, accepted)`."""
        return self.draft_cap

    def extra_chains(self, max_tokens: int) -> list[list[int]]:
        """Other sources' proposals for this lap, besides `draft`'s (a token tree carries them as
        branches; client/_trees.py). Default: none."""
        return []

    @abc.abstractmethod
    def observe(self, drafted: int, accepted: int) -> None:
        """Feedback after a lap: `accepted` of the `drafted` ids were kept (bonus not counted)."""

    def observe_lap(self, positions: int, seconds: float, tail: Optional[TailCosts] = None) -> None:
        """A lap of ``positions`` positions (committed ids and drafts) took ``seconds``, from sending
        to its verdict, of which the tail reports ``tail`` (None: no report): what the draft cost
        model fits (client/drafting/cost_model.py). Default: unused."""

    @abc.abstractmethod
    def finish(self) -> None:
        """The stream ended (its tokens may now serve later streams)."""


class _AdaptiveDrafter(Drafter):
    """Adaptive draft length from an exponential moving average of accepted drafts per lap.

    cap = clamp(floor(GROWTH * ema) + 1, 1, num_draft_tokens), ema <- ema + DECAY * (a - ema).
    In steady state the cap is about twice the usual accepted run plus one: room to grow when
    the text turns predictable, without paying server compute for drafts that keep failing.
    The EMA starts optimistic (at num_draft_tokens) on every reset, so a stream begins with
    the full cap. Laps that say nothing about the cap are ignored: one that drafted nothing,
    and one whose draft, shorter than the cap, was accepted whole (the drafter's own
    evidence ended it, not the cap, and nothing was rejected).

    Once lap times of different sizes are measured, the cap is also at most what the cost model
    chooses (client/drafting/cost_model.py): the count with the most expected tokens per lap time,
    which may be 0 (a lap without drafts) where drafts do not pay. Drafts only change speed.
    """

    DECAY = 0.5
    GROWTH = 2.0

    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens
        self._ema = float(num_draft_tokens)
        self.costs = ChainCosts()

    @property
    def draft_cap(self) -> int:
        """The current adaptive limit on the draft length, in [0, num_draft_tokens]."""
        return self._cap(self._ema)

    def observe(self, drafted: int, accepted: int) -> None:
        self._ema = self._ema_after(drafted, accepted)
        self.costs.observe(drafted, accepted)

    def observe_lap(self, positions: int, seconds: float, tail: Optional[TailCosts] = None) -> None:
        self.costs.observe_lap(positions, seconds, tail)

    def price_laps(self, lap_costs: tuple[float, float]) -> None:
        """Price laps at fixed costs instead of measured lap times (ChainCosts: deterministic Step shapes)."""
        self.costs = ChainCosts(lap_costs)

    def cap_after(self, drafted: int, accepted: int) -> int:
        return self._cap(self._ema_after(drafted, accepted))

    def _ema_after(self, drafted: int, accepted: int) -> float:
        accepted = max(0, min(accepted, drafted))
        if drafted <= 0 or accepted == drafted < self.draft_cap:
            return self._ema
        return self._ema + self.DECAY * (accepted - self._ema)

    def _cap(self, ema: float) -> int:
        cap = max(1, min(self.num_draft_tokens, int(self.GROWTH * ema) + 1))
        priced = self.costs.cap(self.num_draft_tokens)
        return cap if priced is None else min(cap, priced)

    def _restart_ema(self) -> None:
        self._ema = float(self.num_draft_tokens)
