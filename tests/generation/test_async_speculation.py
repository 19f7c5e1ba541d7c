"""Asynchronous speculation: runs overlap, refuted ones are cancelled hop by hop, and the output
never changes. The servers run in this process (real hivemind DHT and libp2p, real model), so the
tests can look inside them: after a cancel no server holds queued work or cache positions of the
cancelled runs."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets

import pytest
import torch
from hivemind.p2p import PeerID

from client import _loop
from protocol.messages import Cancel, Hop, OpenSession, SessionOpened, Step, StepResult, Subscribe
from protocol.streams import RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream
from tests.kit.drafters import ScriptedDrafter
from tests.kit.faults import slow_blocks
from tests.kit.reference import PROMPT
from tests.kit.swarms import inprocess_servers

SLOW_BLOCK_SECONDS = 0.02  # a slow server, so cancels catch runs queued and mid-computation


@pytest.fixture(scope="module")
def inproc_swarm(tiny_llama_path):
    for model, servers in inprocess_servers(tiny_llama_path):
        for server in servers:
            slow_blocks(server.span, SLOW_BLOCK_SECONDS)
        yield model, servers


@contextlib.contextmanager
def full_speed(servers):
    """The servers' blocks without the test delay for what needs no run caught mid-flight: the
    plain baselines (one run per token, nothing to cancel) and the hedges (prepared by the client
    while it waits, whatever the servers' speed). Saves 0.12 s per lap."""
    for server in servers:
        slow_blocks(server.span, 0.0)
    try:
        yield
    finally:
        for server in servers:
            slow_blocks(server.span, SLOW_BLOCK_SECONDS)


@pytest.fixture
def full_speed_swarm(inproc_swarm):
    """The module's swarm with its blocks at full speed for one test."""
    with full_speed(inproc_swarm[1]):
        yield inproc_swarm


def plain_generation(model, servers, **kwargs):
    """The baseline without speculation, at full speed."""
    with full_speed(servers):
        return model.generate(torch.tensor(PROMPT), max_new_tokens=18, speculation=None, **kwargs)


def assert_servers_hold_only(servers, committed_cached: int) -> None:
    """Every open session on every server: nothing queued, nothing running, and no positions
    beyond what the client has committed to the cache."""

    async def check():
        await asyncio.sleep(0.5)  # let trailing cancels and trims reach every hop
        lengths = []
        for server in servers:
            for session in server.handler.sessions.values():
                assert session.queue.empty() and session.running is None
                lengths.append(server.span.cache_length(session.cache))
        return lengths

    lengths = _loop.run(check(), timeout=30)
    assert lengths and all(length <= committed_cached for length in lengths), (lengths, committed_cached)


def generate_with(model, monkeypatch, truth, wrong_at, inflight=3, **kwargs):
    drafter = ScriptedDrafter(truth, len(PROMPT[0]), wrong_at, length=3)
    monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
    return model.generate(
        torch.tensor(PROMPT),
        max_new_tokens=18,
        num_draft_tokens=2,
        async_speculation=True,
        max_inflight_runs=inflight,
        **kwargs,
    )


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", ["every guess right", "every guess wrong", "mixed"])
def test_async_output_equals_no_speculation(inproc_swarm, monkeypatch, case, sampling):
    model, servers = inproc_swarm
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=3) if sampling else {}
    plain = plain_generation(model, servers, **kwargs)
    truth = plain[0, len(PROMPT[0]) :].tolist()
    wrong_at = {"every guess right": set(), "every guess wrong": set(range(40)), "mixed": {2, 9, 10, 15}}[case]
    with model.inference_session(max_length=64) as session:
        output = generate_with(model, monkeypatch, truth, wrong_at, **kwargs)
        assert output.tolist() == plain.tolist()
        assert_servers_hold_only(servers, session.cached)
    stats = model.last_generation_stats
    if case == "every guess right":
        assert stats.runs_cancelled == 0 and stats.laps < 18 / 2
    elif case == "every guess wrong":
        assert stats.accepted == 0 and stats.runs_cancelled > 0 and stats.laps == 18
    else:
        assert stats.runs_cancelled > 0 and stats.accepted > 0


def test_cancels_reach_runs_queued_running_and_computed(inproc_swarm, monkeypatch):
    model, servers = inproc_swarm
    plain = plain_generation(model, servers)
    before = [dict(server.handler.stats) for server in servers]
    truth = plain[0, len(PROMPT[0]) :].tolist()
    for wrong_at in ({5, 13}, {1, 4, 7, 8, 12, 16}, {9}):  # deep windows: later runs wait in queues
        assert generate_with(model, monkeypatch, truth, wrong_at, inflight=5).tolist() == plain.tolist()
    delta = {key: sum(s.handler.stats[key] - b[key] for s, b in zip(servers, before)) for key in before[0]}
    assert delta["cancelled_queued"] > 0, delta
    assert delta["cancelled_running"] > 0, delta
    assert delta["cancelled_computed"] > 0, delta


