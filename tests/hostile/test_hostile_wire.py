"""Hostile peers on the wire (issue 15): forged verdicts, stolen subscriptions, oversized frames and
Steps, and peers that hold too many sessions or queue too much. Runs on ``limits_swarm``: two
in-process servers of the tiny model (blocks 0:3, 3:6) with at most 16 positions per Step, which
the tests patch into hostile peers. Every generation is checked token for token against local
transformers."""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import contextmanager

import hivemind
import pytest
import torch
from hivemind.p2p import P2P, PeerID

from client import _loop
from client._remote_session import RemoteSession
from client.errors import GenerationError, SwarmError
from protocol import limits
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, Hop, OpenSession, RunOutputs, SessionOpened, StepResult, Subscribe
from protocol.streams import RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream
from tests.kit.faults import slow_blocks
from tests.kit.raw_sessions import RawSession
from tests.kit.reference import LONG_PROMPT, PROMPT, greedy_reference
from tests.kit.swarms import LIMITS_MAX_POSITIONS, wait_until_no_sessions


@contextmanager
def patched(obj, name, make):
    """Replace ``obj.name`` with ``make(original)`` for the block."""
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def recording_steps(handler, sizes: list):
    """Wrap a handler's _enqueue to record the positions of every Step it receives."""

    def make(original):
        def enqueue(session, step, tensors):
            sizes.append(len(step.token_ids))
            return original(session, step, tensors)

        return enqueue

    return patched(handler, "_enqueue", make)


# ---- verdicts and subscriptions ------------------------------------------------------------------


def test_forged_verdicts_from_route_servers_change_nothing(limits_swarm, tiny_reference, monkeypatch):
    """The head sends the client a forged StepResult (and RunOutputs) before each run, the tail
    sends one up to the head: the client ignores the first (only the tail's results stream carries
    verdicts), the head drops the second; the output is token-identical."""
    model, servers, _ = limits_swarm
    head, tail = servers[0].handler, servers[1].handler
    ignored = []
    original = RemoteSession._may_come_from

    def may_come_from(self, message, which):
        allowed = original(self, message, which)
        if not allowed:
            ignored.append((type(message).__name__, which))
        return allowed

    monkeypatch.setattr(RemoteSession, "_may_come_from", may_come_from)

    def forging(original):
        def enqueue(session, step, tensors):
            forged = StepResult(session_id=session.session_id, run_id=step.run_id, accepted=step.n_draft, next_token=7)
            outputs = RunOutputs(session_id=session.session_id, run_id=step.run_id, offset=0)
            asyncio.get_running_loop().create_task(session.upstream.send(forged))
            asyncio.get_running_loop().create_task(session.upstream.send(outputs))
            return original(session, step, tensors)

        return enqueue

    dropped_before = head.stats["dropped_upstream"]
    expected = greedy_reference(tiny_reference, PROMPT, 10)
    with patched(head, "_enqueue", forging), patched(tail, "_enqueue", forging):
        for speculation in (None, "suffix"):
            assert model.generate(torch.tensor(PROMPT), max_new_tokens=10, speculation=speculation).tolist() == expected
    assert ("StepResult", "head") in ignored and ("RunOutputs", "head") in ignored
    assert head.stats["dropped_upstream"] - dropped_before >= 2 * 2  # the tail's forgeries never left the head
    wait_until_no_sessions(servers)


