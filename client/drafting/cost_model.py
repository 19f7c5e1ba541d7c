"""How many drafts a chain run should carry: the count that maximizes expected tokens per lap time.

A lap with k drafts yields 1 + sum_{j<=k} P(the first j drafts are all accepted) tokens and takes
T(k) = fixed + per_position x (committed + k). The lap has two parts, measured apart (:class:`LapCosts`):
the tail's verification, which the tail times and reports in its verdict (``StepResult.tail_costs``,
server/tail_costs.py): its blocks per position, and each LM-head call with the rows it read, fitted
as one call's cost plus a cost per row; and the rest, the network (every hop's latency, the hops
before the tail and each run's overheads): the lap's wall-clock time less the tail's report, fitted
against the positions sent. So a slow tail prices each draft higher, and a slow link makes the fixed
part, which drafts share, larger: the choice of k answers each. Without reports (an older tail) the
whole lap time is fitted as the network's. A verification whose walk reads past the rows of the tail's
first LM-head call (server/verify_rows.py plans them) needs a second call: the laps that reported one say
how many rows the first computes, and a lap of that many drafts or more is priced a call more with the
chance that all of them are accepted. Acceptance is measured per draft depth. The count is chosen
from 0 (a lap without drafts) up, so a lap with drafts is never slower in expectation than one without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from protocol.tail_costs import TailCosts


@dataclass(frozen=True)
class LapCosts:
    """A lap's time, by where it is spent (seconds). ``network_s``: the lap's fixed part outside the
        tail (latency, the hops before it, overheads); ``network_per_position_s``: one more position there
        (the hops before the tail, the wire); ``tail_call_s``: the tail's LM-head call before its rows (a
        memory-bound tail reads the whole matrix whatever the rows); ``tail_per_position_s``: one more
        position at the tail (its blocks, and one more row of the LM head); ``first_call_rows``: the rows
    the tail's first LM-head call computes (server/verify_rows.py plans them), so a verification that
    accepts that many drafts or more costs a second call (``tail_call_s`` more); 0: not priced;
    ``tail_blocks_s``: the tail's blocks before their positions (a forward pass of one position costs
    most of what one of ten does)."""

    network_s: float
    network_per_position_s: float = 0.0
    tail_call_s: float = 0.0
    tail_per_position_s: float = 0.0
    first_call_rows: int = 0  # rows the tail's first LM-head call computes (0: a second call is not priced)
    tail_blocks_s: float = 0.0  # the tail's blocks, whatever the positions

    def lap_s(self, positions: int) -> float:
        """The expected time of a lap of ``positions`` positions (committed ids and drafts)."""
        fixed = self.network_s + self.tail_call_s + self.tail_blocks_s
        return fixed + (self.network_per_position_s + self.tail_per_position_s) * positions


def split_draft_count(acceptance: Sequence[float], costs: LapCosts, max_drafts: int, committed: int = 1) -> int:
    """:func:`draft_count` for a lap priced by its parts: the fixed part is the network's, one
    LM-head call's and the tail's blocks', each position costs the network's and the tail's per-position
    prices."""
    return draft_count(
        acceptance,
        costs.network_s + costs.tail_call_s + costs.tail_blocks_s,
        costs.network_per_position_s + costs.tail_per_position_s,
        max_drafts,
        committed,
        second_call_s=costs.tail_call_s,
        first_call_rows=costs.first_call_rows,
    )


def draft_count(
    acceptance: Sequence[float],
    fixed_s: float,
    per_position_s: float,
    max_drafts: int,
    committed: int = 1,
    second_call_s: float = 0.0,
    first_call_rows: int = 0,
) -> int:
    """The number of drafts in [0, max_drafts] with the most expected tokens per second.

    ``acceptance[d]``: the probability that draft d + 1 is accepted given that the d before it
    were (depths past the end of the sequence take its last value; an empty sequence means 0).
    Ties go to fewer drafts: a draft must pay for itself strictly. ``second_call_s``: what the
    tail's second LM-head call costs, which a lap of k >= ``first_call_rows`` drafts (> 0) needs when
    its walk reads past the first call's rows: when its first ``first_call_rows`` drafts are all
    accepted (the walk reads accepted + 1 rows).
    """
    if fixed_s < 0 or per_position_s < 0 or second_call_s < 0:
        raise ValueError(
            f"lap costs must be >= 0, got fixed {fixed_s} s, per position {per_position_s} s"
            f" and second call {second_call_s} s"
        )
    second_call_p = 0.0  # P(the first first_call_rows drafts are all accepted), once k reaches that

    def lap(k: int) -> float:
        return max(1e-9, fixed_s + per_position_s * (committed + k) + second_call_s * second_call_p)

    best_k, best_rate = 0, 1.0 / lap(0)
    expected, reach = 1.0, 1.0
    for k in range(1, max_drafts + 1):
        p = acceptance[min(k, len(acceptance)) - 1] if acceptance else 0.0
        reach *= min(1.0, max(0.0, p))
        expected += reach
        if k == first_call_rows:
            second_call_p = reach
        rate = expected / lap(k)
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


def check_lap_costs(lap_costs: object) -> tuple[float, float]:
    """``(fixed_s, per_position_s)``, both finite and >= 0, or a ValueError naming what is wrong."""
    try:
        fixed_s, per_position_s = (float(x) for x in lap_costs)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"draft_lap_costs must be (fixed_s, per_position_s), got {lap_costs!r}") from None
    if not (0 <= fixed_s < float("inf") and 0 <= per_position_s < float("inf")):
        raise ValueError(f"draft_lap_costs must be finite and >= 0, got {lap_costs!r}")
    return fixed_s, per_position_s


class DecayedLine:
    """A decayed least-squares fit of y against x (older points weigh ``decay`` less per point):
    the running sums that ChainCosts and client/_trees.py's TreeSizer fit lap time against positions with."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    def mean_x(self) -> float:
        return self.x / self.w if self.w > 0 else 0.0

    def mean_y(self) -> float:
        return self.y / self.w if self.w > 0 else 0.0

    def spread(self) -> float:
        """The weighted sum of squared deviations of x (0: every x alike, no slope measurable)."""
        return self.xx - self.w * self.mean_x() ** 2

    def covariance(self) -> float:
        return self.xy - self.w * self.mean_x() * self.mean_y()

    def varied(self) -> bool:
        """Whether x varied enough to measure a slope (points of one size measure none)."""
        return self.w > 0 and self.spread() > 0.25 * self.w

    def fit(self) -> tuple[float, float]:
        """``(intercept, slope)``, neither below 0; meaningful where :meth:`varied`."""
        slope = max(0.0, self.covariance() / self.spread())
        return max(0.0, self.mean_y() - slope * self.mean_x()), slope


