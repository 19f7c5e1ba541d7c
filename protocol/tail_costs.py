"""The tail's report of what verifying one run cost it (``StepResult.tail_costs``, protocol v9).

A lap's wall-clock time mixes the network, every hop's blocks and the tail's verification; only the
tail can tell its part apart, so it measures it (server/tail_costs.py) and the client prices a draft
with it (client/drafting/cost_model.py). A peer's value is data from outside: :func:`check_tail_costs`
refuses nonsense by name.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_TAIL_US = 600_000_000  # a verification's reported compute, per part: at most ten minutes
MAX_HEAD_CALLS = 16  # LM-head calls a verdict reports (a tail merges any past the last into it)


class TailCosts(msgspec.Struct, array_like=True):
    """What the tail's verification of one run cost it, measured where it happened (microseconds):
    the client separates the tail's compute from the network's time with it, and prices a draft at
    what it costs the tail (client/drafting/cost_model.py). ``blocks_us``: the span's blocks over the
    run's positions (in a batch, the pass's time shared by positions). ``head_us[i]``: the i-th
    LM-head call (in a batch, its share by rows), which read ``head_rows[i]`` rows. Types and sizes
    are checked on decoding; values by :func:`check_tail_costs` (a peer's nonsense is named there)."""

    blocks_us: int
    head_us: Annotated[list[int], msgspec.Meta(max_length=MAX_HEAD_CALLS)] = []
    head_rows: Annotated[list[int], msgspec.Meta(max_length=MAX_HEAD_CALLS)] = []


def check_tail_costs(costs: TailCosts, positions: int) -> TailCosts:
    """``costs`` if sane for a run of ``positions`` positions, else a ValueError naming what is wrong."""
    if not 0 <= costs.blocks_us <= MAX_TAIL_US:
        raise ValueError(f"tail_costs.blocks_us {costs.blocks_us} is not in [0, {MAX_TAIL_US}]")
    if len(costs.head_us) != len(costs.head_rows):
        raise ValueError(
            f"tail_costs reports {len(costs.head_us)} LM-head call times for {len(costs.head_rows)} row counts"
        )
    if any(not 0 <= us <= MAX_TAIL_US for us in costs.head_us):
        raise ValueError(f"tail_costs.head_us {costs.head_us} has a time outside [0, {MAX_TAIL_US}]")
    if any(not 1 <= rows <= positions for rows in costs.head_rows):
        raise ValueError(f"tail_costs.head_rows {costs.head_rows} does not fit a run of {positions} positions")
    return costs


__all__ = ["MAX_HEAD_CALLS", "MAX_TAIL_US", "TailCosts", "check_tail_costs"]