class RawSession:
    def __init__(self, model, servers):
        self.p2p = model.swarm.p2p
        self.route = [Hop(s.info.peer_id, s.info.start_block, s.info.end_block) for s in servers]
        self.session_id = secrets.token_hex(8)

    async def open(self):
        self.tail = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[-1].peer_id), RESULTS_PROTOCOL)
        await self.tail.send(Subscribe(session_id=self.session_id, secret="s"))
        self.head = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[0].peer_id), SESSION_PROTOCOL)
        await self.head.send(
            OpenSession(
                session_id=self.session_id,
                max_length=64,
                route=self.route,
                hop_index=0,
                secret_hash=hashlib.sha256(b"s").hexdigest(),
            )
        )
        assert isinstance((await self.head.receive()).message, SessionOpened)

    async def result(self):
        return (await asyncio.wait_for(self.tail.receive(), 30)).message


def test_cancel_of_unknown_or_finished_run_is_harmless(inproc_swarm):
    model, servers = inproc_swarm

    async def scenario():
        s = RawSession(model, servers)
        await s.open()
        await s.head.send(Step(session_id=s.session_id, run_id=1, start_pos=0, token_ids=PROMPT[0]))
        first = await s.result()
        assert isinstance(first, StepResult)
        await s.head.send(Cancel(session_id=s.session_id, run_id=50))  # never sent: nothing happens
        await s.head.send(
            Step(session_id=s.session_id, run_id=2, start_pos=len(PROMPT[0]), token_ids=[first.next_token])
        )
        second = await s.result()
        assert isinstance(second, StepResult) and second.run_id == 2
        # cancelling a finished run rolls its positions back; a run that restarts there works
        await s.head.send(Cancel(session_id=s.session_id, run_id=2))
        await s.head.send(
            Step(session_id=s.session_id, run_id=3, start_pos=len(PROMPT[0]), token_ids=[first.next_token])
        )
        third = await s.result()
        assert isinstance(third, StepResult) and third.next_token == second.next_token
        s.head.close()
        s.tail.close()

    _loop.run(scenario(), timeout=60)


def test_client_vanishing_with_runs_in_flight_frees_every_server(inproc_swarm):
    model, servers = inproc_swarm

    async def scenario():
        s = RawSession(model, servers)
        await s.open()
        for run_id in range(1, 4):  # three runs in flight, then the client is gone
            await s.head.send(
                Step(session_id=s.session_id, run_id=run_id, start_pos=(run_id - 1) * 11, token_ids=PROMPT[0])
            )
        s.head.close()
        s.tail.close()
        for _ in range(100):
            if all(s.session_id not in server.handler.sessions for server in servers):
                return True
            await asyncio.sleep(0.1)
        return False

    assert _loop.run(scenario(), timeout=60)
    for server in servers:
        assert (
            server.handler.budget.free_tokens == server.handler.budget.total_tokens or len(server.handler.sessions) > 0
        )


def test_agenerate_stream_honours_async_speculation(inproc_swarm, monkeypatch):
    model, servers = inproc_swarm
    plain = plain_generation(model, servers)
    truth = plain[0, len(PROMPT[0]) :].tolist()
    monkeypatch.setattr(
        "client._drafter_choice.make_drafter", lambda *a, **k: ScriptedDrafter(truth, len(PROMPT[0]), {5, 13}, length=3)
    )

    async def collect():
        chunks = [
            c
            async for c in model.agenerate_stream(
                PROMPT[0], max_new_tokens=18, num_draft_tokens=2, async_speculation=True, max_inflight_runs=3
            )
        ]
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    tokens, stats = asyncio.run(collect())
    assert tokens == truth
    assert stats.runs_cancelled > 0  # only runs sent ahead of a verdict can be cancelled


class HedgingScriptedDrafter(ScriptedDrafter):
    """Knows the true continuation's next token, so it can name every refuting verdict."""

    def alternatives(self, k, after=()):
        start = self.position + len(after)
        return self.truth[start : start + 1][:k]


@pytest.mark.parametrize("inflight", [1, 3], ids=["sync", "async"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_outcome_hedges_are_used_and_never_change_the_output(full_speed_swarm, monkeypatch, inflight, sampling):
    model, servers = full_speed_swarm
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=5) if sampling else {}
    plain = model.generate(torch.tensor(PROMPT), max_new_tokens=18, speculation=None, **kwargs)
    truth = plain[0, len(PROMPT[0]) :].tolist()
    for cls, wrong_at in (
        (HedgingScriptedDrafter, set(range(40))),
        (HedgingScriptedDrafter, {2, 9, 10, 15}),
        (ScriptedDrafter, set(range(40))),
    ):
        drafter = cls(truth, len(PROMPT[0]), wrong_at, length=3)
        monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
        # runs sent by the client (with looped runs the hedges become offers: tests/generation/test_looped_runs.py)
        output = model.generate(
            torch.tensor(PROMPT),
            max_new_tokens=18,
            num_draft_tokens=2,
            async_speculation=inflight > 1,
            max_inflight_runs=inflight,
            loop_runs=False,
            **kwargs,
        )
        assert output.tolist() == plain.tolist()
        stats = model.last_generation_stats
        if cls is ScriptedDrafter:  # no alternatives known: nothing to hedge
            assert stats.hedges_prepared == 0 and stats.hedge_hits == 0
        elif wrong_at == set(range(40)):  # every verdict refutes and its correction was hedged
            assert stats.hedge_hits >= stats.laps - 2 > 0, stats
        else:  # a hedge serves the front run that follows a verdict, never the first
            assert 0 < stats.hedge_hits <= stats.laps - 1, stats
        assert stats.turnaround_time > 0 and stats.hedge_time > 0
