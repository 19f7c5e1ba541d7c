"""Servers announce JOINING as soon as they have chosen a span: placement counts them, routing
ignores them, the dashboard lists them, and two servers started together take different spans.

Unit tests on fabricated records first; one live test (a tiny-Llama swarm on 127.0.0.1) last.
"""

from __future__ import annotations

import asyncio
import functools
import time

import msgspec
import pytest

from protocol.flow import swarm_max_flow
from protocol.placement import choose_best_span, should_move
from protocol.records import ServerInfo, ServerState
from protocol.route_errors import NoRouteError
from protocol.routing import MaxFlowRouter
from server.joining import JOINING_THROUGHPUT, claim_span, joining_throughput, outranks, rivals
from tests.kit import records

MODEL = "tiny"
TOTAL = 6


srv = functools.partial(records.srv, model=MODEL)


def joining(peer: str, start: int, end: int, started_at: float = 100.0) -> ServerInfo:
    return srv(peer, start, end, JOINING_THROUGHPUT, ServerState.JOINING, started_at=started_at, free_cache_tokens=0)


def choose3(servers) -> tuple[int, int]:
    return choose_best_span(servers, TOTAL, 3, JOINING_THROUGHPUT)


# --- placement counts joining servers ---------------------------------------------------------


def test_server_placement_counts_a_joining_server():
    from server.placement import choose_blocks
    from server.server_config import ServerConfig

    config = ServerConfig(model=MODEL, num_blocks=3)
    assert choose_blocks(config, [], TOTAL) == (0, 3)
    assert choose_blocks(config, [joining("j", 0, 3)], TOTAL) == (3, 6)
    assert choose_blocks(config, [srv("off", 0, 3, state=ServerState.OFFLINE)], TOTAL) == (0, 3)
    assert choose_blocks(ServerConfig(model=MODEL, blocks=(1, 4)), [joining("j", 0, 3)], TOTAL) == (1, 4)


def fabricated_plan(free: int, drafter: int = 0):
    """Blocks of 10 bytes, embeddings and LM head of 5 each, no cache: the plan's arithmetic alone
    (headroom is 5% of ``free``)."""
    from server.memory import MemoryPlan, ModelSizes

    return MemoryPlan(TOTAL, free, ModelSizes(10, 5, 5, False, 0), drafter_bytes=drafter)


def test_a_span_that_would_end_at_the_tail_leaves_room_for_the_drafter():
    """The memory plan's 3 blocks fit, but only 2 beside the tail's drafter (MTP block, head):
    where the best 3-block span ends at the last block, the server takes 2 blocks instead."""
    from server.placement import choose_blocks
    from server.server_config import ServerConfig

    plan = fabricated_plan(40, drafter=5)  # 3 x 10 + 2 headroom (+ 5 at an end); 2 beside the drafter
    assert (plan.blocks, plan.head_blocks, plan.tail_blocks) == (3, 3, 2)
    config = ServerConfig(model=MODEL)
    assert choose_blocks(config, [], TOTAL, plan) == (0, 3)  # not at the tail: all 3
    start, end = choose_blocks(config, [srv("a", 0, 3)], TOTAL, plan)
    assert end - start == 2 and start >= 3  # the gap 3:6, with room for the drafter
    assert "2 blocks (3 without it)" in plan.describe("cpu")
    assert choose_blocks(ServerConfig(model=MODEL, num_blocks=3), [srv("a", 0, 3)], TOTAL, plan) == (3, 6)  # as asked
    # a server that moves to a 3-block gap at the tail keeps the blocks and drops the drafter
    assert not plan.fits(3, 6) and plan.fits(3, 6, drafter=False) and plan.fits(4, 6)


