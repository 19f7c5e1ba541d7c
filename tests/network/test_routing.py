"""Routing and block selection on fabricated swarms: no network, no DHT."""

from __future__ import annotations

import functools
import math
from collections import Counter

import pytest

from protocol.flow import swarm_max_flow
from protocol.messages import Hop
from protocol.placement import choose_best_span, should_move
from protocol.records import ServerInfo, ServerState
from protocol.route_errors import NoRouteError
from protocol.routing import MaxFlowRouter
from tests.kit import records

pytestmark = pytest.mark.timeout(30)

MODEL = "tiny-llama"


srv = functools.partial(records.srv, model=MODEL)


def assert_valid(route: list[Hop], servers: list[ServerInfo], start: int, end: int) -> None:
    """The contract of RoutePlanner.plan: contiguous hops inside each server's span."""
    spans = {s.peer_id: s.span for s in servers}
    assert route[0].start == start and route[-1].end == end
    for prev, hop in zip(route, route[1:]):
        assert prev.end == hop.start
    for hop in route:
        assert hop.start < hop.end
        assert hop.start in spans[hop.peer_id] and hop.end - 1 in spans[hop.peer_id]


def peers(route: list[Hop]) -> list[str]:
    return [hop.peer_id for hop in route]


# --- max-flow ------------------------------------------------------------------------------


def test_max_flow_serial_is_the_bottleneck():
    assert swarm_max_flow([srv("a", 0, 4, 10), srv("b", 4, 8, 5)], 8) == pytest.approx(5)


def test_max_flow_adds_parallel_server():
    servers = [srv("a", 0, 4, 10), srv("b", 4, 8, 5), srv("c", 0, 8, 3)]
    assert swarm_max_flow(servers, 8) == pytest.approx(8)


def test_max_flow_overlapping_spans_share_capacity():
    # c's capacity is shared by all it serves: 0..4 via a then 4..8 via c gives 2, plus
    # 0..2 via c would need c again, so the total is limited by c's 2 tokens/s for 4..8.
    servers = [srv("a", 0, 4, 10), srv("b", 2, 6, 10), srv("c", 4, 8, 2)]
    assert swarm_max_flow(servers, 8) == pytest.approx(2)
    # b's sub-range 2..6 bridges a gap a and d leave between them: 0..4 a, 4..6 b, 6..8 d.
    servers = [srv("a", 0, 4, 7), srv("b", 2, 7, 4), srv("d", 6, 8, 9)]
    assert swarm_max_flow(servers, 8) == pytest.approx(4)


def test_max_flow_is_zero_with_a_gap_and_ignores_offline():
    assert swarm_max_flow([srv("a", 0, 3), srv("b", 4, 8)], 8) == 0
    draining = srv("c", 0, 8, 100, state=ServerState.DRAINING)
    assert swarm_max_flow([srv("a", 0, 8, 1), draining], 8) == pytest.approx(1)


def test_max_flow_backward_detour_does_not_inflate():
    # b could "teleport" flow backward in the graph (enter at 8, leave at 2), yet everything must
    # still pass a for blocks 0..1, so the flow is a's 5 whatever b and c add.
    servers = [srv("a", 0, 8, 5), srv("b", 2, 10, 5), srv("c", 8, 10, 1)]
    assert swarm_max_flow(servers, 10) == pytest.approx(5)
    assert swarm_max_flow([srv("a", 0, 8, 5), srv("c", 8, 10, 1)], 10) == pytest.approx(1)


# --- routing -------------------------------------------------------------------------------


def test_gap_names_exactly_the_missing_blocks():
    servers = [srv("a", 0, 4), srv("b", 8, 12), srv("c", 13, 16)]
    with pytest.raises(NoRouteError) as info:
        MaxFlowRouter().plan(servers, 0, 16)
    assert info.value.missing_blocks == [4, 5, 6, 7, 12]
    message = str(info.value)
    assert "blocks 4..7 and block 12 of model tiny-llama" in message
    assert "--blocks 4:8 and --blocks 12:13" in message


def test_gap_outside_requested_range_does_not_matter():
    servers = [srv("a", 0, 4), srv("b", 8, 12)]
    assert peers(MaxFlowRouter().plan(servers, 8, 12)) == ["b"]


def test_overlapping_spans_route_is_contiguous():
    servers = [srv("a", 0, 5), srv("b", 3, 9), srv("c", 7, 12)]
    route = MaxFlowRouter().plan(servers, 0, 12)
    assert_valid(route, servers, 0, 12)
    assert peers(route) == ["a", "b", "c"]


