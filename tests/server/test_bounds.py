"""No peer can exhaust a server (issue 24, "Bounds"): unread result bytes per session and per server,
a per-session token cap and a per-client share of the cache, time limits for streams that hold
nothing, and server pairs that are not capped as one client. Runs on ``limits_swarm`` (two
in-process servers of the tiny model, blocks 0:3 and 3:6), with strangers that have identities of
their own; every honest generation is checked token for token against local transformers."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID

from client import _loop
from protocol import limits
from protocol.dht_records import fetch_servers
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, Hop, OpenSession, SessionOpened, Subscribe
from protocol.route_errors import NoRouteError
from protocol.routing import MaxFlowRouter
from protocol.streams import RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream
from tests.kit.raw_sessions import RawSession
from tests.kit.reference import PROMPT, greedy_reference
from tests.kit.swarms import wait_until_no_sessions
from tests.kit.waiting import until

FORWARD_POSITIONS = 16  # positions (and logits rows) of each forward pass the non-reader asks for


@pytest.fixture(scope="module")
def strangers(limits_swarm):
    """Two peers with identities of their own (so the honest client's per-peer caps are not theirs)."""
    _, servers, _ = limits_swarm
    maddrs = [str(m) for m in servers[0].dht.get_visible_maddrs()]
    dhts = [hivemind.DHT(initial_peers=maddrs, client_mode=True, start=True) for _ in range(2)]
    p2ps = [_loop.run(dht.replicate_p2p(), timeout=60) for dht in dhts]
    yield p2ps
    for p2p, dht in zip(p2ps, dhts):
        _loop.run(p2p.shutdown(), timeout=30)
        dht.shutdown()


@contextmanager
def attributes(obj, **values):
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


async def forward_passes(session: RawSession, runs: int) -> None:
    """Steps that each ask for the full logits of FORWARD_POSITIONS positions (a RunOutputs of
    FORWARD_POSITIONS x vocab float32 at the tail)."""
    for run in range(runs):
        await session.forward_pass(run, FORWARD_POSITIONS)


def outputs_bytes(tail) -> int:
    """What one forward pass's RunOutputs holds at the tail."""
    return FORWARD_POSITIONS * tail.span.vocab_size * 4


def test_a_hog_and_a_non_reader_leave_the_server_within_budget_and_an_honest_client_served(
    limits_swarm, strangers, tiny_reference
):
    """The figure of issue 24: one stranger opens sessions with the largest max_length, another
    asks for large forward passes and never reads them. The stranger's cache stays within its
    share, the unread bytes within the session's share, and the honest client's greedy output
    equals local transformers meanwhile; the non-reader then loses its session, told why."""
    model, servers, _ = limits_swarm
    head, tail = servers[0].handler, servers[1].handler
    total = head.budget.total_tokens
    assert head.max_session_tokens == limits.default_max_session_tokens(total) and head.max_peer_tokens == total // 2
    # the cap is announced, and the client's router skips servers whose cap is below a session's length
    records = fetch_servers(model.swarm.dht, model.swarm.model, 6)
    assert {r.peer_id: r.max_session_tokens for r in records} == {
        s.info.peer_id: s.handler.max_session_tokens for s in servers
    }
    try:
        MaxFlowRouter().plan(records, 0, 6, max_length=head.max_session_tokens + 1)
        raise AssertionError("a route past the announced per-session cap")
    except NoRouteError as e:
        assert f"capped at sessions of {head.max_session_tokens} tokens" in str(e)
    message = outputs_bytes(tail)
    cap = int(2.5 * message)
    expected = greedy_reference(tiny_reference, PROMPT, 8)

    async def hog(p2p):
        """Sessions with the largest max_length, until the server refuses."""
        sessions, replies = [], []
        for max_length in [head.max_session_tokens + 1] + [head.max_session_tokens] * 3:
            sessions.append(RawSession(p2p, servers))
            replies.append(await sessions[-1].open(max_length=max_length))
        return sessions, replies

    async def non_reader(p2p):
        session = RawSession(p2p, servers, subscribe=False)
        assert isinstance(await session.open(max_length=128), SessionOpened)
        await forward_passes(session, 4)
        await until(
            lambda: (
                session.session_id in tail.open_sessions.results
                and tail.open_sessions.results[session.session_id].bytes >= 2 * message
            )
        )
        return session

    hog_p2p, reader_p2p = strangers
    with attributes(tail.results, max_session_bytes=cap, wait=4.0):
        tail.unread.peak = tail.unread.total
        hogs, replies = _loop.run(hog(hog_p2p), timeout=60)
        wasteful = _loop.run(non_reader(reader_p2p), timeout=60)
        try:
            waiting = tail.open_sessions.results[wasteful.session_id]
            assert 2 * message <= waiting.bytes <= cap  # the non-reader's third pass waits, not queued
            assert [type(r).__name__ for r in replies] == ["ErrorReply", "SessionOpened", "SessionOpened", "ErrorReply"]
            assert (
                replies[0].code == ErrorCode.BUSY
                and f"max_session_tokens is {head.max_session_tokens}" in replies[0].message
            )
            assert replies[3].code == ErrorCode.BUSY and f"share of {total // 2} of {total}" in replies[3].message
            sessions, tokens = head.budget.held_by(hog_p2p.peer_id.to_base58())
            assert sessions == 2 and tokens <= total // 2
            # the honest client is served exactly while both strangers hold what they may
            output = model.generate(torch.tensor(PROMPT), max_new_tokens=8, speculation=None)
            assert output.tolist() == expected
            reply = _loop.run(asyncio.wait_for(wasteful.head.receive(), 30), timeout=40).message
            assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.QUEUE_FULL
            assert "bytes of results unread" in reply.message and f"may hold {cap} bytes" in reply.message
            assert tail.unread.peak <= cap + 64 * 1024  # never more than the session's share (+ verdicts)
        finally:
            for session in hogs + [wasteful]:
                session.close()
    wait_until_no_sessions(servers)
    assert tail.unread.total == 0


def test_unread_bytes_over_the_servers_budget_close_the_largest_holder(limits_swarm, strangers):
    """Many sessions cannot add up: past the server's unread budget, the session holding the most
    unread bytes is closed (queue_full, naming the budget) and the others keep theirs."""
    model, servers, _ = limits_swarm
    tail = servers[1].handler
    message = outputs_bytes(tail)
    budget = int(3.5 * message)

    async def flood(p2p):
        first, second = RawSession(p2p, servers, subscribe=False), RawSession(p2p, servers, subscribe=False)
        try:
            assert isinstance(await first.open(max_length=128), SessionOpened)
            await forward_passes(first, 3)  # two queued, the third waits for room
            await until(
                lambda: (
                    first.session_id in tail.open_sessions.results
                    and tail.open_sessions.results[first.session_id].bytes >= 2 * message
                )
            )
            assert isinstance(await second.open(max_length=128), SessionOpened)
            await forward_passes(second, 2)
            reply = (await asyncio.wait_for(first.head.receive(), 30)).message
            await until(
                lambda: (
                    second.session_id in tail.open_sessions.results
                    and tail.open_sessions.results[second.session_id].bytes >= 2 * message
                )
            )
            return reply, second.session_id in tail.sessions
        finally:
            first.close()
            second.close()

    with (
        attributes(tail.results, max_session_bytes=int(2.5 * message), wait=30.0),
        attributes(tail.unread, max_bytes=budget, peak=tail.unread.total),
    ):
        reply, second_open = _loop.run(flood(strangers[0]), timeout=90)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.QUEUE_FULL, reply
        assert f"more than {budget} bytes of unread results" in reply.message
        assert second_open
        assert tail.unread.peak <= budget
    wait_until_no_sessions(servers)
    assert tail.unread.total == 0


def test_server_pairs_are_not_capped_as_one_client_but_a_pretender_is(limits_swarm, strangers):
    """The tail takes many sessions from the head (an announced server of blocks 0:3: it carries
    many clients), while a peer that names itself the route's previous hop without being an
    announced server is capped like any client."""
    model, servers, _ = limits_swarm
    head, tail = servers[0].handler, servers[1].handler
    assert head.peer_id in tail.known_servers

    async def through_the_head(p2p, count: int):
        sessions = [RawSession(p2p, servers) for _ in range(count)]
        return sessions, [await s.open() for s in sessions]

    async def pretend(p2p, count: int):
        me = p2p.peer_id.to_base58()
        route = [Hop(me, 0, 3), Hop(tail.peer_id, 3, 6)]
        streams, replies = [], []
        for n in range(count):
            stream = await MessageStream.open(p2p, PeerID.from_base58(tail.peer_id), SESSION_PROTOCOL)
            streams.append(stream)
            await stream.send(
                OpenSession(session_id=f"pretender-{n}", max_length=64, route=route, hop_index=1, secret_hash="0" * 64)
            )
            replies.append((await asyncio.wait_for(stream.receive(), 30)).message)
        return streams, replies

    a, b = strangers
    with attributes(tail, max_sessions_per_peer=1):
        sessions, replies = _loop.run(through_the_head(a, 2), timeout=60)
        more, more_replies = _loop.run(through_the_head(b, 1), timeout=60)
        try:
            assert all(isinstance(r, SessionOpened) for r in replies + more_replies), replies + more_replies
            assert len(tail.sessions) == 3  # three clients' sessions from one upstream server
        finally:
            for s in sessions + more:
                s.close()
        streams, replies = _loop.run(pretend(a, 2), timeout=60)
        try:
            assert isinstance(replies[0], SessionOpened), replies[0]
            assert isinstance(replies[1], ErrorReply) and replies[1].code == ErrorCode.BUSY
            assert "already has 1 sessions open" in replies[1].message
        finally:
            for stream in streams:
                stream.close()
    wait_until_no_sessions(servers)


def test_streams_that_hold_nothing_are_closed_and_pending_subscribes_are_bounded(limits_swarm, strangers):
    """A session stream that never opens a session is closed after the timeout, telling why; at most
    max_sessions_per_peer Subscribes of one peer wait for their sessions, each for the timeout."""
    model, servers, _ = limits_swarm
    head, tail = servers[0].handler, servers[1].handler

    async def idle(p2p):
        stream = await MessageStream.open(p2p, PeerID.from_base58(head.peer_id), SESSION_PROTOCOL)
        try:
            reply = (await asyncio.wait_for(stream.receive(), 30)).message
            return reply, await asyncio.wait_for(stream.receive(), 30)
        finally:
            stream.close()

    async def subscribe(p2p, count: int):
        streams = []
        for n in range(count):
            stream = await MessageStream.open(p2p, PeerID.from_base58(tail.peer_id), RESULTS_PROTOCOL)
            streams.append(stream)
            await stream.send(Subscribe(session_id=f"never-opened-{n}", secret="s"))
        await until(lambda: tail.subscriptions.pending.get(p2p.peer_id.to_base58(), 0) == 2)
        extra = await MessageStream.open(p2p, PeerID.from_base58(tail.peer_id), RESULTS_PROTOCOL)
        streams.append(extra)
        await extra.send(Subscribe(session_id="one-too-many", secret="s"))
        refused = (await asyncio.wait_for(extra.receive(), 30)).message
        ends = [await asyncio.wait_for(s.receive(), 30) for s in streams[:count]]  # closed after the timeout
        for stream in streams:
            stream.close()
        return refused, ends

    p2p = strangers[0]
    with (
        attributes(head, sessionless_timeout=0.5),
        attributes(tail, max_sessions_per_peer=2),
        attributes(tail.subscriptions, timeout=8.0),  # the extra Subscribe must arrive while two wait (loaded: 8 s)
    ):
        reply, end = _loop.run(idle(p2p), timeout=60)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST
        assert "no OpenSession within" in reply.message and end is None
        refused, ends = _loop.run(subscribe(p2p, 2), timeout=60)
        assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.BUSY
        assert "2 of them from peer" in refused.message
        assert ends == [None, None] and not tail.subscriptions.pending