def test_a_server_that_cannot_hold_an_end_takes_a_middle_span():
    """Room for one block and nothing more: the plan says 1 block (in the middle, where no
    embeddings or LM head are held), and placement keeps off both ends even where they are gaps."""
    from server.placement import check_requested_blocks, choose_blocks
    from server.server_config import ServerConfig

    plan = fabricated_plan(12)
    assert (plan.blocks, plan.head_blocks, plan.tail_blocks) == (1, 0, 0)
    for servers in ([], [srv("a", 1, 6)], [srv("a", 0, 5)]):
        start, end = choose_blocks(ServerConfig(model=MODEL), servers, TOTAL, plan)
        assert end - start == 1 and 1 <= start and end <= TOTAL - 1, (servers, start, end)
    check_requested_blocks(ServerConfig(model=MODEL, blocks=(2, 3)), plan, "cpu")  # fits: no error
    with pytest.raises(ValueError, match=r"blocks 0:1 do not fit: they need 0.00 GiB .*embeddings.* is free on cpu"):
        check_requested_blocks(ServerConfig(model=MODEL, blocks=(0, 1)), plan, "cpu")
    with pytest.raises(ValueError, match="--num-blocks 2: blocks 1:3 do not fit"):
        check_requested_blocks(ServerConfig(model=MODEL, num_blocks=2), plan, "cpu")
    with pytest.raises(ValueError, match="not even one block fits"):
        check_requested_blocks(ServerConfig(model=MODEL), fabricated_plan(9), "cpu")


def test_joining_throughput_is_the_slowest_online_server_per_block():
    online = [srv("a", 0, 2, throughput=30), srv("b", 2, 6, throughput=10), srv("c", 0, 6, throughput=1000)]
    assert joining_throughput(online, 4) == pytest.approx(10)  # b: 10 tokens/s over 4 blocks
    assert joining_throughput(online, 2) == pytest.approx(20)
    assert joining_throughput(online + [joining("j", 0, 1)], 1) == pytest.approx(40)  # joining ones do not count
    assert joining_throughput([], 3) == JOINING_THROUGHPUT


def test_rebalancing_counts_a_joining_server():
    """A running server on a doubly served range would move to the gap, unless a joining
    server has already claimed it."""
    me, other = srv("me", 0, 3), srv("a", 0, 3)
    assert should_move([me, other], me, TOTAL) == (3, 6)
    newcomer = joining("j", 3, 6)
    newcomer = msgspec.structs.replace(newcomer, throughput=joining_throughput([me, other], 3))
    assert should_move([me, other, newcomer], me, TOTAL) is None


# --- routing ignores them ------------------------------------------------------------------------


def test_router_never_routes_through_a_joining_server():
    fast_joining = srv("j", 0, 6, throughput=1000, state=ServerState.JOINING)
    slow = srv("s", 0, 6, throughput=1)
    route = MaxFlowRouter().plan([fast_joining, slow], 0, TOTAL, client_rtts={"j": 0.001, "s": 1.0})
    assert [hop.peer_id for hop in route] == ["s"]
    with pytest.raises(NoRouteError, match="1 server is joining"):
        MaxFlowRouter().plan([fast_joining, srv("h", 0, 3)], 0, TOTAL)
    assert swarm_max_flow([fast_joining], TOTAL) == 0


def test_the_dashboard_lists_joining_servers_without_counting_them():
    from swarm.dashboard.events import ModelSnapshot, SwarmPolled
    from swarm.dashboard.state import State, fold
    from swarm.dashboard.views import state_view

    snapshot = ModelSnapshot(MODEL, TOTAL, (srv("a", 0, 3), joining("j", 3, 6)))
    state = fold([SwarmPolled(100.0, (snapshot,))], State())
    view = state_view(state, now=101.0, refresh_seconds=5)["models"][0]
    assert {s["peer_id"]: s["state"] for s in view["servers"]} == {"a": "online", "j": "joining"}
    assert view["missing_blocks"] == [3, 4, 5] and view["servers_online"] == 1 and view["max_flow"] == 0


# --- the re-read after announcing ----------------------------------------------------------------