def test_sub_range_of_a_span():
    servers = [srv("a", 0, 12), srv("b", 0, 4, 1)]
    route = MaxFlowRouter().plan(servers, 5, 9)
    assert route == [Hop("a", 5, 9)]


def test_sub_range_switches_to_a_faster_server_mid_span():
    # slow covers everything; fast covers 4..8 only, so the route leaves slow at boundary 4.
    servers = [srv("slow", 0, 8, 1), srv("fast", 4, 8, 100)]
    route = MaxFlowRouter().plan(servers, 0, 8)
    assert route == [Hop("slow", 0, 4), Hop("fast", 4, 8)]


def test_slow_server_is_avoided():
    servers = [srv("slow", 0, 8, 1), srv("fast", 0, 8, 20)]
    assert swarm_max_flow(servers, 8) == pytest.approx(21)
    assert peers(MaxFlowRouter().plan(servers, 0, 8)) == ["fast"]


def test_slow_server_gets_its_flow_share_of_sessions():
    servers = [srv("slow", 0, 8, 1), srv("fast", 0, 8, 3)]
    router = MaxFlowRouter()
    counts = Counter(peers(router.plan(servers, 0, 8))[0] for _ in range(8))
    assert counts == {"fast": 6, "slow": 2}


def test_far_server_is_avoided():
    servers = [srv("far", 0, 8), srv("near", 0, 8)]
    route = MaxFlowRouter().plan(servers, 0, 8, client_rtts={"far": 0.4, "near": 0.01})
    assert peers(route) == ["near"]


def test_server_to_server_rtt_counts():
    servers = [
        srv("head", 0, 4, next_pings={"tail_far": 0.5, "tail_near": 0.005}),
        srv("tail_far", 4, 8),
        srv("tail_near", 4, 8),
    ]
    assert peers(MaxFlowRouter().plan(servers, 0, 8)) == ["head", "tail_near"]


def test_full_caches_are_skipped():
    servers = [srv("full", 0, 8, 50, free_cache_tokens=100), srv("roomy", 0, 8, 1)]
    assert peers(MaxFlowRouter().plan(servers, 0, 8, max_length=1024)) == ["roomy"]


def test_servers_whose_session_cap_is_below_max_length_are_skipped():
    """A record's max_session_tokens (0: not announced) bounds the sessions it is routed."""
    servers = [srv("capped", 0, 8, 50, max_session_tokens=1000), srv("open", 0, 8, 1)]
    assert peers(MaxFlowRouter().plan(servers, 0, 8, max_length=1024)) == ["open"]
    assert peers(MaxFlowRouter().plan(servers, 0, 8, max_length=1000)) == ["capped"]
    with pytest.raises(NoRouteError, match=r"capped at sessions of 1000 tokens \(--max-session-tokens\), not 1024"):
        MaxFlowRouter().plan(servers[:1], 0, 8, max_length=1024)


def test_all_caches_full_says_so():
    servers = [srv("a", 0, 4, free_cache_tokens=4096), srv("b", 4, 8, free_cache_tokens=512)]
    with pytest.raises(NoRouteError) as info:
        MaxFlowRouter().plan(servers, 0, 8, max_length=2048)
    assert info.value.missing_blocks == [4, 5, 6, 7]
    message = str(info.value)
    assert "cache room for 2048 tokens (most free: 512)" in message
    assert "--blocks 4:8" in message


def test_excluded_and_offline_peers_are_never_used():
    servers = [
        srv("bad", 0, 8, 100),
        srv("joining", 0, 8, 100, state=ServerState.JOINING),
        srv("ok", 0, 8, 1),
    ]
    router = MaxFlowRouter()
    for _ in range(5):
        assert peers(router.plan(servers, 0, 8, exclude={"bad"})) == ["ok"]
    with pytest.raises(NoRouteError) as info:
        router.plan(servers, 0, 8, exclude={"bad", "ok"})
    assert "2 servers are excluded after failing; 1 server is joining" in str(info.value)


def test_two_parallel_paths_split_evenly_and_release_restores():
    servers = [srv("a1", 0, 4), srv("a2", 4, 8), srv("b1", 0, 4), srv("b2", 4, 8)]
    router = MaxFlowRouter()
    routes = [router.plan(servers, 0, 8) for _ in range(10)]
    for route in routes:
        assert_valid(route, servers, 0, 8)
    firsts = Counter(route[0].peer_id for route in routes)
    seconds = Counter(route[1].peer_id for route in routes)
    assert firsts == {"a1": 5, "b1": 5} and seconds == {"a2": 5, "b2": 5}
    for route in routes:
        router.release(route)
    assert all(router.load(s.peer_id) == 0 for s in servers)
    assert router.plan(servers, 0, 8) == routes[0]


