"""Routing, placement and max-flow on synthetic swarms of up to 1,000 servers (no network).

The records come from ``tests/kit/synthetic_swarm.py`` (10% hostile); ``benchmarks/scale.py``
measures the same calls. Here: what the router hands out is a valid route over valid records,
it is the best route an exhaustive search finds, and the closed-form max-flow is networkx's.
"""

from __future__ import annotations

import random
import tracemalloc

import networkx as nx
import pytest

from protocol.flow import swarm_max_flow
from protocol.messages import Hop
from protocol.placement import choose_best_span
from protocol.records import ServerInfo, ServerState
from protocol.routing import MaxFlowRouter, cap_throughput
from tests.kit.route_yardstick import exhaustive_best, route_latency
from tests.kit.synthetic_swarm import HOSTILE_KINDS, MODEL, make_swarm

pytestmark = pytest.mark.timeout(120)


def assert_covers(route: list[Hop], servers: dict[str, ServerInfo], blocks: int) -> None:
    assert route[0].start == 0 and route[-1].end == blocks
    for prev, hop in zip(route, route[1:]):
        assert prev.end == hop.start and prev.peer_id != hop.peer_id
    for hop in route:
        span = servers[hop.peer_id].span
        assert hop.start < hop.end and hop.start in span and hop.end - 1 in span


def test_every_hostile_record_is_dropped_and_never_routed():
    swarm = make_swarm(100, 61, hostile_fraction=0.1, seed=1)
    assert set(swarm.hostile.values()) == set(HOSTILE_KINDS)  # every kind is in the swarm
    records = swarm.parsed()
    assert len(records) == 90 and not {s.peer_id for s in records} & set(swarm.hostile)
    by_peer = {s.peer_id: s for s in records}
    router, rtts = MaxFlowRouter(), swarm.client_rtts(records)
    for _ in range(30):  # 30 sessions open at once: quotas spread them
        route = router.plan(records, 0, 61, max_length=2048, client_rtts=rtts)
        assert_covers(route, by_peer, 61)
        assert all(by_peer[hop.peer_id].state == ServerState.ONLINE for hop in route)
        assert all(by_peer[hop.peer_id].free_cache_tokens >= 2048 for hop in route)
    assert sum(router.load(p) > 0 for p in by_peer) > 9  # more servers than one route's


@pytest.mark.parametrize("seed", range(6))
def test_route_is_the_exhaustive_best(seed):
    """Small swarms with heavily overlapping spans (many routes), measured and unmeasured links."""
    rng = random.Random(seed)
    servers = []
    for i in range(7):
        start = rng.randint(0, 9)
        end = rng.randint(start + 1, min(12, start + 6))
        servers.append(
            ServerInfo(
                peer_id=f"s{i}",
                model=MODEL,
                start_block=start,
                end_block=end,
                throughput=rng.lognormvariate(3, 0.8),
                free_cache_tokens=4096,
            )
        )
    servers += [
        ServerInfo(peer_id="head", model=MODEL, start_block=0, end_block=4, throughput=5.0),
        ServerInfo(peer_id="tail", model=MODEL, start_block=8, end_block=12, throughput=5.0),
        ServerInfo(peer_id="mid", model=MODEL, start_block=3, end_block=9, throughput=5.0),
    ]
    ids = [s.peer_id for s in servers]
    servers = [  # some links measured, faster or slower than the default
        ServerInfo(
            **{
                **s.to_dict(),
                "state": s.state,
                "next_pings": {q: rng.choice([0.001, 0.02, 0.2]) for q in rng.sample(ids, 4) if q != s.peer_id},
            }
        )
        for s in servers
    ]
    rtts = {p: rng.choice([0.005, 0.1]) for p in rng.sample(ids, 6)}
    route = MaxFlowRouter().plan(servers, 0, 12, client_rtts=rtts)
    assert_covers(route, {s.peer_id: s for s in servers}, 12)
    best, _ = exhaustive_best(servers, 12, rtts)
    assert route_latency(route, servers, rtts) == pytest.approx(best, rel=1e-9)


def test_route_of_the_synthetic_swarm_is_the_exhaustive_best():
    swarm = make_swarm(10, 61, seed=0)
    records = [s for s in swarm.parsed() if s.state == ServerState.ONLINE]
    rtts = swarm.client_rtts(records)
    route = MaxFlowRouter().plan(records, 0, 61, max_length=2048, client_rtts=rtts)
    best, _ = exhaustive_best(records, 61, rtts, 2048)
    assert route_latency(route, records, rtts) == pytest.approx(best, rel=1e-9)


def networkx_max_flow(servers: list[ServerInfo], blocks: int, states=(ServerState.ONLINE,)) -> float:
    """The flow network of protocol/flow.py's docstring, solved by networkx."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(blocks + 1))
    for s in servers:
        if s.state not in states:
            continue
        graph.add_edge(("in", s.peer_id), ("out", s.peer_id), capacity=s.throughput)
        graph.add_edges_from((i, ("in", s.peer_id)) for i in range(s.start_block, s.end_block))
        graph.add_edges_from((("out", s.peer_id), j) for j in range(s.start_block + 1, s.end_block + 1))
    return nx.maximum_flow_value(graph, 0, blocks)


@pytest.mark.parametrize("servers,blocks,seed", [(10, 12, 0), (30, 20, 1), (60, 61, 2), (200, 61, 3)])
def test_closed_form_max_flow_is_networkx_max_flow(servers, blocks, seed):
    records = make_swarm(servers, blocks, seed=seed).parsed()
    assert swarm_max_flow(records, blocks) == pytest.approx(networkx_max_flow(records, blocks), rel=1e-9)
    sparse = records[: len(records) // 3]  # gaps, or the tiling servers alone
    assert swarm_max_flow(sparse, blocks) == pytest.approx(networkx_max_flow(sparse, blocks), rel=1e-9)


def test_placement_raises_the_max_flow_the_most():
    """Joining servers count as placed (two servers joining at once must not take the same gap)."""
    records = make_swarm(200, 61, seed=4).parsed()
    assert any(s.state == ServerState.JOINING for s in records)
    start, end = choose_best_span(records, 61, 8, 30.0)
    gains = {}
    for a in range(61 - 8 + 1):
        me = ServerInfo(peer_id="me", model=MODEL, start_block=a, end_block=a + 8, throughput=30.0)
        gains[a] = networkx_max_flow(records + [me], 61, (ServerState.ONLINE, ServerState.JOINING))
    assert gains[start] == pytest.approx(max(gains.values()), rel=1e-9)


def test_route_memory_at_1000_servers_is_bounded_by_servers_times_blocks():
    """The route at 1,000 servers allocates a few MiB (the all-pairs graph took ~400 MiB)."""
    swarm = make_swarm(1000, 61, seed=0)
    records = swarm.parsed()
    rtts = swarm.client_rtts(records)
    tracemalloc.start()
    try:
        route = MaxFlowRouter().plan(cap_throughput(records, {}), 0, 61, max_length=2048, client_rtts=rtts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_covers(route, {s.peer_id: s for s in records}, 61)
    assert not {hop.peer_id for hop in route} & set(swarm.hostile)
    assert peak < 1000 * 61 * 256  # ~15 MiB: 256 bytes per (server, block)