def test_subscribe_needs_the_session_secret(limits_swarm, tiny_reference, tiny_llama_path):
    """A second peer that knows the session id cannot read the session's results at the tail; the
    honest session goes on unaffected."""
    model, servers, _ = limits_swarm
    tail = servers[1]
    expected = greedy_reference(tiny_reference, PROMPT, 12)
    # the attacker: another peer (its own identity), connected straight to the tail
    attacker_dht = hivemind.DHT(
        initial_peers=[str(m) for m in tail.dht.get_visible_maddrs()], client_mode=True, start=True
    )
    try:
        with model.inference_session(max_length=64) as state:
            first = model.generate(torch.tensor(PROMPT), max_new_tokens=6, speculation=None)
            assert first.tolist()[0] == expected[0][: len(PROMPT[0]) + 6]
            session_id = state.remote.session_id

            async def steal(secret: str):
                p2p = await attacker_dht.replicate_p2p()
                stream = await MessageStream.open(p2p, PeerID.from_base58(tail.info.peer_id), RESULTS_PROTOCOL)
                try:
                    await stream.send(Subscribe(session_id=session_id, secret=secret))
                    reply = await asyncio.wait_for(stream.receive(), 30)
                    after = await asyncio.wait_for(stream.receive(), 30)  # then the tail closes the stream
                    return reply.message, after
                finally:
                    stream.close()
                    await p2p.shutdown()

            for secret in ("", "guess", hashlib.sha256(b"guess").hexdigest()):
                reply, after = _loop.run(steal(secret), timeout=60)
                assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNAUTHORIZED, reply
                assert "secret" in reply.message and after is None
            assert tail.handler.sessions[session_id].subscribed  # still the honest client's
            second = model.generate(first, max_new_tokens=6, speculation=None)
            assert second.tolist() == expected
    finally:
        attacker_dht.shutdown()
    wait_until_no_sessions(servers)


def test_middle_of_a_chain_must_be_opened_by_the_previous_hop(limits_swarm):
    """No peer can open a session at hop 1 unless it is hop 0 of the route (libp2p authenticates
    the peer id), so nobody enters a chain in the middle or dodges the per-client cap."""
    model, servers, _ = limits_swarm

    async def go():
        route = [Hop(s.info.peer_id, s.info.start_block, s.info.end_block) for s in servers]
        stream = await MessageStream.open(model.swarm.p2p, PeerID.from_base58(route[1].peer_id), SESSION_PROTOCOL)
        try:
            await stream.send(
                OpenSession(session_id="middle", max_length=16, route=route, hop_index=1, secret_hash="0" * 64)
            )
            return (await asyncio.wait_for(stream.receive(), 30)).message
        finally:
            stream.close()

    reply = _loop.run(go(), timeout=60)
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNAUTHORIZED and "previous hop" in reply.message


# ---- frame and step sizes ------------------------------------------------------------------------


def test_long_prompt_goes_as_chunked_prefill_and_is_token_identical(limits_swarm, tiny_reference):
    model, servers, _ = limits_swarm
    sizes: list[int] = []
    with recording_steps(servers[0].handler, sizes):
        output = model.generate(torch.tensor(LONG_PROMPT), max_new_tokens=8, speculation=None)
    assert output.tolist() == greedy_reference(tiny_reference, LONG_PROMPT, 8)
    assert max(sizes) <= LIMITS_MAX_POSITIONS and sizes[:3] == [16, 16, 12], sizes
    # forward passes are chunked the same way: logits of all 44 positions, as local transformers
    logits = model(torch.tensor(LONG_PROMPT)).logits
    with torch.no_grad():
        local = tiny_reference(torch.tensor(LONG_PROMPT)).logits
    torch.testing.assert_close(logits, local, rtol=1e-4, atol=1e-4)
    wait_until_no_sessions(servers)


def test_failover_replays_a_long_history_in_chunks(limits_swarm, tiny_reference):
    """The head drops the session mid-generation: the client replays the 47 committed positions
    on a new session as chunks of at most 16, and the output is token-identical."""
    model, servers, _ = limits_swarm
    sizes: list[int] = []
    dropped = []

    def dropping(original):
        def enqueue(session, step, tensors):
            sizes.append(len(step.token_ids))
            if step.start_pos >= len(LONG_PROMPT[0]) + 3 and not dropped:
                dropped.append(step.run_id)
                session.upstream.close()  # as if the head died: the client's head stream ends
            return original(session, step, tensors)

        return enqueue

    with patched(servers[0].handler, "_enqueue", dropping):
        output = model.generate(torch.tensor(LONG_PROMPT), max_new_tokens=8, speculation=None)
    assert output.tolist() == greedy_reference(tiny_reference, LONG_PROMPT, 8)
    assert dropped and model.last_generation_stats.failovers == 1
    assert max(sizes) <= LIMITS_MAX_POSITIONS and sizes.count(16) >= 4, sizes  # two prompts' worth of chunks
    wait_until_no_sessions(servers)