class TailFit:
    """The tail's reported costs (``StepResult.tail_costs``), fitted: its blocks' time per position,
    and each LM-head call as one call's cost plus a cost per row. Shared by ChainCosts and TreeSizer,
    which both take the tail's part out of a lap's wall-clock time and price it apart."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.calls = DecayedLine(decay)  # LM-head calls: seconds against rows
        self.blocks = DecayedLine(decay)  # the tail's blocks: seconds against positions
        self._first_rows = [0.0, 0.0]  # laps with a second LM-head call: decayed weight, the first call's rows
        self.reported = False

    def observe(self, positions: int, tail: TailCosts) -> float:
        """Fold one verdict's report into the fits; the seconds it reports for this lap."""
        d = self.decay
        self.reported = True
        self.blocks.add(positions, tail.blocks_us * 1e-6)
        for rows, us in zip(tail.head_rows, tail.head_us):
            self.calls.add(rows, us * 1e-6)
        if len(tail.head_rows) > 1:  # the walk read past the first call: its row count was the tail's plan
            self._first_rows = [d * self._first_rows[0] + 1, d * self._first_rows[1] + tail.head_rows[0]]
        return (tail.blocks_us + sum(tail.head_us)) * 1e-6

    def costs(self) -> tuple[float, float]:
        """``(tail_call_s, tail_per_position_s)``: an LM-head call before its rows, and one more
        position (the blocks' slope, :meth:`blocks_fit`, plus a row of a call); ``(0, 0)`` before any
        report. Until calls of different sizes are timed, a call's whole cost is its fixed part."""
        calls = self.calls  # calls of different sizes: the per-row cost is measured
        base, per_row = calls.fit() if calls.varied() else (max(0.0, calls.mean_y()), 0.0)
        return base, self.blocks_fit()[1] + per_row

    def blocks_fit(self) -> tuple[float, float]:
        """``(fixed_s, per_position_s)`` of the tail's blocks: intercept and slope once laps of different
        sizes are reported, their whole time per position before (``(0, 0)`` before any report). Why: a
        forward pass costs most of its time whatever the positions (on the 2-core machine, 25 ms for one
        position, 39 for three, 50 for twelve), so the time per position of small laps priced every draft at
        four times its cost, and the cost model cut drafts that would have paid (docs/benchmarks.md)."""
        line = self.blocks
        if line.w <= 0 or line.x <= 0:
            return 0.0, 0.0
        return line.fit() if line.varied() else (0.0, line.y / line.x)  # laps of one size: no slope

    def first_call_rows(self) -> int:
        """The rows the tail's first LM-head call computes, as the laps that needed a second call
        reported them (server/verify_rows.py plans them from the session's acceptance); 0 before
        any second call was reported (then none is priced)."""
        w, rows = self._first_rows
        return max(1, round(rows / w)) if w > 0 else 0


