"""Every field bound, no blame by proxy (issue 35; docs/reliability.md, "Every field bound").

Unit: the verdict digest reads every field of Step but those listed, with a reason, in
``protocol.digest.NOT_DIGESTED`` (a field added to Step later fails the first test until it is given
a changed value here, which then proves the digest reads it); the client rebuilds a looped run's Step
exactly as the tail builds it (one builder, protocol/looped_steps.py); a verdict for a run never sent,
one that skips a run still due, and outputs unasked or missing are route faults (client/_sent_runs.py).

Live: the shared tiny swarm plus one middle server F (2:4) that rewrites the Step field a control file
names (tests/kit/field_rewrites.py); the client's first route runs A 0:2, F 2:4, B 4:6 and the other
C 0:1, D 1:4, E 4:6. For each newly bound field the rewrite is caught as a route fault at its first
verdict (never a conviction or exclusion of the honest tail B), one failover, and the output equals
local transformers.
"""

from __future__ import annotations

import signal
import subprocess
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch

from client import _loop
from client._forward import forward_row
from client._sent_runs import SentRuns
from client.errors import RouteFault
from protocol.digest import NOT_DIGESTED, digest_of
from protocol.messages import GREEDY, SamplingParams, Step, StepResult
from server.looped_runs import following_run
from swarm.local import kill_group
from tests.kit.faulty_server import faulty
from tests.kit.routes import PreferredRoutes
from tests.kit.swarms import servers_by_name

KEY = "secret"
SEEDED = SamplingParams(do_sample=True, temperature=0.8, seed=7)
BASE = Step(
    session_id="s",
    run_id=3,
    start_pos=10,
    token_ids=[5, 6, 7],
    n_draft=2,
    top_logprobs=1,
    tail_drafts=4,
    loop_runs=2,
)
# a value other than BASE's for every digested field: from the default and back to it alike
CHANGED = {
    "session_id": "t",
    "run_id": 4,
    "start_pos": 11,
    "token_ids": [5, 6, 8],
    "n_draft": 1,
    "top_logprobs": 0,
    "return_logits": 2,
    "return_hidden": True,
    "draft_q": b"\x00\x3c\x00\x3c",
    "tail_drafts": 0,
    "loop_runs": 1,
    "parents": [-1, 0],
    "tree_path": [0],
    "hidden_at": 4,
}


# ---- unit: the digest ---------------------------------------------------------------------------


def test_every_step_field_is_bound_or_excluded_with_its_reason():
    names = {f.name for f in msgspec.structs.fields(Step)}
    unaccounted = names - set(CHANGED) - set(NOT_DIGESTED)
    assert not unaccounted, f"Step fields neither digested (give them a value in CHANGED) nor excluded: {unaccounted}"
    assert not set(CHANGED) & set(NOT_DIGESTED) and all(reason.strip() for reason in NOT_DIGESTED.values())
    base = digest_of(BASE, GREEDY, KEY)
    unbound = [name for name, value in CHANGED.items() if digest_of(_with(BASE, name, value), GREEDY, KEY) == base]
    assert not unbound, f"rewriting these fields leaves the digest as it was: {unbound}"


def test_sampling_is_bound_as_the_parameters_in_effect():
    """A Step that repeats the session's parameters and one that leaves them out ("as before") are
    the same run to the tail, and digest alike; other parameters in effect change the digest."""
    carried = msgspec.structs.replace(BASE, sampling=SEEDED)
    assert digest_of(BASE, SEEDED, KEY) == digest_of(carried, SEEDED, KEY) != digest_of(carried, GREEDY, KEY)


def _with(step: Step, name: str, value) -> Step:
    return msgspec.structs.replace(step, **{name: value})


# ---- unit: the client's reconstruction of looped runs --------------------------------------------


def _verdict(step: Step, accepted: int, next_token: int, **fields) -> StepResult:
    """An honest tail's verdict on ``step`` (the digest of what it verified)."""
    digest = digest_of(step, SEEDED, KEY)
    return StepResult(
        session_id=step.session_id,
        run_id=step.run_id,
        accepted=accepted,
        next_token=next_token,
        step_digest=digest,
        **fields,
    )


