"""Outputs you can trust on a swarm of strangers (docs/design.md, "Trust"; issue 24).

Unit: the verdict digest names every field a verdict depends on and is keyed with the session's
secret. Live: a tiny-model swarm of honest servers H (blocks 0:2), M (2:4) and T (4:6), and per test
one hostile middle server F (2:4) started through tests/kit/faulty_server.py; the client's first route
runs through F, the other through M. Each fault is met as the design says: a rewritten Step is
caught by its verdict's digest; a false accusation, a replaced secret_hash and a black hole that
answers pings each cost one failover; the output equals local transformers and no honest server is
excluded (the route's honest servers are at most suspects, which routes avoid only where they can).
A tail that claims ten times the throughput it measured is capped by what the client measures in
the default mode (looped runs) and routed around.
"""

from __future__ import annotations

import time

import pytest
import torch

from client._throughput import ThroughputMeter
from protocol.digest import step_digest
from protocol.messages import GREEDY, Hop, SamplingParams
from protocol.records import ServerInfo
from protocol.routing import MaxFlowRouter, cap_throughput
from swarm.local import LocalSwarm, kill_group
from tests.kit.faulty_server import faulty
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.routes import PreferredRoutes
from tests.kit.swarms import SERVER_ARGS, servers_by_name

NEW_TOKENS = 40
HONEST = {"H": (0, 2), "M": (2, 4), "T": (4, 6), "U": (4, 6)}  # U: a second honest tail
THROUGH_M = [("H", 0, 2), ("M", 2, 4), ("T", 4, 6)]


# ---- unit: the digest ---------------------------------------------------------------------------

BASE = dict(run_id=3, start_pos=10, token_ids=[5, 6, 7], n_draft=2, sampling=GREEDY)


@pytest.mark.parametrize(
    "change",
    [
        dict(run_id=4),
        dict(start_pos=11),
        dict(token_ids=[5, 6, 8]),
        dict(token_ids=[4, 6, 7]),
        dict(n_draft=1),
        dict(sampling=SamplingParams(do_sample=True, seed=1)),
        dict(parents=[-1, 0]),
        dict(tree_path=[0]),
        dict(draft_q=b"\x00\x3c\x00\x3c"),
    ],
    ids=lambda c: next(iter(c)),
)
def test_the_digest_changes_with_every_field_a_verdict_depends_on(change):
    assert step_digest("secret", **{**BASE, **change}) != step_digest("secret", **BASE)


def test_the_digest_is_keyed_and_short():
    digest = step_digest("secret", **BASE)
    assert digest == step_digest("secret", **BASE)  # deterministic: client and tail agree
    assert digest != step_digest("other", **BASE)  # a hop without the secret cannot compute it
    assert 0 <= digest < 2**32  # 5 bytes on the wire


def test_a_session_id_longer_than_the_limit_is_malformed():
    from protocol.errors import ErrorCode, ProtocolError
    from protocol.messages import MAX_SESSION_ID_CHARS, CloseSession, decode, encode

    assert decode(encode(CloseSession(session_id="a" * MAX_SESSION_ID_CHARS))).session_id == "a" * MAX_SESSION_ID_CHARS
    with pytest.raises(ProtocolError) as caught:
        decode(encode(CloseSession(session_id="a" * (MAX_SESSION_ID_CHARS + 1))))
    assert caught.value.code == ErrorCode.MALFORMED and "length <= 64" in str(caught.value)
    assert "aaaa" not in str(caught.value)  # the id is not echoed