def test_step_above_the_servers_limit_is_refused_clearly_without_failover(limits_swarm, tiny_reference, monkeypatch):
    """A client honours the smallest limit its route announces (records carry
    max_positions_per_step): one that would send 64 positions chunks to the servers' 16 and gets the
    exact output. A client that ignores the announcement gets a clear, final step_too_large."""
    model, servers, _ = limits_swarm
    model.swarm.max_positions_per_step = 64  # this client would send the 44-position prompt as one Step
    try:
        assert model.generate(
            torch.tensor(LONG_PROMPT), max_new_tokens=4, speculation=None
        ).tolist() == greedy_reference(tiny_reference, LONG_PROMPT, 4)
        monkeypatch.setattr(model.swarm, "route_step_limit", lambda route: 64)  # ignores what the route announces
        with pytest.raises(GenerationError, match="step_too_large.*max_positions_per_step 16") as error:
            model.generate(torch.tensor(LONG_PROMPT), max_new_tokens=4, speculation=None)
        assert error.value.__cause__.code == ErrorCode.STEP_TOO_LARGE
        assert model.last_generation_stats.failovers == 0  # not mistaken for a dead hop
    finally:
        model.swarm.max_positions_per_step = LIMITS_MAX_POSITIONS
        monkeypatch.undo()
    assert model.generate(torch.tensor(LONG_PROMPT), max_new_tokens=4, speculation=None).tolist() == greedy_reference(
        tiny_reference, LONG_PROMPT, 4
    )
    wait_until_no_sessions(servers)


