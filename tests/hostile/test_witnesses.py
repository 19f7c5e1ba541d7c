"""Who may witness for whom, and what a generation says about its tokens (client/_witnesses.py,
client/_confirmation.py; docs/reliability.md, "Witnesses" and "What is confirmed")."""

from __future__ import annotations

import asyncio
import random
import warnings
from types import SimpleNamespace

import pytest

from client._confirmation import check_audit_policy, count, report
from client._options import GenerationOptions
from client._stats import GenerationStats
from client._witnesses import Witnesses, machine_group, trusted_set
from client.errors import UnconfirmedTokensError, UnconfirmedTokensWarning


def test_machine_groups_by_observed_address():
    assert machine_group("/ip4/1.2.3.7/tcp/31337", "a") == machine_group("/ip4/1.2.3.200/udp/1/quic", "b")
    assert machine_group("/ip4/1.2.3.7/tcp/1", "a") != machine_group("/ip4/1.2.4.7/tcp/1", "a")
    assert machine_group("/ip6/2a00:1450:1:2::1/tcp/1", "a") == machine_group("/ip6/2a00:1450:1:ffff::9/tcp/1", "b")
    assert machine_group("/ip6/2a00:1450:1::1/tcp/1", "a") != machine_group("/ip6/2a00:1450:2::1/tcp/1", "a")
    # private addresses: the exact address (a LAN's honest hosts share a /24)
    assert machine_group("/ip4/10.0.0.2/tcp/1", "a") != machine_group("/ip4/10.0.0.3/tcp/1", "b")
    assert machine_group("/ip4/10.0.0.2/tcp/1", "a") == machine_group("/ip4/10.0.0.2/tcp/2", "b")
    # loopback: a process on the client's own machine, one group per peer id
    assert machine_group("/ip4/127.0.0.1/tcp/1", "a") != machine_group("/ip4/127.0.0.1/tcp/2", "b")
    assert machine_group("/ip6/::1/tcp/1", "a") == "local:a"
    # behind one relay: one group, whoever the peers are
    circuit = "/ip4/198.51.100.1/tcp/1/p2p/QmRelay/p2p-circuit"
    assert machine_group(circuit, "a") == machine_group(circuit, "b")
    assert machine_group("/unix/tmp/sock", "a") is None


class FakeP2P:
    def __init__(self, peers):
        self.peers = peers

    async def list_peers(self):
        return [
            SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda p=peer: p), addrs=addrs)
            for peer, addrs in self.peers.items()
        ]


def test_independent_witnesses_and_trusted_first():
    witnesses = Witnesses(trusted=["trusted"])
    p2p = FakeP2P(
        {
            "tail": ["/ip4/1.2.3.7/tcp/1"],
            "sybil": ["/ip4/1.2.3.8/tcp/1"],  # the tail's /24: one operator as far as we can tell
            "other": ["/ip4/5.6.7.9/tcp/1"],
            "trusted": ["/ip4/1.2.3.9/tcp/1"],  # trusted whatever its address
        }
    )
    asyncio.run(witnesses.refresh(p2p))
    assert not witnesses.independent("sybil", ["tail"])
    assert witnesses.independent("other", ["tail"]) and witnesses.independent("trusted", ["tail"])
    assert not witnesses.independent("stranger", ["tail"])  # no connection: no known address
    records = [SimpleNamespace(peer_id=p) for p in ("other", "sybil", "trusted", "stranger")]
    assert [r.peer_id for r in witnesses.choose(records, ["tail"])] == ["trusted", "other"]


def test_one_of_each_machine_group_comes_before_a_second_of_any():
    """Five identities on one /24 (one operator as far as the client can tell) and one honest tail on
    another: whatever order they come in, the honest one is among the first two witnesses, so a bounded
    number of witnesses (the last audit's six) always includes it."""
    witnesses = Witnesses(trusted=["trusted"])
    sybils = [f"sybil{i}" for i in range(5)]
    p2p = FakeP2P(
        {
            "tail": ["/ip4/9.9.9.1/tcp/1"],
            **{s: [f"/ip4/1.2.3.{10 + i}/tcp/1"] for i, s in enumerate(sybils)},
            "honest": ["/ip4/5.6.7.9/tcp/1"],
            "local1": ["/ip4/127.0.0.1/tcp/1"],  # loopback: each server its own group
            "local2": ["/ip4/127.0.0.1/tcp/2"],
            "trusted": ["/ip4/1.2.3.99/tcp/1"],  # trusted: first, whatever its group
        }
    )
    asyncio.run(witnesses.refresh(p2p))
    records = [SimpleNamespace(peer_id=p) for p in [*sybils, "honest"]]
    assert [r.peer_id for r in witnesses.choose(records, ["tail"])] == ["sybil0", "honest", *sybils[1:]]
    records = [SimpleNamespace(peer_id=p) for p in [*sybils, "local1", "local2", "trusted", "honest"]]
    chosen = [r.peer_id for r in witnesses.choose(records, ["tail"])]
    assert chosen == ["trusted", "sybil0", "local1", "local2", "honest", *sybils[1:]]


