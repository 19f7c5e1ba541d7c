"""Avoidance by machine group after unsettled disputes (client/_avoidance.py; docs/reliability.md,
"Avoiding machine groups"), without servers: who is avoided, which avoided server a route falls back
on, who may witness, and that routing honours the fallback order (the live test with sybils is
tests/hostile/test_sybils.py::test_colluding_liars_are_refuted_by_a_trusted_tail_or_flagged)."""

from __future__ import annotations

import asyncio
import types

from client import _swarm
from client._avoidance import Avoidance
from client._witnesses import Witnesses, machine_group
from protocol.messages import Hop
from protocol.route_errors import NoRouteError


def witnesses(groups: dict[str, str], trusted=()) -> Witnesses:
    w = Witnesses(trusted)
    w.groups = dict(groups)
    return w


def rec(peer_id: str):
    return types.SimpleNamespace(peer_id=peer_id)


# T honest on its own address; S1, S2 two sybils on one /24; U honest on another
ONE_GROUP = {"T": "net:198.51.100.0/24", "S1": "net:203.0.113.0/24", "S2": "net:203.0.113.0/24"}


def test_a_dispute_avoids_both_machine_groups_and_falls_back_on_the_smaller_one():
    a = Avoidance(witnesses(ONE_GROUP))
    assert a.dispute("S1", "T") == {"S1", "S2", "T"}  # S2: S1's group-mate, no independent third
    # no tail left: T's group (one identity) before the sybils' (two); within it, S2 before S1
    assert a.order(a.peers) == ["T", "S2", "S1"]
    assert a.order(["S2", "T"]) == ["T", "S2"]  # the same whichever side was the live tail
    b = Avoidance(witnesses(ONE_GROUP))
    b.dispute("T", "S1")
    assert b.order(b.peers) == ["T", "S2", "S1"]


def test_an_honest_swarm_of_one_server_a_group_loses_nothing():
    """Each tail its own group: a dispute avoids the two disputants only, as before, and the third
    tail stays a witness for either."""
    a = Avoidance(witnesses({"T": "net:10.1.0.0/24", "U": "net:10.2.0.0/24", "V": "net:10.3.0.0/24"}))
    assert a.dispute("T", "U") == {"T", "U"}
    assert a.peers == {"T", "U"}
    assert a.may_witness("V", ["T"]) and a.may_witness("V", ["U"])
    assert not a.may_witness("T", ["U"])  # a disputant never witnesses for the side it disputed
    assert a.may_witness("T", ["V"])  # but may for a third group (client/_avoidance.py says why)
    # loopback servers (the user's own, swarm.local) are one group each, by peer id
    local = {p: machine_group("/ip4/127.0.0.1/tcp/1", p) for p in ("T", "U", "V")}
    b = Avoidance(witnesses(local))
    assert b.dispute("T", "U") == {"T", "U"} and b.may_witness("V", ["U"])


def test_fewer_disputes_first_then_fewer_identities():
    """A third honest tail U: S2 (the sybils' group, which already disputed T's) may not witness
    for T, but may for U; when it disputes U too, the sybils' group has two disputes and falls
    behind both honest ones."""
    groups = {**ONE_GROUP, "U": "net:192.0.2.0/24"}
    a = Avoidance(witnesses(groups))
    a.dispute("T", "S1")
    assert "U" not in a.peers
    assert not a.may_witness("S2", ["T"]) and a.may_witness("S2", ["U"])
    # as a witness for U, S2 (avoided) comes after any undisputed candidate
    assert [c.peer_id for c in a.witness_order([rec("S2"), rec("V")], ["U"])] == ["V", "S2"]
    # T disputed S1, not U: it may witness for U, before S2 (the same disputes, fewer identities)
    assert [c.peer_id for c in a.witness_order([rec("S2"), rec("T")], ["U"])] == ["T", "S2"]
    a.dispute("U", "S2")
    assert a.peers == {"T", "U", "S1", "S2"}
    assert set(a.order(a.peers)[-2:]) == {"S1", "S2"}  # the group in two disputes last
    assert set(a.order(a.peers)[:2]) == {"T", "U"}