def test_frame_above_the_limit_is_refused_before_it_is_read(limits_swarm, tiny_reference):
    """A frame header declaring more bytes than the protocol's limit gets ``frame_too_large`` at
    once (nothing of the body was sent, so the server cannot have waited to read it), the stream
    is closed, and the server keeps serving."""
    model, servers, _ = limits_swarm
    head = servers[0].handler
    hidden = head.span.hidden_shape
    assert head.max_frame_bytes == limits.session_frame_bytes(hidden, LIMITS_MAX_POSITIONS)
    assert head.max_frame_bytes == 4 * 16 * hidden[0] + 10 * 16 + limits.FRAME_MARGIN_BYTES

    async def declare(protocol: str, length: int):
        stream = await MessageStream.open(model.swarm.p2p, PeerID.from_base58(head.peer_id), protocol)
        try:
            stream.writer.write(P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            await stream.writer.drain()
            reply = await asyncio.wait_for(stream.receive(), 30)
            return reply.message if reply else None, await asyncio.wait_for(stream.receive(), 30)
        finally:
            stream.close()

    for protocol, length in [
        (SESSION_PROTOCOL, head.max_frame_bytes + 1),
        (SESSION_PROTOCOL, 2**63),
        (RESULTS_PROTOCOL, limits.CONTROL_FRAME_BYTES + 1),
    ]:
        reply, after = _loop.run(declare(protocol, length), timeout=60)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.FRAME_TOO_LARGE, reply
        assert str(length) in reply.message
        assert after is None  # framing is lost: the server closed the stream
    assert model.generate(torch.tensor(PROMPT), max_new_tokens=4, speculation=None).tolist() == greedy_reference(
        tiny_reference, PROMPT, 4
    )


# ---- limits --------------------------------------------------------------------------------------


def test_sessions_per_peer_and_per_server_are_capped(limits_swarm, tiny_reference):
    model, servers, _ = limits_swarm
    head = servers[0].handler

    async def open_sessions(count: int):
        sessions = [RawSession(model.swarm.p2p, servers) for _ in range(count)]
        replies = [await s.open() for s in sessions]
        return sessions, replies

    saved = head.max_sessions_per_peer
    head.max_sessions_per_peer = 2
    try:
        sessions, replies = _loop.run(open_sessions(3), timeout=60)
        assert [type(r).__name__ for r in replies] == ["SessionOpened", "SessionOpened", "ErrorReply"]
        assert replies[2].code == ErrorCode.BUSY and "already has 2 sessions open" in replies[2].message
        for s in sessions:
            s.close()
    finally:
        head.max_sessions_per_peer = saved
    wait_until_no_sessions(servers)

    # a full server: the client routes around it (here there is no other head: it says so)
    saved = head.max_sessions, model.swarm.route_retry_delay, model.swarm.max_route_attempts
    head.max_sessions, model.swarm.route_retry_delay, model.swarm.max_route_attempts = 0, 0.01, 2
    try:
        with pytest.raises(SwarmError, match="busy.*sessions open, its limit"):
            model.generate(torch.tensor(PROMPT), max_new_tokens=2, speculation=None)
    finally:
        head.max_sessions, model.swarm.route_retry_delay, model.swarm.max_route_attempts = saved
    # full is not broken: a busy server is skipped by that session only, never by the client's
    # other sessions, so the next generation uses it at once
    assert head.peer_id not in model.swarm.excluded.current()
    assert model.generate(torch.tensor(PROMPT), max_new_tokens=4, speculation=None).tolist() == greedy_reference(
        tiny_reference, PROMPT, 4
    )
    wait_until_no_sessions(servers)


FLOOD_CODES = (ErrorCode.QUEUE_FULL, ErrorCode.START_POS_BEYOND_CACHE)


def test_a_client_that_floods_runs_gets_queue_full(limits_swarm, monkeypatch):
    model, servers, _ = limits_swarm
    monkeypatch.setattr(limits, "MAX_QUEUED_RUNS", 4)

    async def flood():
        s = RawSession(model.swarm.p2p, servers)
        assert isinstance(await s.open(), SessionOpened)
        slow = slow_blocks(servers[0].span, 0.5)  # slow compute: runs pile up in the head's queue
        try:
            for run_id in range(12):
                await s.step(run_id, run_id, [5])
            errors = []
            while len(errors) < 12 - 4 - 1:  # at most 4 queued plus 1 computing get through
                reply = (await asyncio.wait_for(s.head.receive(), 30)).message
                errors.append(reply)
                if not (isinstance(reply, ErrorReply) and reply.code in FLOOD_CODES):
                    break
            return errors
        finally:
            slow.seconds = 0.0
            s.close()

    errors = _loop.run(flood(), timeout=60)
    # if a slow machine lets a queued run finish mid-flood, a later run is taken and refused for
    # starting past positions that refused runs never made: a clear error too, never a crash
    assert all(isinstance(e, ErrorReply) and e.code in FLOOD_CODES for e in errors), errors
    assert errors[0].code == ErrorCode.QUEUE_FULL
    assert "runs already queued (at most 4)" in errors[0].message
    wait_until_no_sessions(servers)


def test_results_nobody_reads_close_the_session(limits_swarm, monkeypatch):
    """A client that opens a session and never subscribes: after MAX_UNREAD_RESULTS results the
    tail closes the session and says why, instead of holding results without bound."""
    model, servers, _ = limits_swarm
    monkeypatch.setattr(limits, "MAX_UNREAD_RESULTS", 3)

    async def flood():
        s = RawSession(model.swarm.p2p, servers, subscribe=False)
        assert isinstance(await s.open(), SessionOpened)
        try:
            for run_id in range(6):
                await s.step(run_id, run_id, [5])
            return (await asyncio.wait_for(s.head.receive(), 30)).message
        finally:
            s.close()

    reply = _loop.run(flood(), timeout=60)
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.QUEUE_FULL and "results unread" in reply.message
    wait_until_no_sessions(servers)


def test_gateway_caps_a_request_without_max_tokens():
    from swarm.api.schemas import ChatMessage, ChatRequest, chat_params

    class Served:
        context_length, default_max_tokens = 32768, 1024

        class tokenizer:  # the choice's text of a chat prompt given as ids (only the max_tokens matter here)
            @staticmethod
            def decode(ids, skip_special_tokens=True):
                return "hi"

        def chat_prompt(self, messages, add_generation_prompt=True, tools=None):
            return [1, 2, 3]

    request = ChatRequest(model="m", messages=[ChatMessage(role="user", content="hi")])
    params, _ = chat_params(request, Served(), 32)
    assert params[0].max_tokens == 1024  # not 32765: every hop reserves cache for prompt + max_tokens
    Served.context_length = 100
    assert chat_params(request, Served(), 32)[0][0].max_tokens == 97  # the rest of a short context
