"""How many logits rows a chain's verification computes in its first LM-head call, per session.

On a memory-bound tail every LM-head call reads the whole matrix (SmolLM2: 49,152 x 576 float32),
so a call for four rows costs little more than a call for one, and a second call costs as much as
the first. The verification walk reads rows in order and stops at the first rejected draft: it
reads ``accepted + 1`` rows. Computing only the first row wastes a whole second call on every lap
that accepts a draft; computing every row wastes rows on laps that accept none. So each session
keeps an exponential moving average of its drafts' acceptance (accepted / drafted), and the first
call computes as many rows as the walk will probably read; a second call (the rows left) happens
only when more drafts are accepted than planned. What one more row costs is measured: the session's
LM-head calls (server/tail_costs.py) fit call time = base + rows x per row, and a row is worth adding
while the chance the walk reads it beats its cost as a fraction of a call (0.1 until calls of
different sizes have been timed). Which rows are computed never changes a verdict:
row r is ``span.logits(hidden)[r]`` whichever call computed it (server/compute.py, LazyLogits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

ALL_ROWS = -1  # RowPlan.FORCED: every row in the first call


@dataclass
class RowPlan:
    """One session's acceptance estimate and the first call's row count it implies.

    Under a geometric model (each draft accepted with probability ``rate`` given the ones before
    it), the walk reads row ``j + 1`` with probability ``rate ** j``. Adding that row to the first
    call costs ``EXTRA_ROW_COST`` of a call and saves a whole second call with that probability, so
    rows are added while ``rate ** j > extra_row_cost()``: ``EXTRA_ROW_COST`` until :meth:`observe_call`
    has timed calls of different sizes, then the fitted per-row time over a one-row call's.
    """

    DECAY = 0.5  # weight of the newest lap in the moving average
    EXTRA_ROW_COST = 0.1  # one more row in a call, as a fraction of a call (the matrix read dominates)
    DECAY_CALLS = 0.95  # of the call-time fit: a server's LM head changes slowly

    # a fixed row count for every session of this process (ALL_ROWS: all of them); None: planned.
    # For tests and benchmarks that compare the policies; verdicts are the same under each
    FORCED: ClassVar[Optional[int]] = None

    rate: float = 0.5  # a neutral prior: a first lap computes the first four rows of its walk
    # decayed sums of the timed LM-head calls (weight, rows, seconds, rows^2, rows x seconds)
    _calls: list[float] = field(default_factory=lambda: [0.0] * 5)

    def observe_call(self, rows: int, seconds: float) -> None:
        """One timed LM-head call of ``rows`` rows (in a batch: the whole call's rows and time)."""
        if rows < 1 or not seconds > 0:
            return
        d = self.DECAY_CALLS
        self._calls = [d * x + y for x, y in zip(self._calls, (1.0, rows, seconds, rows * rows, rows * seconds))]

    def extra_row_cost(self) -> float:
        """One more row in a call as a fraction of a one-row call: measured, or ``EXTRA_ROW_COST``."""
        w, n, t, nn, nt = self._calls
        spread = nn - n * n / w if w > 0 else 0.0
        if spread <= 0.25 * w:  # calls of one size only: the slope is not measured
            return self.EXTRA_ROW_COST
        per_row = max(0.0, (nt - n * t / w) / spread)
        base = t / w - per_row * n / w
        one_row = base + per_row
        return min(1.0, per_row / one_row) if one_row > 0 else self.EXTRA_ROW_COST

    def rows(self, n_draft: int) -> int:
        """Rows the first LM-head call computes for a chain of ``n_draft`` drafts, in [1, n_draft + 1]."""
        if self.FORCED is not None:
            return n_draft + 1 if self.FORCED == ALL_ROWS else max(1, min(self.FORCED, n_draft + 1))
        count, p, cost = 1, self.rate, self.extra_row_cost()
        while count <= n_draft and p > cost:
            count += 1
            p *= self.rate
        return count

    def observe(self, n_draft: int, accepted: int) -> None:
        """A chain's verdict: ``accepted`` of ``n_draft`` drafts kept. A run without drafts says nothing."""
        if n_draft <= 0:
            return
        fraction = max(0, min(accepted, n_draft)) / n_draft
        self.rate += self.DECAY * (fraction - self.rate)


__all__ = ["ALL_ROWS", "RowPlan"]