def test_a_draw_takes_the_machine_group_first():
    """The pool's random draws: five identities on one /24 and one honest tail on another are two groups,
    so the honest one is drawn about half the time (one in six before); where every group holds one
    candidate (loopback swarms) a draw is the plain draw it was, the same for the same seed."""
    witnesses = Witnesses()
    sybils = [f"sybil{i}" for i in range(5)]
    p2p = FakeP2P(
        {**{s: [f"/ip4/1.2.3.{10 + i}/tcp/1"] for i, s in enumerate(sybils)}, "honest": ["/ip4/5.6.7.9/tcp/1"]}
    )
    asyncio.run(witnesses.refresh(p2p))
    records = [SimpleNamespace(peer_id=p) for p in [*sybils, "honest"]]
    rng = random.Random(0)
    honest = sum(witnesses.draw(rng, records).peer_id == "honest" for _ in range(2000))
    assert 900 <= honest <= 1100, honest
    alone = [SimpleNamespace(peer_id=p) for p in ("a", "b", "c")]  # no known address: each its own group
    first, second = random.Random(5), random.Random(5)
    assert [witnesses.draw(first, alone) for _ in range(20)] == [second.choice(alone) for _ in range(20)]


def test_trusted_peers_are_checked():
    assert trusted_set(None, ["a"]) == {"a"} and trusted_set(["b"], ["a"]) == {"b"} and trusted_set([]) == set()
    for bad in ("Qm...", [1], [""]):
        with pytest.raises(ValueError, match="trusted_peers must be a list of peer ids"):
            trusted_set(bad)
    with pytest.raises(ValueError, match="trusted_peers"):
        GenerationOptions(trusted_peers="Qm").checked()
    with pytest.raises(ValueError, match="audit must be one of"):
        GenerationOptions(audit="strict").checked()
    assert check_audit_policy("required") == "required"
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="audit_witnesses must be an int >= 1"):
            GenerationOptions(audit_witnesses=bad).checked()
    assert GenerationOptions(audit_witnesses=5).checked().audit_witnesses == 5


def test_every_token_is_counted_once_by_how_it_was_confirmed():
    stats = GenerationStats(new_tokens=6)
    history = [1, 2, 10, 11, 12, 13, 14, 15]  # a prompt of 2, six new tokens
    count(stats, history, 2, audited=[1, 2, 10, 11, 12, 99], trusted_confirmed={2, 3}, trusted_tail={7})
    # 10, 11: a trusted shadow; 12: an untrusted one; 13 (audited as 99: not confirmed), 14: none; 15: trusted tail
    assert (stats.tokens_confirmed_trusted, stats.tokens_confirmed_untrusted, stats.tokens_unconfirmed) == (3, 1, 2)
    count(stats, history, 2, audited=None, trusted_confirmed=(), trusted_tail=())
    assert stats.tokens_unconfirmed == 6 and stats.tokens_confirmed_untrusted == 0
    # 12 confirmed only by witnesses the generation avoids after an unsettled dispute: unconfirmed
    count(stats, history, 2, [1, 2, 10, 11, 12, 99], {2, 3}, {7}, disputed_only={4})
    assert (stats.tokens_confirmed_trusted, stats.tokens_confirmed_untrusted, stats.tokens_unconfirmed) == (3, 0, 3)