def test_a_looped_lap_is_charged_the_tail_to_head_link_not_the_clients_links():
    """A looped lap runs tail -> head -> ... -> tail; it is timed from the previous verdict's arrival
    to its own, so the tail -> client leg cancels and the client's RTTs to head and tail are no part
    of it. Head h and tail t (1000 tokens/s claimed, 1 ms a step) pinged each other at 20 ms; the
    client's RTTs are 100 ms. A 32 ms looped lap leaves 32 - 2 x 10 (h -> t and t -> h) - 1 (the
    other hop) = 11 ms per hop; the same 32 ms sent by the client is explained by its legs alone."""
    servers = {
        "h": ServerInfo(peer_id="h", model="m", start_block=0, end_block=3, throughput=1000.0, next_pings={"t": 0.02}),
        "t": ServerInfo(peer_id="t", model="m", start_block=3, end_block=6, throughput=1000.0),
    }
    route, rtts = [Hop("h", 0, 3), Hop("t", 3, 6)], {"h": 0.1, "t": 0.1}
    sent = ThroughputMeter()
    sent.observe(route, servers, 0.032, 3, rtts)
    assert sent.measured() == {}
    looped = ThroughputMeter()
    looped.observe(route, servers, 0.032, 3, rtts, looped=True)
    assert looped.measured() == pytest.approx({"h": 1 / 0.011, "t": 1 / 0.011})
    alone = ThroughputMeter()  # a route of one server: its looped runs cross no link at all
    alone.observe([Hop("h", 0, 3)], servers, 0.004, 3, rtts, looped=True)
    assert alone.measured() == pytest.approx({"h": 1 / 0.004})


# ---- live ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def honest_swarm(tiny_llama_path, artifacts_dir):
    with LocalSwarm(
        str(tiny_llama_path),
        spans=list(HONEST.values()),
        names=list(HONEST),
        server_args=SERVER_ARGS,
        log_dir=str(artifacts_dir / "trust-swarm"),
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def liar_swarm(tiny_llama_path, artifacts_dir):
    """A swarm of its own for the lying tails: after the hostile middles above, the honest servers'
    libp2p may hold a dial backoff towards a peer for minutes, and a verdict audit whose only
    substitute tail cannot be dialled then has no verdict (an open gap, noted on issue 24)."""
    with LocalSwarm(
        str(tiny_llama_path),
        spans=list(HONEST.values()),
        names=list(HONEST),
        server_args=SERVER_ARGS,
        log_dir=str(artifacts_dir / "trust-liar-swarm"),
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def greedy_reference(tiny_reference):
    with torch.no_grad():
        out = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT[0]) :].tolist()


_faulty_count = iter(range(1000))


def with_faulty_middle(swarm, path, *fault: str, request_timeout: float = 60.0, blocks=(2, 4), **kwargs):
    """Start F (``blocks``, the middle's by default) with ``fault``, wait until it is online, and
    return a client whose first route runs through it (and the other through M and T); the caller
    stops both."""
    from swarm import AutoDistributedModelForCausalLM

    name = f"F{next(_faulty_count)}"  # a fresh name: an earlier F's record may outlive it a while
    process = swarm.start_server(*blocks, name=name, launcher=faulty(*fault))
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(path), initial_peers=swarm.initial_peers, request_timeout=request_timeout, **kwargs
    )
    deadline = time.monotonic() + 120
    while not all(
        servers_by_name(model, 6).get(n) is not None and servers_by_name(model, 6)[n].state == "online"
        for n in (name, *HONEST)
    ):
        assert time.monotonic() < deadline and process.poll() is None, "F did not come online"
        time.sleep(0.5)
    through_f = [(name, *blocks) if (a, b) == blocks else (n, a, b) for n, a, b in THROUGH_M]
    model.swarm.router = PreferredRoutes(through_f, THROUGH_M)
    model.peers = {n: info.peer_id for n, info in servers_by_name(model, 6).items()}
    model.peers["F"] = model.peers[name]
    return model, process