def test_rank_is_online_first_then_a_pairwise_draw_never_the_claim_time():
    from server.joining import rank

    me = joining("m", 0, 3, started_at=100)
    assert outranks(srv("o", 0, 3, started_at=500), me)
    assert not outranks(srv("d", 0, 3, state=ServerState.DRAINING), me)
    # of two joining servers, the one that wins the draw of both ids, whatever either claims as its start
    assert rank("e", "m") < rank("m", "e") and rank("l", "m") > rank("m", "l")
    for claimed in (0.0, 99.0, 101.0, 1e9):
        assert outranks(joining("e", 0, 3, started_at=claimed), me)
        assert not outranks(joining("l", 0, 3, started_at=claimed), me)
        assert outranks(me, joining("l", 0, 3, started_at=claimed))


def test_rivals_are_new_overlapping_servers_that_outrank_us():
    me = joining("m", 0, 3, started_at=100)
    winner = joining("e", 2, 5, started_at=150)  # wins the draw against "m"
    assert rivals(me, [], [winner]) == [winner]
    assert rivals(me, [winner], [winner]) == []  # counted when choosing: chosen knowingly
    assert rivals(me, [joining("e", 3, 6)], [winner]) == [winner]  # it moved onto us
    assert rivals(me, [], [joining("e", 3, 6)]) == []  # no overlap
    assert rivals(me, [], [joining("l", 0, 3, started_at=0.0)]) == []  # it yields to us, whatever it claims


class FakeSwarm:
    """A DHT reduced to what claim_span uses: one record per peer; the first read of every
    server waits until all of them have read, so they all choose from the same empty swarm."""

    def __init__(self, racers: int):
        self.records: dict[str, ServerInfo] = {}
        self.published: list[ServerInfo] = []
        self.barrier = asyncio.Barrier(racers) if racers > 1 else None
        self.reads: dict[str, int] = {}

    def fetch_for(self, peer: str):
        async def fetch():
            snapshot = list(self.records.values())
            self.reads[peer] = self.reads.get(peer, 0) + 1
            if self.reads[peer] == 1 and self.barrier is not None:
                await self.barrier.wait()
            return snapshot

        return fetch

    async def publish(self, info: ServerInfo) -> None:
        self.records[info.peer_id] = info
        self.published.append(info)
        await asyncio.sleep(0)

    def claim(self, peer: str, started_at: float, choose=choose3, automatic: bool = True):
        template = ServerInfo(peer_id=peer, model=MODEL, start_block=0, end_block=1)
        return claim_span(
            template,
            choose,
            self.fetch_for(peer),
            self.publish,
            automatic=automatic,
            jitter=0,
            settle=0.01,
            now=lambda: started_at,
        )


def test_two_servers_that_chose_the_same_gap_at_once_split_the_model():
    """ "early" wins the draw against "late" (server.joining.rank): it keeps the span although
    "late" claims an earlier start."""
    swarm = FakeSwarm(racers=2)

    async def race():
        return await asyncio.gather(swarm.claim("late", 0.0), swarm.claim("early", 100.0))

    late, early = asyncio.run(race())
    assert {(i.peer_id, i.start_block, i.end_block) for i in swarm.published[:2]} == {("late", 0, 3), ("early", 0, 3)}
    assert (early.start_block, early.end_block) == (0, 3)  # wins the draw: keeps it
    assert (late.start_block, late.end_block) == (3, 6)  # yields, chooses again, announces again
    assert late.state == early.state == ServerState.JOINING and late.throughput == JOINING_THROUGHPUT
    assert late.started_at == 0.0  # its record's freshness does not change with its span
    assert swarm.records["late"].end_block == 6 and len(swarm.published) == 3


def test_equal_claim_times_are_broken_by_the_draw():
    swarm = FakeSwarm(racers=2)

    async def race():
        return await asyncio.gather(swarm.claim("QmB", 100.0), swarm.claim("QmA", 100.0))

    b, a = asyncio.run(race())
    assert (b.start_block, a.start_block) == (0, 3)  # "QmB" wins the draw against "QmA"


def test_a_server_that_came_online_meanwhile_wins():
    swarm = FakeSwarm(racers=1)
    reads = iter([[], [srv("online", 0, 3, started_at=999.0)]])

    async def fetch():
        return next(reads)

    template = ServerInfo(peer_id="me", model=MODEL, start_block=0, end_block=1)
    mine = asyncio.run(claim_span(template, choose3, fetch, swarm.publish, jitter=0, settle=0, now=lambda: 100.0))
    assert (mine.start_block, mine.end_block) == (3, 6)