def test_tokens_confirmed_only_by_avoided_witnesses_are_disputed_only():
    """Three sybils S1-S3 each on a group of its own disputed honest T unsettled (near ties): all four are
    avoided. Positions S2 and S3 confirmed are confirmed by avoided witnesses only; one that T or a
    trusted witness also confirmed is not; a trusted witness is never avoided."""
    from client._avoidance import Avoidance
    from client._verdict_audits import VerdictAuditor
    from client._witnesses import Witnesses

    witnesses = Witnesses(trusted=["K"])
    witnesses.groups = {p: f"net:10.0.{i}.0/24" for i, p in enumerate(["T", "S1", "S2", "S3", "V", "K"])}
    avoidance = Avoidance(witnesses)
    auditor = VerdictAuditor(SimpleNamespace(request_timeout=1.0), 50, witnesses=witnesses, avoidance=avoidance)
    auditor.confirmed_by("S2", range(10, 14))
    auditor.confirmed_by("S3", range(12, 16))
    auditor.confirmed_by("V", range(15, 17))
    auditor.confirmed_by("K", range(13, 14))
    assert auditor.disputed_only() == set()
    for sybil in ("S1", "S2", "S3"):
        avoidance.dispute(sybil, "T")
    assert auditor.disputed_only() == {10, 11, 12, 14}  # 13: K (trusted) too; 15, 16: V (not avoided) too
    assert auditor.trusted_confirmed == {13}


def test_unconfirmed_tokens_warn_or_raise():
    stats = GenerationStats(new_tokens=5, tokens_unconfirmed=2, disputed_peers=["x", "y"])
    with pytest.warns(UnconfirmedTokensWarning, match="2 of 5 generated tokens are unconfirmed: a dispute"):
        report(stats, "warn")
    with pytest.raises(UnconfirmedTokensError, match='2 of 5 .*audit="required"') as raised:
        report(stats, "required")
    assert raised.value.stats is stats
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report(GenerationStats(new_tokens=5, tokens_confirmed_untrusted=5), "required")  # all confirmed: silent


def test_the_gateway_reports_how_the_tokens_were_confirmed():
    from swarm.api.responses import speculation_headers, speculation_stats

    rows = [
        GenerationStats(laps=2, tokens_confirmed_trusted=3, tokens_unconfirmed=1),
        GenerationStats(laps=1, tokens_confirmed_untrusted=2, tokens_unconfirmed=4),
    ]
    stats = speculation_stats(rows)
    assert (stats["tokens_confirmed_trusted"], stats["tokens_confirmed_untrusted"], stats["tokens_unconfirmed"]) == (
        3,
        2,
        5,
    )
    assert speculation_headers(rows)["x-specswarm-tokens-unconfirmed"] == "5"


def test_a_spot_check_substitute_on_the_checked_servers_machine_is_replaced_or_skipped():
    from client._spot_checks import AuditResult, SpotChecker
    from protocol.messages import Hop

    class Swarm:
        request_timeout = 1.0
        records: dict = {}
        p2p = FakeP2P(
            {
                "hop": ["/ip4/1.2.3.7/tcp/1"],
                "sybil": ["/ip4/1.2.3.8/tcp/1"],
                "other": ["/ip4/5.6.7.9/tcp/1"],
            }
        )

        async def unresponsive(self, route, timeout=3.0):
            return []

    checker = SpotChecker(Swarm(), 1.0, 10)
    assert asyncio.run(checker._independent("hop", "sybil", ["other"])) == ("other", [])
    assert asyncio.run(checker._independent("hop", "sybil", [])) == (None, [])
    result = asyncio.run(checker._compare([Hop("hop", 0, 3)], 0, "sybil", [], [1, 2], AuditResult("failed")))
    assert result.verdict == "skipped" and "another machine group" in result.detail


def test_the_gateway_passes_trusted_peers_to_every_model(monkeypatch):
    from client import AutoDistributedModelForCausalLM
    from swarm.api import __main__ as gateway

    assert gateway.build_parser().parse_args([]).trusted_peers == []
    seen = {}

    def fake_from_pretrained(name, **kwargs):
        seen[name] = kwargs["trusted_peers"], kwargs["output_audit_rate"]
        raise ValueError("stop here")  # the gateway reports it and exits 2, serving nothing

    monkeypatch.setattr(AutoDistributedModelForCausalLM, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(gateway, "setup_logging", lambda level: None)  # leave the test process's logging alone
    monkeypatch.setattr(gateway.lifeline, "install", lambda: None)
    assert (
        gateway.main(["--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--trusted-peers", "QmA", "QmB"]) == 2
    )
    assert seen == {"m": (["QmA", "QmB"], 0.1)}  # the output audits' default rate
    args = ["--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--output-audit-rate", "1"]
    assert gateway.main(args) == 2 and seen["m"] == ([], 1.0)
