"""The swarm as a flow network over block boundaries, and the value of its max-flow.

The swarm is modelled as in Helix: nodes are the block boundaries ``0..N`` of the model, and a
server holding blocks ``[a, b)`` with throughput ``T`` (tokens/s for its whole span) is a
capacity-limited path from boundary ``a`` to boundary ``b``. Routing (:mod:`protocol.routing`)
spreads sessions by each server's share of it, and placement (:mod:`protocol.placement`) picks
the span that raises it the most; the dashboard shows it (:func:`swarm_max_flow`).

Everything here is pure: callers pass the :class:`ServerInfo` records they read from the DHT.

Flow network. Each server is a node pair ``in -> out`` whose edge has capacity ``T``, so
everything the server computes shares one capacity. A route may use a sub-range of a server's
span, so every boundary ``a <= i < b`` has an edge into ``in`` and ``out`` has an edge to every
boundary ``a < j <= b`` (those edges are unlimited). That also lets flow "teleport" backward
(enter at ``i``, leave at ``j <= i``). Such detours never raise the max-flow *value*: take any
0 -> N path of a flow and walk it from boundary ``c = 0``; the first later hop whose range crosses
``c`` (enters at or before ``c``, leaves after it) belongs to a server whose span covers ``c``,
so the walk can jump there directly. It ends at ``N`` using a subset of the original hops, so no
capacity is exceeded. Only the value is used here, never the flow on single edges.

The value has a closed form, so no max-flow solver runs (networkx's took 0.4 s at 1,000 servers,
and block selection ran it once per candidate span): it is the least, over blocks, of the summed
throughput of the servers holding the block. Proof by min-cut: only ``in -> out`` edges are
finite, so a finite cut ``(S, rest)`` pays ``T`` for each server with ``in`` in ``S`` and ``out``
not. Let ``m`` be the lowest boundary outside ``S``: boundary ``m - 1`` is in ``S``, so every
server holding block ``m - 1`` has ``in`` in ``S`` (edge ``m - 1 -> in``) and ``out`` outside it
(edge ``out -> m``, else ``m`` would be reached by an unlimited edge), and the cut pays at least
that block's sum. The cut ``S = {0..m - 1}`` plus those servers' ``in`` nodes pays exactly it.
``tests/network/test_scale.py`` checks the closed form against networkx's max-flow on random swarms.
"""

from __future__ import annotations

from typing import Sequence

from protocol.records import MAX_THROUGHPUT, ServerInfo, ServerState

ROUTABLE = frozenset({ServerState.ONLINE})
"""The states a client routes sessions through."""

PLACED = frozenset({ServerState.JOINING, ServerState.ONLINE})
"""The states block selection counts: servers still joining too, so two servers that join at once
do not both take the same gap (a joining server has announced the span it chose)."""


def usable(servers: Sequence[ServerInfo], states: frozenset[ServerState]) -> list[ServerInfo]:
    """Servers in ``states`` that can compute something; one record per peer (the last wins).

    Records read from the DHT are already bounded (:meth:`ServerInfo.from_dict`); this check
    repeats the part the router depends on, so records built any other way cannot make max-flow
    raise (an infinite or NaN capacity) or a walk over blocks start below 0."""
    by_peer = {
        s.peer_id: s
        for s in servers
        if s.state in states and 0 < s.throughput <= MAX_THROUGHPUT and 0 <= s.start_block < s.end_block
    }
    return list(by_peer.values())


def uncovered(servers: Sequence[ServerInfo], start: int, end: int) -> list[int]:
    """Blocks of ``[start, end)`` no server holds; costs servers x (end - start) at most, whatever
    spans the records claim."""
    covered = [False] * (end - start)
    for s in servers:
        for b in range(max(s.start_block, start), min(s.end_block, end)):
            covered[b - start] = True
    return [start + i for i, held in enumerate(covered) if not held]


def block_throughput(servers: Sequence[ServerInfo], end: int, start: int = 0) -> list[float]:
    """Summed throughput of the servers holding each block of ``[start, end)``."""
    per_block = [0.0] * (end - start)
    for s in servers:
        for b in range(max(s.start_block, start), min(s.end_block, end)):
            per_block[b - start] += s.throughput
    return per_block


def max_flow(servers: Sequence[ServerInfo], start: int, end: int) -> float:
    """The max-flow value of the flow network over ``[start, end)`` (module docstring): the least,
    over its blocks, of the summed throughput of the servers holding that block; 0 with a gap.
    Costs servers x blocks."""
    return min(block_throughput(servers, end, start), default=0.0)


def swarm_max_flow(servers: Sequence[ServerInfo], num_blocks: int) -> float:
    """Tokens/s the ``ONLINE`` servers can push through all ``num_blocks`` blocks (0 if a block
    has no server)."""
    return max_flow(usable(servers, ROUTABLE), 0, num_blocks)
