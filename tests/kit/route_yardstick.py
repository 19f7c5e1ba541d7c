"""The router's yardstick, written apart from it: a route's latency as ``MaxFlowRouter``'s
docstring defines it, and the best route an exhaustive search finds (``tests/network/test_scale.py``
checks the router against them, ``benchmarks/scale.py`` reports its quality with them)."""

from __future__ import annotations

from typing import Mapping, Sequence

from protocol.messages import Hop
from protocol.records import ServerInfo, ServerState
from protocol.routing import DEFAULT_RTT


def route_latency(
    route: Sequence[Hop],
    servers: Sequence[ServerInfo],
    client_rtts: Mapping[str, float],
    default_rtt: float = DEFAULT_RTT,
) -> float:
    """Seconds for one token through ``route``, as ``MaxFlowRouter``'s docstring defines it:
    half of each link's RTT (client -> head, hop -> hop, tail -> client) plus each hop's
    ``blocks / (throughput x span length)``. Written apart from the router, as the yardstick."""
    by_peer = {s.peer_id: s for s in servers}

    def link(p: str, q: str) -> float:
        rtt = by_peer[p].next_pings.get(q, by_peer[q].next_pings.get(p, default_rtt))
        return rtt / 2

    total = client_rtts.get(route[0].peer_id, default_rtt) / 2 + client_rtts.get(route[-1].peer_id, default_rtt) / 2
    for i, hop in enumerate(route):
        s = by_peer[hop.peer_id]
        total += (hop.end - hop.start) / (s.throughput * len(s.span))
        if i:
            total += link(route[i - 1].peer_id, hop.peer_id)
    return total


def exhaustive_best(
    servers: Sequence[ServerInfo],
    blocks: int,
    client_rtts: Mapping[str, float],
    max_length: int = 0,
    default_rtt: float = DEFAULT_RTT,
    limit: int = 20_000_000,
) -> tuple[float, list[Hop]]:
    """The lowest-latency route among all routes: each hop a server and a sub-range of its span,
    the next hop a different server starting where it ended. Depth-first over every branch,
    dropping a branch only once its partial latency already reaches the best complete route's
    (latencies only grow along a route). ``limit`` bounds the branches visited, so a swarm too
    large for this fails loudly instead of running for hours."""
    usable = [s for s in servers if s.state == ServerState.ONLINE and s.free_cache_tokens >= max_length]
    by_peer = {s.peer_id: s for s in usable}
    best: list = [float("inf"), []]
    visited = [0]

    def link(p: str, q: str) -> float:
        return by_peer[p].next_pings.get(q, by_peer[q].next_pings.get(p, default_rtt)) / 2

    def walk(at: int, route: list[Hop], cost: float) -> None:
        visited[0] += 1
        if visited[0] > limit:
            raise RuntimeError(f"more than {limit} branches: too large for an exhaustive search")
        if cost >= best[0]:
            return
        if at == blocks:
            total = cost + client_rtts.get(route[-1].peer_id, default_rtt) / 2
            if total < best[0]:
                best[:] = [total, list(route)]
            return
        for s in usable:
            if s.start_block <= at < s.end_block and (not route or route[-1].peer_id != s.peer_id):
                enter = link(route[-1].peer_id, s.peer_id) if route else client_rtts.get(s.peer_id, default_rtt) / 2
                for end in range(at + 1, s.end_block + 1):
                    compute = (end - at) / (s.throughput * len(s.span))
                    walk(end, route + [Hop(s.peer_id, at, end)], cost + enter + compute)

    walk(0, [], 0.0)
    return best[0], best[1]