class ChainCosts:
    """The measurements ``draft_count`` takes, for one drafter: lap time against positions sent
    (decayed least squares, as client/_trees.py's TreeSizer fits trees), and acceptance per depth.

    Until laps of different sizes have been measured (``fitted``), it makes no choice (``cap`` is
    None) and the drafter drafts as it did without it. A count of 0 is probed with one draft every
    PROBE_EVERY laps, so acceptance stays measured when the text turns predictable.

    ``lap_costs=(fixed_s, per_position_s)`` prices every lap at those costs instead of fitting the
    measured wall-clock times (``generate(draft_lap_costs=...)``): the count then follows from the
    verdicts alone, so the same verdicts give the same Step shapes run after run, which tests that
    compare Step shapes need. ``(1.0, 0.0)``: positions cost nothing, so the cost model never cuts
    a draft and the drafter's adaptive length alone decides.
    """

    DECAY = 0.9
    FIT_MAX_POSITIONS = 128  # a prompt's prefill stays out of the fit
    PRIOR_ACCEPTANCE = 0.5  # per depth, worth PRIOR_WEIGHT laps until laps say otherwise
    PRIOR_WEIGHT = 1.0
    MAX_DEPTH = 32
    PROBE_EVERY = 4

    def __init__(self, lap_costs: tuple[float, float] | None = None) -> None:
        self._line = DecayedLine(self.DECAY)  # the network's part of each lap against its positions
        self._tail = TailFit(self.DECAY)  # the tail's reports
        self.split: Optional[LapCosts] = None  # the fitted lap, by part
        self.fixed_s, self.per_position_s = 0.0, 0.0
        self.fitted = False
        self.priced = lap_costs is not None  # fixed lap costs: measured lap times are not fitted
        if lap_costs is not None:
            self.fixed_s, self.per_position_s = check_lap_costs(lap_costs)
            self.fitted = True
        self._reached = [0.0] * self.MAX_DEPTH  # decayed laps whose draft reached depth d + 1
        self._accepted = [0.0] * self.MAX_DEPTH  # ... and whose draft d + 1 was accepted
        self._laps_without = 0  # laps since the last one that carried drafts

    @property
    def reported(self) -> bool:
        """The tail has reported its costs: ``split`` parts them from the network's."""
        return self._tail.reported

    def observe_lap(self, positions: int, seconds: float, tail: Optional[TailCosts] = None) -> None:
        """A timed lap of ``positions`` positions (committed ids and drafts), with the tail's report
        of its own part (None from a tail that sends none): the network's part is the rest."""
        if self.priced or positions <= 0 or not seconds > 0 or positions > self.FIT_MAX_POSITIONS:
            return
        if tail is not None:
            seconds = max(0.0, seconds - self._tail.observe(positions, tail))
        line = self._line
        line.add(positions, seconds)
        if line.varied():  # laps of different sizes: the slope is measured
            network_s, slope = line.fit()
            blocks_s = self._tail.blocks_fit()[0]
            self.split = LapCosts(network_s, slope, *self.tail_costs(), self._tail.first_call_rows(), blocks_s)
            self.fixed_s = self.split.network_s + self.split.tail_call_s + blocks_s
            self.per_position_s = self.split.network_per_position_s + self.split.tail_per_position_s
            self.fitted = True

    def tail_costs(self) -> tuple[float, float]:
        """``(tail_call_s, tail_per_position_s)`` from the tail's reports (:class:`TailFit`)."""
        return self._tail.costs()

    def observe(self, drafted: int, accepted: int) -> None:
        """A verdict: ``accepted`` of ``drafted`` drafts kept (the first ``accepted`` of them)."""
        self._laps_without = 0 if drafted > 0 else self._laps_without + 1
        if drafted <= 0:
            return
        d = self.DECAY
        self._reached = [d * x for x in self._reached]
        self._accepted = [d * x for x in self._accepted]
        for depth in range(min(drafted, accepted + 1, self.MAX_DEPTH)):
            self._reached[depth] += 1.0
            self._accepted[depth] += 1.0 if depth < accepted else 0.0

    def acceptance(self) -> list[float]:
        """P(draft d + 1 accepted | the d before it were), per depth, shrunk towards the prior."""
        w, prior = self.PRIOR_WEIGHT, self.PRIOR_ACCEPTANCE
        return [(a + w * prior) / (r + w) for a, r in zip(self._accepted, self._reached)]

    def cap(self, max_drafts: int) -> int | None:
        """The draft count the measurements choose, or None while the lap time is unmeasured."""
        if not self.fitted:
            return None
        split = self.split if not self.priced else None
        second_call_s, first_rows = (split.tail_call_s, split.first_call_rows) if split is not None else (0.0, 0)
        count = draft_count(
            self.acceptance(), self.fixed_s, self.per_position_s, max_drafts, 1, second_call_s, first_rows
        )
        if count == 0 and self._laps_without >= self.PROBE_EVERY:
            return 1
        return count


__all__ = ["ChainCosts", "DecayedLine", "LapCosts", "TailFit", "check_lap_costs", "draft_count", "split_draft_count"]
