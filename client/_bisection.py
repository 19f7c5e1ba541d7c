"""A dispute (a verdict's or a forward pass's) whose two tails disagree on the final hidden state, narrowed
by bisection over the span's blocks to one block the client recomputes itself (docs/reliability.md,
"Bisection over the span's blocks"; issue 35).

The blocks [a, b) are those both tails hold (client/_tail_bisection.py says which and what is compared at
a where their spans start apart). The client asks each,
in fresh prefill sessions over the disputed prefix on its own route, for the hidden state entering a block
``k`` at every position (``Step.hidden_at``, the one wire field this adds): first at ``a`` (the span's
input, from the hops before the tail) and at ``b`` (the last block's output, before the final norm), then
at the middle of the range whose ends agree and differ, until one block ``k`` is left whose inputs agree
(within the forward passes' tolerance) and whose outputs differ. States agreeing at ``a`` but differing
nowhere up to ``b`` put the dispute in the final norm (block ``b`` here). The client replays that one block
(client/_block_replay.py) on each side's own input and checks each side's output against it: a side
whose output is within the tolerance of the replay *fits*; one side fitting and the other not refutes the
other; anything else (inputs that differ at ``a``, both fit, neither fits, a state that cannot be read or
replayed) settles nothing.

Why no coalition can refute an honest tail this way: everything an honest tail sends at any boundary is
what its blocks compute from its own input, so the pair (its state entering block k, its state after it)
is exactly the block's computation, up to its own rounding; the client's float32 replay of the block from
the honest tail's input is within the tolerance of its output whatever the other side sends, whatever
block the bisection ends on. The honest tail fits, so it is never the one refuted; a coalition can only
make the other side fit too (settling nothing) or make the inputs differ (settling nothing). Cost:
2 + ceil(log2(b - a)) laps of two fresh sessions each (one per tail, in parallel), each session the
prefix's t positions through the route and t rows of logits and a state back ((vocab + hidden) x 4 bytes a
position); then one block's weights read and replayed on the CPU.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import torch

from client._evidence import Settlement


def spread(x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest difference of two states [t, hidden], relative to max(1, max|x|) (NaN: inf)."""
    value = float((x.float() - y.float()).abs().max()) / max(1.0, float(x.float().abs().max()))
    return value if value == value else float("inf")


def row_spread(x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest :func:`spread` of two states [n, hidden] position by position (each against its own
    scale), as client/_output_evidence.py compares final hidden states."""
    return max(spread(a[None], b[None]) for a, b in zip(x, y))


@dataclass
class Divergence:
    """The first block ``block`` (``b``: the final norm) whose inputs agree and outputs differ: each
    side's (tail's, shadow's) state entering it and after it."""

    block: int
    inputs: tuple[torch.Tensor, torch.Tensor]
    outputs: tuple[torch.Tensor, torch.Tensor]
    norm: bool = False  # the final norm (``block`` is then b)


States = Callable[[int], Awaitable[tuple[torch.Tensor, torch.Tensor]]]


async def first_divergence(states: States, a: int, b: int, finals, tol: float) -> Divergence | str:
    """Bisect blocks [a, b): ``states(k)`` gives both sides' states entering block k (k = b: the last
    block's output, before the final norm); ``finals`` both sides' final hidden states (after the norm).
    ``finals`` [n, hidden] (or [hidden]: n = 1) are the prefix's last n positions. A :class:`Divergence`,
    or why there is none to replay."""
    low = await states(a)
    if not spread(*low) < tol:
        return f"the span's inputs (entering block {a}) differ by {spread(*low):.3g} >= {tol:g}"
    high = await states(b)
    if spread(*high) < tol:  # every block agrees: the final norm made the difference
        outputs = tuple(f.float().reshape(-1, high[0].shape[-1]) for f in finals)
        last = tuple(x[-len(outputs[0]) :] for x in high)  # the norm is per position: the disputed ones alone
        return Divergence(b, last, outputs, norm=True)
    lo, hi = a, b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = await states(mid)
        if spread(*found) < tol:
            lo, low = mid, found
        else:
            hi, high = mid, found
    return Divergence(lo, low, high)


def judge(divergence: Divergence, replayed: tuple[torch.Tensor, torch.Tensor], tol: float) -> Settlement:
    """Each side's output against the replay of the block from its own input (``replayed``)."""
    off = [spread(out, again) for out, again in zip(divergence.outputs, replayed)]
    what = "the final norm" if divergence.norm else f"block {divergence.block}"
    numbers = (
        f"bisection to {what}: inputs agree, outputs differ; replayed by the client, the live tail's output "
        f"off by {off[0]:.3g} and the shadow's by {off[1]:.3g} (tolerance {tol:g})"
    )
    fit_tail, fit_shadow = off[0] < tol, off[1] < tol
    if fit_tail != fit_shadow:
        return Settlement("shadow" if fit_tail else "tail", numbers)
    return Settlement(None, numbers + (" (both fit)" if fit_tail else " (neither fits)"))


async def bisect(
    states: States, replay: Callable[[int, torch.Tensor], Optional[torch.Tensor]], a: int, b: int, finals, tol: float
) -> Settlement:
    """:func:`first_divergence`, then the replay of its block (off the event loop) and :func:`judge`."""
    found = await first_divergence(states, a, b, finals, tol)
    if isinstance(found, str):
        return Settlement(None, f"bisection: {found}")
    replayed = [await asyncio.to_thread(replay, found.block, x) for x in found.inputs]
    if any(r is None for r in replayed):
        return Settlement(None, f"bisection to block {found.block}: the client could not replay it")
    return judge(found, tuple(replayed), tol)
