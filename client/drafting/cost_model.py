"""How many drafts a chain run should carry: the count that maximizes expected tokens per lap time.

A lap with k drafts yields 1 + sum_{j<=k} P(the first j drafts are all accepted) tokens and takes
T(k) = fixed + per_position x (committed + k): ``fixed`` is the network (every hop's latency) and
each run's overheads, ``per_position`` what one more position costs the servers (every hop's
blocks, the tail's verification row and its share of the LM head). Both are fitted from the lap
times the client measures; acceptance is measured per draft depth. The count is chosen from 0 (a
lap without drafts) up, so a lap with drafts is never slower in expectation than one without: on a
free link with drafts that never land it is 0, and the longer the link, the more drafts pay.
"""

from __future__ import annotations

from collections.abc import Sequence


def draft_count(
    acceptance: Sequence[float], fixed_s: float, per_position_s: float, max_drafts: int, committed: int = 1
) -> int:
    """The number of drafts in [0, max_drafts] with the most expected tokens per second.

    ``acceptance[d]``: the probability that draft d + 1 is accepted given that the d before it
    were (depths past the end of the sequence take its last value; an empty sequence means 0).
    Ties go to fewer drafts: a draft must pay for itself strictly.
    """
    if fixed_s < 0 or per_position_s < 0:
        raise ValueError(f"lap costs must be >= 0, got fixed {fixed_s} s and per position {per_position_s} s")

    def lap(k: int) -> float:
        return max(1e-9, fixed_s + per_position_s * (committed + k))

    best_k, best_rate = 0, 1.0 / lap(0)
    expected, reach = 1.0, 1.0
    for k in range(1, max_drafts + 1):
        p = acceptance[min(k, len(acceptance)) - 1] if acceptance else 0.0
        reach *= min(1.0, max(0.0, p))
        expected += reach
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
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.fixed_s, self.per_position_s = 0.0, 0.0
        self.fitted = False
        self.priced = lap_costs is not None  # fixed lap costs: measured lap times are not fitted
        if lap_costs is not None:
            self.fixed_s, self.per_position_s = check_lap_costs(lap_costs)
            self.fitted = True
        self._reached = [0.0] * self.MAX_DEPTH  # decayed laps whose draft reached depth d + 1
        self._accepted = [0.0] * self.MAX_DEPTH  # ... and whose draft d + 1 was accepted
        self._laps_without = 0  # laps since the last one that carried drafts

    def observe_lap(self, positions: int, seconds: float) -> None:
        """A timed lap of ``positions`` positions (committed ids and drafts)."""
        if self.priced or positions <= 0 or not seconds > 0 or positions > self.FIT_MAX_POSITIONS:
            return
        d = self.DECAY
        self._w, self._n, self._t = d * self._w + 1, d * self._n + positions, d * self._t + seconds
        self._nn, self._nt = d * self._nn + positions * positions, d * self._nt + positions * seconds
        mean_n, mean_t = self._n / self._w, self._t / self._w
        spread = self._nn - self._w * mean_n * mean_n
        if spread > 0.25 * self._w:  # laps of different sizes: the slope is measured
            self.per_position_s = max(0.0, (self._nt - self._w * mean_n * mean_t) / spread)
            self.fixed_s = max(0.0, mean_t - self.per_position_s * mean_n)
            self.fitted = True

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
        count = draft_count(self.acceptance(), self.fixed_s, self.per_position_s, max_drafts)
        if count == 0 and self._laps_without >= self.PROBE_EVERY:
            return 1
        return count


__all__ = ["ChainCosts", "check_lap_costs", "draft_count"]