def test_the_client_rebuilds_looped_runs_as_the_tail_builds_them():
    """A sent Step with loop_runs 2, log-probs and tail drafts asked; the tail loops two runs, the
    head swapping the second's drafts for the client's offered ones: each verdict's digest, of the
    Step the tail built (server/looped_runs.py) and verified, is the one the client expects, with
    loop_runs counting down and the asks carried. A looped run a hop rewrote is a route fault."""
    session = SimpleNamespace(session_id="s", max_length=64)
    runs = SentRuns(KEY)
    runs.sent(BASE, SEEDED)
    first = _verdict(BASE, 1, 9, drafts=[11, 12], looped=True)
    runs.judge(first, BASE.run_id, SEEDED)
    looped = following_run(session, BASE, first).step
    assert (looped.run_id, looped.start_pos, looped.token_ids, looped.loop_runs) == (4, 12, [9, 11, 12], 1)
    assert (looped.top_logprobs, looped.tail_drafts) == (BASE.top_logprobs, BASE.tail_drafts)
    second = _verdict(looped, 2, 13, drafts=[14], looped=True, run_drafts=[11, 12])
    runs.judge(second, looped.run_id, SEEDED)
    last = following_run(session, looped, second).step
    last.token_ids, last.n_draft = [13, 21, 22, 23], 3  # the head used the client's DraftOffer
    assert last.loop_runs == 0
    runs.judge(_verdict(last, 0, 5, run_drafts=[21, 22, 23], looped=False), last.run_id, SEEDED)

    runs = SentRuns(KEY)  # again, with the looped run's loop_runs rewritten on its way to the tail
    runs.sent(BASE, SEEDED)
    runs.judge(first, BASE.run_id, SEEDED)
    rewritten = msgspec.structs.replace(looped, loop_runs=0)
    with pytest.raises(RouteFault, match="a hop rewrote it"):
        runs.judge(_verdict(rewritten, 2, 13, run_drafts=[11, 12]), looped.run_id, SEEDED)


# ---- unit: what else is a route fault -------------------------------------------------------------


def test_runs_never_sent_skipped_or_outputs_unasked_or_missing_are_route_faults():
    runs = SentRuns(KEY)
    runs.sent(BASE, GREEDY)
    with pytest.raises(RouteFault, match="never sent nor expected"):  # renumbered past every run sent
        runs.judge(_verdict(_with(BASE, "run_id", 9), 0, 1), 9, GREEDY)
    runs.sent(_with(BASE, "run_id", 4), GREEDY)
    with pytest.raises(RouteFault, match="while run 3 was due"):  # run 3 dropped (or renumbered 3 -> 4)
        runs.judge(_verdict(_with(BASE, "run_id", 4), 0, 1), 3, GREEDY)

    runs = SentRuns(KEY)
    runs.sent(BASE, GREEDY)
    with pytest.raises(RouteFault, match="asked for none"):
        runs.outputs(BASE.run_id, 1)
    with pytest.raises(RouteFault, match="never sent nor expected"):
        runs.outputs(7, 1)
    forward = _with(_with(BASE, "return_logits", 2), "run_id", 5)
    runs.sent(forward, GREEDY)
    runs.outputs(forward.run_id, 1)  # one row of two, then the verdict
    verdict = _verdict(forward, 0, 1)
    verdict.step_digest = digest_of(forward, GREEDY, KEY)
    with pytest.raises(RouteFault, match="after 1 of the 2 rows"):
        runs.judge(verdict, forward.run_id, GREEDY)


# ---- live: a middle hop rewrites each newly bound field --------------------------------------------

NEW_TOKENS = 16
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 657, 506]
THROUGH_F = [("A", 0, 2), ("F", 2, 4), ("B", 4, 6)]
HONEST_ROUTE = [("C", 0, 1), ("D", 1, 4), ("E", 4, 6)]


@pytest.fixture(scope="module")
def rewriter(tiny_swarm, tiny_llama_path, tmp_path_factory):
    """F (2:4) on the shared tiny swarm, honest until the control file names a field, and a client of
    its own whose routes are pinned: through F first, then around it."""
    from swarm import AutoDistributedModelForCausalLM

    control = tmp_path_factory.mktemp("rewrites") / "field"
    control.write_text("")
    name = f"FR{time.monotonic_ns() % 10**9}"  # a fresh name: killed servers' records linger in the DHT
    process = tiny_swarm.start_server(2, 4, name=name, launcher=faulty("--rewrite-field-file", str(control)))
    # no verdict audits: a shadow reusing the route's other hops would meet F's rewrites as well
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=tiny_swarm.initial_peers, verdict_audit_every=0
    )
    try:
        deadline = time.monotonic() + 120
        while (info := servers_by_name(model, 6).get(name)) is None or info.state != "online":
            assert time.monotonic() < deadline and process.poll() is None, "F did not come online"
            time.sleep(0.5)
        peers = {n: i.peer_id for n, i in servers_by_name(model, 6).items()}
        peers["F"] = peers[name]
        through_f = [(name if n == "F" else n, a, b) for n, a, b in THROUGH_F]
        model.swarm.router = PreferredRoutes(through_f, HONEST_ROUTE)
        yield SimpleNamespace(model=model, control=control, peers=peers)
    finally:
        control.write_text("")
        model.shutdown()
        process.send_signal(signal.SIGTERM)  # it leaves the DHT cleanly: no later test routes through it
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        kill_group(process)