def test_only_server_identities_count_and_are_avoided():
    """A DHT bootstrap node (or another client) on T's address is no server: it neither joins the
    avoided set nor makes T's group look as large as the sybils' (seen in benchmarks/sybils.py, where
    the swarm's bootstrap peer shares 127.0.0.1 with T)."""
    groups = {**ONE_GROUP, "boot": ONE_GROUP["T"], "boot2": ONE_GROUP["T"]}
    a = Avoidance(witnesses(groups))
    assert a.dispute("T", "S1", servers=["T", "S1", "S2", "H"]) == {"T", "S1", "S2"}
    assert a.order(a.peers) == ["T", "S2", "S1"]


def test_trusted_group_mates_are_never_avoided_and_unknown_addresses_are_their_own_group():
    a = Avoidance(witnesses({**ONE_GROUP, "K": "net:203.0.113.0/24"}, trusted={"K"}))
    assert a.dispute("S1", "T") == {"S1", "S2", "T"}  # K shares the sybils' /24 but is trusted
    b = Avoidance(witnesses({}))
    assert b.dispute("X", "Y") == {"X", "Y"}
    assert b.group("X") != b.group("Y")
    b.disputed(["P", "Q", "R"])  # a three-way split: each avoided and a disputant, no pair
    assert {"P", "Q", "R"} <= b.peers and b.may_witness("P", ["X"])
    b.refuted("Z")
    b.reset()
    assert not b.disputants and not b.pairs and not b.disputes and not b.refutations


def test_a_refuted_group_never_witnesses_and_is_fallen_back_on_last():
    """Sybils on a /24 each: T and S1 disputed (unsettled), then evidence refuted S2. T still witnesses
    for S3 (the next sybil's only other witness would be a sybil); S2 witnesses for nobody; falling
    back, S2 comes after every server that was only disputed, however few its identities."""
    groups = {"T": "net:10.0.0.0/24", "S1": "net:10.0.11.0/24", "S2": "net:10.0.12.0/24", "S3": "net:10.0.13.0/24"}
    a = Avoidance(witnesses(groups))
    a.dispute("S1", "T")
    assert a.refuted("S2") == {"S2"}
    assert a.may_witness("T", ["S3"]) and a.may_witness("S1", ["S3"])
    assert not a.may_witness("S2", ["S3"]) and not a.may_witness("S2", ["T"])
    assert {c.peer_id for c in a.witness_order([rec("S2"), rec("S1"), rec("T")], ["S3"])} == {"S1", "T"}
    assert a.order(["S2", "T", "S1"])[-1] == "S2"
    # evidence then upholds T against S3: T's one unsettled dispute counts for less than S1's
    a.refuted("S3", upheld="T")
    order = a.order(["S3", "S2", "S1", "T"])
    assert order[:2] == ["T", "S1"] and set(order[2:]) == {"S2", "S3"}  # the two refuted: tied, last


class TailOrder:
    """A router over one head H and the tails, in a fixed preference order: the first tail not excluded."""

    def __init__(self, tails):
        self.tails = tails

    def plan(self, servers, start, end, *, max_length=0, exclude=(), client_rtts=None):
        for tail in self.tails:
            if tail not in exclude:
                return [Hop("H", 0, 2), Hop(tail, 2, 4)]
        raise NoRouteError("no tail", [(2, 4)])


def test_routing_falls_back_on_avoided_servers_in_the_order_given(monkeypatch):
    """``open_session(avoid=[...])``: a route without them where the swarm has one; else the one
    allowed first is the first of the sequence (the router alone would take S2)."""
    monkeypatch.setattr(_swarm, "fetch_servers", lambda dht, model, num_blocks: [])
    swarm = _swarm.SwarmClient(None, None, "m", 4, router=TailOrder(["S2", "S1", "T", "U"]))

    async def no_rtts(servers):
        return {}

    swarm._client_rtts = no_rtts

    def tail(avoid):
        return asyncio.run(swarm._plan(8, (), avoid))[-1].peer_id

    assert tail(["T", "S2", "S1"]) == "U"  # a tail outside every avoided group
    swarm.router = TailOrder(["S2", "S1", "T"])
    assert tail(["T", "S2", "S1"]) == "T"
    assert tail(["S1", "S2", "T"]) == "S1"
    assert tail({"T", "S2", "S1"}) == "S1"  # a set: sorted by peer id, as before
    swarm.suspects.add("T")  # a fault's suspect is allowed before the dispute's fallbacks
    assert tail(["S2", "S1"]) == "T"