def test_a_second_choice_happens_once_and_may_keep_the_span():
    """Redundancy on a covered model is fine: if the best span is still ours, keep it."""
    swarm = FakeSwarm(racers=1)
    covered = [srv("a", 0, 3), srv("b", 3, 6, throughput=5)]
    reads = iter([covered, covered + [joining("rival", 3, 6, started_at=1.0)]])

    async def fetch():
        return next(reads)

    template = ServerInfo(peer_id="me", model=MODEL, start_block=0, end_block=1)
    mine = asyncio.run(claim_span(template, choose3, fetch, swarm.publish, jitter=0, settle=0, now=lambda: 100.0))
    assert (mine.start_block, mine.end_block) == (3, 6) and len(swarm.published) == 1


def test_fixed_blocks_are_announced_without_reading_the_swarm():
    swarm = FakeSwarm(racers=1)
    mine = asyncio.run(swarm.claim("fixed", 5.0, choose=lambda servers: (2, 4), automatic=False))
    assert (mine.start_block, mine.end_block, mine.state) == (2, 4, ServerState.JOINING)
    assert swarm.reads == {"fixed": 1} and swarm.published == [mine]  # one read: for the placeholder throughput


# --- the newest record of a server wins --------------------------------------------------------


def test_fetch_servers_prefers_the_newest_record_of_a_server_that_changed_span():
    """A server that re-chose (or moved) leaves its old record under the blocks it left; whatever
    the order of the block keys, the newer record is the one read."""
    import hivemind

    from protocol.dht_records import announce, fetch_servers

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        announce(dht, joining("p", 3, 6), 30, num_blocks=TOTAL)
        time.sleep(0.05)
        announce(dht, joining("p", 0, 3), 30, num_blocks=TOTAL)
        assert [(s.start_block, s.end_block) for s in fetch_servers(dht, MODEL, TOTAL)] == [(0, 3)]
        time.sleep(0.05)
        announce(dht, srv("p", 3, 6), 30, num_blocks=TOTAL)
        assert [(s.start_block, s.state) for s in fetch_servers(dht, MODEL, TOTAL)] == [(3, ServerState.ONLINE)]
    finally:
        dht.shutdown()


# --- live: two --num-blocks servers started at the same moment -----------------------------------


@pytest.fixture(scope="module")
def empty_swarm(tiny_llama_path, artifacts_dir):
    """A bootstrap node and no server yet, for the tiny 6-block Llama."""
    from swarm.local import LocalSwarm
    from tests.kit.swarms import SERVER_ARGS

    with LocalSwarm(
        str(tiny_llama_path), spans=[], server_args=SERVER_ARGS, log_dir=str(artifacts_dir / "joining")
    ) as swarm:
        yield swarm


@pytest.mark.timeout(300)
def test_two_servers_started_together_take_different_spans(empty_swarm):

    from protocol.dht import make_dht
    from protocol.dht_records import fetch_servers

    swarm = empty_swarm
    swarm.start_server(None, 3, name="twin-1")
    swarm.start_server(None, 3, name="twin-2")
    dht = make_dht(initial_peers=swarm.initial_peers, client_mode=True)
    try:
        seen: dict[str, set] = {"twin-1": set(), "twin-2": set()}
        spans: dict = {}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in swarm.servers), "a server exited during start-up"
            records = {s.public_name: s for s in fetch_servers(dht, swarm.dht_name, TOTAL)}
            for name, info in records.items():
                seen[name].add((info.state.value, info.start_block, info.end_block))
            if len(records) == 2 and all(s.state == ServerState.ONLINE for s in records.values()):
                spans = {name: (s.start_block, s.end_block) for name, s in records.items()}
                break
            time.sleep(0.3)
        assert sorted(spans.values()) == [(0, 3), (3, 6)], (spans, seen)
        # each announced its span as joining before it came online (before loading weights)
        assert all(any(state == "joining" for state, *_ in seen[name]) for name in seen), seen
    finally:
        dht.shutdown()