@pytest.mark.parametrize(
    "fault, events",
    [
        (("--rewrite-steps", "20"), "rewrote"),
        (("--accuse", "3"), "failed"),
        (("--accuse", "3", "--accuse-code", "token_out_of_vocab"), "token_out_of_vocab"),
        # a forged spent compile budget: only the tail's own results stream carries a real one
        (("--accuse", "3", "--accuse-code", "compile_budget"), "not on the tail's own stream: a hop forged it"),
        (("--replace-secret-hash",), "unauthorized"),
        (("--black-hole",), "no result within"),
    ],
    ids=[
        "rewrites-1-in-20",
        "accuses-the-tail",
        "non-retryable-code",
        "forges-compile-budget",
        "replaces-secret-hash",
        "black-hole",
    ],
)
def test_a_hostile_middle_costs_one_failover_and_changes_nothing(
    honest_swarm, tiny_llama_path, greedy_reference, fault, events
):
    # a black hole is found by the client's timeout alone: 4 s, against a healthy lap's well under 1 s
    timeout = 4.0 if "--black-hole" in fault else 60.0
    # the rewriter counts every Step it forwards; audit Steps look like live laps (one per token here,
    # docs/reliability.md "Audits look like live laps"), so with audits on its rewrites may all land on
    # the shadow (a failed audit, nobody blamed) and none on the live session this test is about
    audits = {"verdict_audit_every": 0} if "--rewrite-steps" in fault else {}
    model, process = with_faulty_middle(honest_swarm, tiny_llama_path, *fault, request_timeout=timeout, **audits)
    try:
        kwargs = {"speculation": None} if "--rewrite-steps" in fault else {}  # one lap per token: 20+ Steps
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0, **kwargs)
        stats = model.last_generation_stats
        assert out[0, len(PROMPT[0]) :].tolist() == greedy_reference
        assert stats.failovers == 1, stats.failover_events
        assert events in stats.failover_events[0]
        assert [peer for peer, _, _ in stats.route] == [model.peers[n] for n in ("H", "M", "T")]  # left F
        honest = {model.peers[n] for n in HONEST}
        assert not honest & model.swarm.excluded.current(), "an honest server was excluded"
        assert model.peers["F"] in model.swarm.suspects.current() | model.swarm.excluded.current()
        # the next generation avoids F from the start: no fault, no failover (and no short timeout to fail it)
        model.swarm.request_timeout = 60.0
        again = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0, **kwargs)
        assert again[0, len(PROMPT[0]) :].tolist() == greedy_reference
        assert model.last_generation_stats.failovers == 0
    finally:
        model.shutdown()
        kill_group(process)


# ---- a tail that lies in its verdicts -----------------------------------------------------------

SAMPLING = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)


@pytest.mark.parametrize("lie", ["second", "random"])
def test_a_lying_tail_is_convicted_and_the_output_stays_exact(
    liar_swarm, tiny_llama_path, tiny_reference, greedy_reference, lie
):
    """L (4:6) computes honestly and lies in 30% of its verdicts; with the honest tails trusted
    (``trusted_peers``: a dispute with L is settled by the trusted shadow; a stranger's vote would
    settle nothing, tests/test_sybils.py) and no spot-checks of activations here, greedy and seeded
    outputs equal local transformers, and L is convicted and reported."""
    model, process = with_faulty_middle(
        liar_swarm, tiny_llama_path, "--lie-in-verdicts", "0.3", "--lie", lie, blocks=(4, 6)
    )
    try:
        trusted = [model.peers["T"], model.peers["U"]]
        out = model.generate(
            torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0, trusted_peers=trusted
        )
        stats = model.last_generation_stats
        print(
            f"\n{lie} liar: {stats.verdict_audits} verdict audits, {stats.verdict_audit_positions} audit positions "
            f"for {stats.new_tokens} tokens, {stats.tokens_retracted} retracted: {stats.spot_check_events}"
        )
        assert out[0, len(PROMPT[0]) :].tolist() == greedy_reference, stats.spot_check_events
        assert stats.liars_excluded == [model.peers["F"]], stats.spot_check_events
        assert model.peers["F"] in model.swarm.liars and stats.verdict_audits >= 1
        assert not {model.peers[n] for n in HONEST} & model.swarm.excluded.current()
        assert model.peers["F"] not in [peer for peer, _, _ in stats.route]
        model.swarm.excluded = type(model.swarm.excluded)()  # forgive L: the seeded run meets it again
        sampled = model.generate(
            torch.tensor(PROMPT),
            max_new_tokens=20,
            spot_check_rate=0.0,
            do_sample=True,
            temperature=0.8,
            top_p=0.9,
            seed=1234,
            trusted_peers=trusted,
        )
        assert sampled[0, len(PROMPT[0]) :].tolist() == reference_sample(tiny_reference, PROMPT[0], 20, SAMPLING)
        assert model.last_generation_stats.liars_excluded == [model.peers["F"]]
        _run(model.swarm.flush_reports())
        assert model.swarm.reports[model.peers["F"]] == 2  # reported in the DHT (the dashboard reads it)
    finally:
        model.shutdown()
        kill_group(process)


