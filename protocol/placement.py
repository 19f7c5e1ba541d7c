"""Block selection: which span a joining server takes, and when a running server moves.

A joining server takes the span that raises the swarm's max-flow (its throughput from boundary 0
to N, :mod:`protocol.flow`) the most (:func:`choose_best_span`), and a running server moves when
another span would raise it by enough (:func:`should_move`). Both count each record's throughput
only up to what a reader can check (:func:`placement_view`), never as claimed. Pure, over the
records the server read from the DHT; ``server/placement.py`` and ``server/moves.py`` call it.
"""

from __future__ import annotations

import math
from typing import Sequence

import msgspec

from protocol.flow import PLACED, block_throughput, max_flow, uncovered, usable
from protocol.records import ServerInfo, ServerState

CLAIM_CAP = 1.0
"""Placement counts no server faster than ``CLAIM_CAP`` times the median per-block speed of the
model's ``ONLINE`` servers (:func:`placement_view`)."""


def placement_view(servers: Sequence[ServerInfo]) -> list[ServerInfo]:
    """The records placement and rebalancing count (``JOINING`` and ``ONLINE``, one per peer), each
    throughput counted only up to what a reader can check.

    A throughput is a claim: nobody measured it but its author, and identities are free. Believed
    as written, one fresh record claiming 1,000 times a real server's speed makes its blocks look
    saturated, and rebalancing moves honest servers off them (onto which the record's author may
    serve nothing at all). So every record is counted at most at a *reference speed* the reader can
    derive from the swarm as a whole rather than from the record:

    - an ``ONLINE`` record: at most :data:`CLAIM_CAP` times the median per-block speed
      (``throughput * blocks``) of the model's ``ONLINE`` records, spread over its span. The median
      holds while fewer than half of the online records lie; one identity then weighs no more than
      a typical server, so inflating a claim buys nothing beyond announcing at all (and many
      identities weigh as many typical servers: placement spreads servers by count where it
      cannot check speed). An honest server faster than the median is under-counted; that costs
      placement some precision, never coverage, and routing still weighs it by its claim capped by
      what each client measures (:func:`protocol.routing.cap_throughput`).
    - a ``JOINING`` record: at most the slowest ``ONLINE`` per-block speed, spread over its span,
      which is what an honest joining server announces before it has measured anything
      (``server.joining.joining_throughput``).

    Without any ``ONLINE`` record there is no reference and claims count as written. Idempotent:
    capped values never exceed the median, so capping again changes nothing. Routing
    (:class:`protocol.routing.MaxFlowRouter`) does not use this: a client has its own measurements.
    """
    placed = usable(servers, PLACED)
    speeds = sorted(s.throughput * len(s.span) for s in placed if s.state == ServerState.ONLINE)
    if not speeds:
        return placed
    mid = len(speeds) // 2
    median = speeds[mid] if len(speeds) % 2 else (speeds[mid - 1] + speeds[mid]) / 2
    limit = {ServerState.ONLINE: CLAIM_CAP * median, ServerState.JOINING: speeds[0]}
    counted = []
    for s in placed:
        cap = limit[s.state] / len(s.span)
        counted.append(s if s.throughput <= cap else msgspec.structs.replace(s, throughput=cap))
    return counted


def choose_best_span(
    servers: Sequence[ServerInfo],
    num_blocks: int,
    span_length: int,
    my_throughput: float,
    within: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Span ``(start, end)`` for a joining server that raises the swarm's max-flow the most.

    Joining and online servers both count, each at most at the throughput :func:`placement_view`
    believes. While the model has gaps, no single span raises the max-flow unless it closes the
    last gap, so ties go to the span covering the most of the least-served blocks (gaps first,
    then the lowest per-block throughput), then to the span with the least throughput already on
    it, then to the lowest start. ``within=(lo, hi)`` keeps the span inside blocks [lo, hi) (a
    server whose memory cannot hold an end of the model).
    """
    return _best_span(placement_view(servers), num_blocks, span_length, my_throughput, within)


def _best_span(
    placed: Sequence[ServerInfo],
    num_blocks: int,
    span_length: int,
    my_throughput: float,
    within: tuple[int, int] | None,
) -> tuple[int, int]:
    """:func:`choose_best_span` over records already counted as placement believes them."""
    lo, hi = within or (0, num_blocks)
    if num_blocks <= 0 or span_length <= 0 or not 0 <= lo < hi <= num_blocks:
        raise ValueError("num_blocks and span_length must be positive, and within a range of blocks")
    length = min(span_length, hi - lo)
    per_block = block_throughput(placed, num_blocks)
    least = min(per_block)

    def score(start: int) -> tuple[float, int, float]:
        window, rest = per_block[start : start + length], per_block[:start] + per_block[start + length :]
        flow = min([t + my_throughput for t in window] + rest)  # the max-flow with the candidate added
        flow = round(flow, 6)  # tolerate float noise in ties
        return flow, sum(math.isclose(t, least, abs_tol=1e-9) for t in window), -sum(window)

    best = max(range(lo, hi - length + 1), key=score)  # max() keeps the lowest start on ties
    return best, best + length


def should_move(
    servers: Sequence[ServerInfo],
    my_info: ServerInfo,
    num_blocks: int,
    min_gain: float = 0.2,
    within: tuple[int, int] | None = None,
) -> tuple[int, int] | None:
    """New span for a running server if moving there raises the max-flow by more than
    ``min_gain`` (relative), else ``None``. The threshold keeps servers from oscillating
    between near-equal spans. If the model has a gap either way, moving is worth it when it
    leaves fewer uncovered blocks. The others count as :func:`placement_view` believes them (the
    reference speeds come from every record, this server's own included); this server counts
    at its own measured throughput.
    """
    others = [s for s in placement_view([*servers, my_info]) if s.peer_id != my_info.peer_id]
    span = _best_span(others, num_blocks, len(my_info.span), my_info.throughput, within)
    if span == (my_info.start_block, my_info.end_block):
        return None
    moved = msgspec.structs.replace(my_info, start_block=span[0], end_block=span[1])
    here, there = others + [my_info], others + [moved]
    now, then = max_flow(here, 0, num_blocks), max_flow(there, 0, num_blocks)
    if now > 0:
        return span if (then - now) / now > min_gain else None
    if then > 0:
        return span
    fewer_gaps = len(uncovered(there, 0, num_blocks)) < len(uncovered(here, 0, num_blocks))
    return span if fewer_gaps else None
