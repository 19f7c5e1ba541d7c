"""What one run's verification costs the tail, measured as it happens and reported in its verdict.

The client's lap time mixes the network, every hop's blocks and the tail's verification; only the
tail knows what its part cost. So the tail times the span's blocks over the run (in a batch, the
pass's time shared by positions) and each LM-head call with the rows it read, and sends them in
``StepResult.tail_costs`` (protocol/messages.py, TailCosts): the client then prices a draft at what
it costs the tail, apart from the link (client/drafting/cost_model.py). The same call times fit the
per-row cost that sizes a verification's first LM-head call (server/verify_rows.py).
"""

from __future__ import annotations

import time

import torch

from protocol.tail_costs import MAX_HEAD_CALLS, MAX_TAIL_US, TailCosts


def _us(seconds: float) -> int:
    return max(0, min(MAX_TAIL_US, round(seconds * 1e6)))


class CostMeter:
    """One run's measured verification work: the blocks' share, then each LM-head call."""

    def __init__(self, blocks_s: float = 0.0) -> None:
        self.blocks_s = blocks_s
        self.calls: list[tuple[int, float]] = []  # (rows, seconds) this run's, in call order
        self.whole_calls: list[tuple[int, float]] = []  # (rows, seconds) of the calls it took part in

    def call(self, rows: int, seconds: float, whole: tuple[int, float] | None = None) -> None:
        """A call that read ``rows`` of this run's rows in ``seconds`` (its share of a batch's call,
        ``whole``: all the call's rows and its time, which is what fits a call's cost)."""
        self.calls.append((rows, seconds))
        self.whole_calls.append(whole if whole is not None else (rows, seconds))

    def logits(self, span, hidden: torch.Tensor) -> torch.Tensor:
        """``span.logits(hidden)``, timed (on an accelerator, to the end of its work)."""
        started = time.perf_counter()
        block = span.logits(hidden)
        if block.is_cuda:
            torch.cuda.synchronize(block.device)
        self.call(hidden.shape[1], time.perf_counter() - started)
        return block

    def report(self) -> TailCosts:
        """The wire form; calls past MAX_HEAD_CALLS are merged into the last one reported."""
        calls = self.calls[: MAX_HEAD_CALLS - 1]
        rest = self.calls[MAX_HEAD_CALLS - 1 :]
        if rest:
            calls.append((sum(r for r, _ in rest), sum(s for _, s in rest)))
        return TailCosts(
            blocks_us=_us(self.blocks_s), head_us=[_us(s) for _, s in calls], head_rows=[r for r, _ in calls]
        )


__all__ = ["CostMeter"]