def test_lies_in_the_last_tokens_only_are_caught_before_generate_returns(liar_swarm, tiny_llama_path, greedy_reference):
    """L lies on every verdict about the last 6 of 40 tokens only: fewer than one audit's worth (16),
    so the audit that sees them may be the one ``generate()`` waits for before it returns; either
    way L is convicted (T and U trusted) before the output is returned, and the output equals
    local transformers."""
    after = len(PROMPT[0]) + NEW_TOKENS - 6
    model, process = with_faulty_middle(
        liar_swarm, tiny_llama_path, "--lie-in-verdicts", "1", "--lie-after", str(after), blocks=(4, 6)
    )
    try:
        trusted = [model.peers["T"], model.peers["U"]]
        out = model.generate(
            torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0, trusted_peers=trusted
        )
        stats = model.last_generation_stats
        assert out[0, len(PROMPT[0]) :].tolist() == greedy_reference, stats.spot_check_events
        assert stats.liars_excluded == [model.peers["F"]], stats.spot_check_events
        disputed = [
            int(e.split("position ")[1].split(":")[0]) for e in stats.spot_check_events if "the route's tail" in e
        ]
        assert disputed and min(disputed) >= after, stats.spot_check_events
    finally:
        model.shutdown()
        kill_group(process)


# ---- a tail that claims more than it serves -----------------------------------------------------

LONG_PROMPT = [PROMPT[0] * 2]  # 22 positions: the first lap is a prefill, which the meter never times
CLAIM_TOKENS = 16


def test_an_inflated_claim_is_capped_in_the_default_mode(liar_swarm, tiny_llama_path, tiny_reference):
    """F (4:6) is slow (50 ms before each block) and announces 10x the throughput it measured
    (its real speed). One generate() with every default (looped
    runs, whose laps the tail starts: before issue 24 none of them was timed, and the first lap,
    a prefill, never is) is enough for the client to cap F far below its claim; its next route
    takes an honest tail, and both outputs equal local transformers."""
    with torch.no_grad():
        out = tiny_reference.generate(torch.tensor(LONG_PROMPT), max_new_tokens=CLAIM_TOKENS, do_sample=False)
    reference = out[0, len(LONG_PROMPT[0]) :].tolist()
    model, process = with_faulty_middle(
        liar_swarm, tiny_llama_path, "--claim-factor", "10", "--block-delay-ms", "50", blocks=(4, 6)
    )
    try:
        liar = model.peers["F"]
        out = model.generate(torch.tensor(LONG_PROMPT), max_new_tokens=CLAIM_TOKENS)
        stats = model.last_generation_stats
        assert out[0, len(LONG_PROMPT[0]) :].tolist() == reference
        assert stats.route[-1][0] == liar and stats.looped_runs > 0 and stats.laps_timed > 0, stats
        claim = next(s.throughput for s in servers_by_name(model, 6).values() if s.peer_id == liar)
        measured = model.swarm.meter.measured()
        assert measured.get(liar, claim) < claim / 3, (measured, claim, stats.laps_timed, stats.laps_untimed)
        capped = {s.peer_id: s.throughput for s in cap_throughput(list(servers_by_name(model, 6).values()), measured)}
        assert capped[liar] < claim / 3
        model.swarm.router = MaxFlowRouter()  # the client's own router, on what it measured
        again = model.generate(torch.tensor(LONG_PROMPT), max_new_tokens=CLAIM_TOKENS)
        assert again[0, len(LONG_PROMPT[0]) :].tolist() == reference
        assert model.last_generation_stats.route[-1][0] in {model.peers["T"], model.peers["U"]}
    finally:
        model.shutdown()
        kill_group(process)


def _run(coro):
    from client import _loop

    return _loop.run(coro)