def _rewriting(rewriter, field: str) -> None:
    """F rewrites ``field`` from now on; the client forgets the previous case's suspects."""
    swarm = rewriter.model.swarm
    swarm.suspects, swarm.excluded = type(swarm.suspects)(base_seconds=60.0), type(swarm.excluded)()
    rewriter.control.write_text(field)


def _nobody_blamed_but_the_route(rewriter) -> None:
    swarm, peers = rewriter.model.swarm, rewriter.peers
    honest = {peers[n] for n in ("A", "B", "C", "D", "E")}
    assert not honest & swarm.excluded.current() and not honest & swarm.liars, "an honest server was blamed"
    assert {peers["A"], peers["F"], peers["B"]} <= swarm.suspects.current()  # every hop of the route


@pytest.mark.parametrize(
    "field, event",
    [
        ("loop_runs", "a hop rewrote it"),
        ("top_logprobs", "a hop rewrote it"),
        ("tail_drafts", "a hop rewrote it"),
        ("return_logits", "whose Step asked for none"),  # outputs unasked: caught before the verdict
    ],
)
def test_a_rewritten_live_lap_is_a_route_fault(rewriter, tiny_reference, field, event):
    with torch.no_grad():
        truth = tiny_reference.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    _rewriting(rewriter, field)
    model = rewriter.model
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0)
    stats = model.last_generation_stats
    assert out[0].tolist() == truth[0].tolist()
    assert stats.failovers == 1 and event in stats.failover_events[0], stats.failover_events
    assert [peer for peer, _, _ in stats.route] == [rewriter.peers[n] for n, _, _ in HONEST_ROUTE]
    assert not stats.liars_excluded
    _nobody_blamed_but_the_route(rewriter)


@pytest.mark.parametrize("field", ["return_logits", "return_hidden", "hidden_at"])
def test_a_rewritten_forward_pass_is_a_route_fault(rewriter, tiny_reference, field):
    """Logits zeroed, final states dropped, or the states asked at another block boundary: the tail
    answers the rewritten Step honestly, its verdict names it, and the pass fails over."""
    _rewriting(rewriter, field)
    model = rewriter.model
    sizes = dict(vocab_size=model.config.vocab_size, hidden_size=model.config.hidden_size)
    out = _loop.run(forward_row(model.swarm, PROMPT, 3, return_hidden=True, **sizes), timeout=120)
    with torch.no_grad():
        ref = tiny_reference(torch.tensor([PROMPT]), output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits[0, -3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1][0, -3:], rtol=1e-4, atol=1e-4)
    assert out.failovers == 1 and [p for p, _, _ in out.route] == [rewriter.peers[n] for n, _, _ in HONEST_ROUTE]
    _nobody_blamed_but_the_route(rewriter)


def test_a_step_verified_before_the_subscribe_is_read_is_digested_with_the_secret(limits_swarm, tiny_reference):
    """The client sends its Subscribe before it opens the session, but on another stream, and nothing
    orders two streams: under load the tail can verify the first Step before it reads the Subscribe.
    The verdict's digest is keyed with the secret all the same (server/session.py, ``Verdict``: sealed
    as it goes out), where a digest keyed at compute time had no secret yet and the client took it for
    a rewritten Step: a route fault, a failover and every hop suspected (seen once under CI load).
    Here the Subscribe comes only after the tail has queued the verdict."""
    import asyncio

    from protocol.messages import SessionOpened
    from tests.kit.raw_sessions import RawSession
    from tests.kit.waiting import until

    model, servers, _ = limits_swarm
    queues = servers[1].handler.open_sessions.results
    ids = PROMPT[:8]

    async def verified_before_subscribed():
        session = RawSession(model.swarm.p2p, servers, subscribe=False)
        try:
            assert isinstance(await session.open(), SessionOpened)
            step = Step(session_id=session.session_id, run_id=0, start_pos=0, token_ids=ids)
            await session.head.send(step)
            # until the tail has queued the verdict for nobody yet
            await until(lambda: session.session_id in queues and queues[session.session_id].qsize(), 30)
            await session.subscribe_now()
            return step, session.secret, (await asyncio.wait_for(session.tail.receive(), 30)).message
        finally:
            session.close()

    step, secret, verdict = _loop.run(verified_before_subscribed(), timeout=60)
    assert isinstance(verdict, StepResult), verdict
    assert verdict.step_digest == digest_of(step, GREEDY, secret)  # what the client computes for its Step
    with torch.no_grad():
        assert verdict.next_token == int(tiny_reference(torch.tensor([ids])).logits[0, -1].argmax())