def test_ties_are_broken_by_the_clients_own_draw_not_by_peer_id():
    """T and S1, one unsettled dispute each, one identity each: tied. A sybil can grind a peer id that
    sorts first, so the tie goes by a keyed hash only this client computes: over 64 clients each side
    comes first sometimes (both orders occur unless 64 fair draws all agree: 2 in 2**64)."""
    groups = {"T": "net:10.0.0.0/24", "S1": "net:10.0.11.0/24"}
    firsts = set()
    for _ in range(64):
        a = Avoidance(witnesses(groups))
        a.dispute("S1", "T")
        order = a.order(a.peers)
        assert order == a.order(["T", "S1"])  # stable within one client
        firsts.add(order[0])
    assert firsts == {"T", "S1"}


def test_a_near_tie_leaning_against_one_side_puts_it_last_before_the_draw():
    """The same tie, but the evidence of the dispute leaned against S1 (client/_evidence.py ``lean``: its
    token loses at the one hidden state both tails sent): T first for every client, whichever side was
    the live tail; a spot-check's dispute (``disputed``) the same. Nothing else changes: both avoided."""
    groups = {"T": "net:10.0.0.0/24", "S1": "net:10.0.11.0/24"}
    for _ in range(16):
        a = Avoidance(witnesses(groups))
        assert a.dispute("S1", "T", against="S1") == {"S1", "T"}
        assert a.order(a.peers) == ["T", "S1"]
        b = Avoidance(witnesses(groups))
        b.disputed(("T", "S1"), against="S1")
        assert b.order(b.peers) == ["T", "S1"] and b.peers == {"T", "S1"}
    c = Avoidance(witnesses(groups))  # a refutation still counts before a lean
    c.dispute("S1", "T", against="S1")
    c.refuted("T", upheld="S1")
    assert c.order(["T", "S1"]) == ["S1", "T"]


def test_leans_count_before_the_number_of_unsettled_disputes():
    """Three sybils on groups of their own, each disputed by T at a near tie that leaned against the sybil:
    T has three unsettled disputes to their one each, but no lean, so T is fallen back on first (the count
    of disputes is a vote the sybils win; before, T came last: benchmarks/sybils.py seed 1006). Without
    leans the count still decides (the residual: nothing the client checked tells them apart)."""
    groups = {"T": "net:10.0.0.0/24", "S1": "net:10.0.11.0/24", "S2": "net:10.0.12.0/24", "S3": "net:10.0.13.0/24"}
    for _ in range(16):
        a = Avoidance(witnesses(groups))
        for sybil in ("S1", "S2", "S3"):
            a.dispute(sybil, "T", against=sybil)
        assert a.order(a.peers)[0] == "T" and a.disputes[a.group("T")] == 3
        b = Avoidance(witnesses(groups))
        for sybil in ("S1", "S2", "S3"):
            b.dispute(sybil, "T")
        assert b.order(b.peers)[-1] == "T"


def test_a_spot_checks_near_tie_names_the_side_it_leans_against():
    """client/_tail_disputes.py ``settle_by_evidence``: the tail spot-check's two verdicts name different
    tokens, the evidence settles nothing but leans against the substitute's token: the result stays
    undecided (both avoided by the caller) and names the substitute as ``against`` for the fallback order."""
    from client._evidence import Settlement
    from client._spot_checks import AuditResult
    from client._tail_disputes import settle_by_evidence
    from protocol.messages import StepResult

    async def near_tie(*args, **kwargs):
        return Settlement(None, "a near tie", leans="shadow")

    checker = types.SimpleNamespace(evidence=types.SimpleNamespace(settle_tails=near_tie))
    route, alt = [Hop("H", 0, 1), Hop("T", 1, 2)], [Hop("H", 0, 1), Hop("S1", 1, 2)]
    said, other = (StepResult(session_id="s", run_id=0, accepted=0, next_token=t) for t in (5, 6))
    result = AuditResult("undecided", disputed=("T", "S1"))
    asyncio.run(settle_by_evidence(checker, route, alt, list(range(12)), 2, (said, other), 1e-3, result, None))
    assert (result.verdict, result.disputed, result.against, result.liar) == ("undecided", ("T", "S1"), "S1", None)
    assert "near tie" in result.detail and result.detail.endswith("leans against S1")