def test_plan_rejects_empty_range():
    with pytest.raises(ValueError):
        MaxFlowRouter().plan([srv("a", 0, 8)], 4, 4)


# --- block selection -----------------------------------------------------------------------


def _join(servers: list[ServerInfo], num_blocks: int, span_length: int, throughput: float) -> None:
    start, end = choose_best_span(servers, num_blocks, span_length, throughput)
    servers.append(srv(f"s{len(servers)}", start, end, throughput))


def _block_throughput(servers: list[ServerInfo], num_blocks: int) -> list[float]:
    return [sum(s.throughput for s in servers if b in s.span) for b in range(num_blocks)]


@pytest.mark.parametrize("num_blocks,span_length", [(8, 3), (24, 5), (10, 10), (7, 2)])
def test_joiners_cover_the_model_first(num_blocks, span_length):
    servers: list[ServerInfo] = []
    for _ in range(math.ceil(num_blocks / span_length)):
        _join(servers, num_blocks, span_length, 10)
    assert min(_block_throughput(servers, num_blocks)) > 0
    assert swarm_max_flow(servers, num_blocks) == pytest.approx(10)


def test_joiners_then_add_redundancy_where_throughput_is_lowest():
    servers = [srv("fast", 0, 4, 10), srv("slow", 4, 8, 2)]
    assert choose_best_span(servers, 8, 4, 5) == (4, 8)
    servers = []
    for _ in range(2 * math.ceil(24 / 6)):
        _join(servers, 24, 6, 10)
    assert swarm_max_flow(servers, 24) == pytest.approx(20)
    assert min(_block_throughput(servers, 24)) == 20


def test_choose_best_span_counts_joining_servers():
    joining = srv("j", 0, 4, state=ServerState.JOINING)
    assert choose_best_span([joining], 8, 4, 10) == (4, 8)


def test_should_move_off_an_over_served_range_to_a_gap():
    me = srv("me", 0, 4)
    servers = [srv("a", 0, 4), srv("b", 0, 4), me]
    assert should_move(servers, me, 8) == (4, 8)
    servers = [srv("a", 0, 4), srv("b", 0, 4), srv("c", 4, 8), me]
    assert should_move(servers, me, 8) == (4, 8)  # flow 1 -> 2


def test_should_move_reduces_gaps_even_if_one_remains():
    me = srv("me", 0, 4)
    servers = [srv("a", 0, 4), me]
    assert should_move(servers, me, 12) == (4, 8)


def test_should_not_move_in_a_balanced_swarm():
    me = srv("me", 4, 8)
    servers = [srv("a", 0, 4), srv("b", 0, 4), srv("c", 4, 8), me]
    assert should_move(servers, me, 8) is None
    me = srv("me", 0, 8, 3)
    servers = [srv("a", 0, 4, 10), srv("b", 4, 8, 10), me]
    assert should_move(servers, me, 8) is None


def test_should_not_move_for_a_small_gain():
    me = srv("me", 0, 4, 1)
    servers = [srv("a", 0, 4, 10), srv("b", 4, 8, 10), me]  # flow 10; moving gives 10 too
    assert should_move(servers, me, 8) is None
    # moving gains 1/10 < 0.2 (blocks 8:12 over-served, so that "a" is no faster than the median
    # server: placement counts none faster, protocol.placement.placement_view)
    servers = [srv("a", 0, 4, 11), srv("b", 4, 8, 10), srv("c", 8, 12, 11), srv("d", 8, 12, 11), me]
    assert should_move(servers, me, 12) is None
    assert should_move(servers, me, 12, min_gain=0.05) == (4, 8)


def test_an_empty_read_is_not_reported_as_missing_servers():
    with pytest.raises(NoRouteError, match="returned no server records") as e:
        MaxFlowRouter().plan([], 0, 4)
    assert e.value.missing_blocks == [0, 1, 2, 3] and "?" not in str(e.value)


def test_a_route_visits_each_server_once():
    """A slow server A holding every block and a fast B holding the middle ones, with cheap
    measured links both ways: handing the middle to B and taking it back is the fastest path, but a
    server keys sessions by id, so a second visit would open the same session there twice
    (``session_exists``). A computes the whole stretch between its visits itself instead."""
    servers = [
        srv("A", 0, 8, throughput=1.0, next_pings={"B": 0.0001}),
        srv("B", 2, 5, throughput=1000.0, next_pings={"A": 0.0001}),
    ]
    route = MaxFlowRouter().plan(servers, 0, 8, client_rtts={"A": 0.0001, "B": 0.0001})
    assert_valid(route, servers, 0, 8)
    peers = [hop.peer_id for hop in route]
    assert len(peers) == len(set(peers)), route
