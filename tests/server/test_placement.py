"""Placement trusts no claim: records claiming 1,000 times a real server's throughput, or a claim
time of 0, change no honest server's placement or rebalancing decision beyond what announcing a
typical server would (protocol.placement.placement_view, server.joining.rank).

Unit tests on fabricated records: an honest swarm of 8 blocks, three servers on each half.
"""

from __future__ import annotations

import functools

import msgspec

from protocol.placement import CLAIM_CAP, choose_best_span, placement_view, should_move
from protocol.records import ServerInfo, ServerState
from server.joining import outranks, rivals
from tests.kit import records

TOTAL = 8
HUGE = 1000.0  # times an honest server's claim


srv = functools.partial(records.srv, model="m", started_at=1000.0)


def honest_swarm() -> list[ServerInfo]:
    return [srv(p, 0, 4) for p in "ACE"] + [srv(p, 4, 8) for p in "BDF"]


def hostile(peer: str, start: int, end: int, state=ServerState.ONLINE) -> ServerInfo:
    return srv(peer, start, end, throughput=HUGE * 10.0, state=state, started_at=0.0)


def test_a_huge_claim_counts_as_a_typical_server():
    view = {s.peer_id: s.throughput for s in placement_view([*honest_swarm(), hostile("H", 0, 4)])}
    assert view["H"] == CLAIM_CAP * 10.0 and all(view[p] == 10.0 for p in "ABCDEF")
    # a joining record counts at most as the slowest online server (what honest joiners announce)
    view = placement_view([*honest_swarm(), srv("J", 2, 6, throughput=HUGE, state=ServerState.JOINING)])
    assert {s.peer_id: s.throughput for s in view}["J"] == 10.0
    # idempotent, and without an online record there is nothing to compare with
    assert placement_view(placement_view([*honest_swarm(), hostile("H", 0, 4)])) == placement_view(
        [*honest_swarm(), hostile("H", 0, 4)]
    )
    assert placement_view([hostile("H", 0, 4, ServerState.JOINING)])[0].throughput == HUGE * 10.0


def test_a_huge_claim_does_not_push_an_honest_server_off_its_blocks():
    """Believed as written, one record claiming 1,000x on blocks 0:4 makes them look saturated and
    the honest server A would move to 4:8 (leaving 0:4 to the claimant); counted as placement
    counts it, A stays, as it does without that record."""
    from protocol.flow import max_flow

    swarm, liar = honest_swarm(), hostile("H", 0, 4)
    me = swarm[0]
    assert should_move(swarm, me, TOTAL) is None
    assert should_move([*swarm, liar], me, TOTAL) is None
    others = [*swarm[1:], liar]  # what the claim would have bought, believed as written:
    moved = msgspec.structs.replace(me, start_block=4, end_block=8)
    assert max_flow([*others, moved], 0, TOTAL) > 1.2 * max_flow([*others, me], 0, TOTAL)


def test_an_honest_newcomer_chooses_as_if_the_liars_claimed_a_typical_speed():
    """Liars with 1,000x claims on blocks 4:8 (one ONLINE, one JOINING with claim time 0) next to
    one honest server there: the newcomer still takes 4:8, the least-served half, as it does when
    they claim what an honest server does; believed as written they would send it to 0:4."""
    from protocol.flow import PLACED, usable
    from protocol.placement import _best_span

    swarm = [srv(p, 0, 4) for p in "ACEG"] + [srv("B", 4, 8)]
    liars = [hostile("H1", 4, 8), hostile("H3", 4, 8, ServerState.JOINING)]
    typical = [msgspec.structs.replace(h, throughput=10.0) for h in liars]
    assert choose_best_span([*swarm, *liars], TOTAL, 4, 1.0) == (4, 8)
    assert choose_best_span([*swarm, *typical], TOTAL, 4, 1.0) == (4, 8)
    assert _best_span(usable([*swarm, *liars], PLACED), TOTAL, 4, 1.0, None) == (0, 4)  # believed
    # and liars cannot hide a gap: blocks 0:4 get the newcomer when nobody else holds them
    assert choose_best_span([srv(p, 4, 8) for p in "BDF"] + liars, TOTAL, 4, 1.0) == (0, 4)


def test_a_claimed_start_time_of_zero_outranks_nobody():
    """Joining order is a pairwise draw of peer ids, not the claimed start time: a record claiming
    started_at=0 wins against about half of the honest newcomers, as any peer does."""
    liar = srv("liar", 0, 4, state=ServerState.JOINING, started_at=0.0)
    newcomers = [srv(f"peer{i}", 0, 4, state=ServerState.JOINING, started_at=1e9 + i) for i in range(64)]
    beaten = [me for me in newcomers if outranks(liar, me)]
    assert 16 < len(beaten) < 48  # a fair draw, whatever the claim time
    for me in newcomers:
        assert outranks(liar, me) != outranks(me, liar)  # both sides agree who yields
        later = msgspec.structs.replace(liar, started_at=2e9)
        assert outranks(later, me) == outranks(liar, me)  # the claim time changes nothing
        assert rivals(me, [], [liar]) == ([liar] if outranks(liar, me) else [])


# ---- what a refresh reads -------------------------------------------------------------------------


class KeysAsked:
    """A stand-in for the DHT's lookup: records the keys a read asks for, answers nothing."""

    def __init__(self):
        self.keys: list[list[str]] = []

    def run_coroutine(self, call, return_future=False):
        self.keys.append(list(call.keywords["keys"]))
        return {}


def test_a_refresh_reads_only_the_blocks_beside_its_span_and_rebalancing_reads_all():
    """Every key is a full DHT search, so a refresh that does not rebalance reads two: the block
    before the span (servers that forward sessions to it) and the block after (the next servers it
    pings); the head and the tail read one, a whole-model server none."""
    from protocol.dht_records import block_key
    from server.placement import fetch_same_model
    from server.upkeep import upkeep_blocks

    assert upkeep_blocks(srv("M", 2, 5), TOTAL) == [1, 5]
    assert upkeep_blocks(srv("H", 0, 4), TOTAL) == [4]
    assert upkeep_blocks(srv("T", 4, 8), TOTAL) == [3]
    assert upkeep_blocks(srv("W", 0, 8), TOTAL) == []
    dht, me = KeysAsked(), srv("M", 2, 5)
    assert fetch_same_model(dht, me, TOTAL, upkeep_blocks(me, TOTAL)) == []
    assert fetch_same_model(dht, srv("W", 0, 8), TOTAL, []) == [] and len(dht.keys) == 1  # nothing to read: no search
    fetch_same_model(dht, me, TOTAL)  # rebalancing: the whole model
    assert dht.keys == [[block_key("m", 1), block_key("m", 5)], [block_key("m", b) for b in range(TOTAL)]]
