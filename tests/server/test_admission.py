"""What a server admits (server/admission.py), as pure checks with no network; and the handler's and
the results stream's steps over an in-memory stream (tests/kit/streams.py), with no libp2p."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest

from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    DraftOffer,
    ErrorReply,
    Hop,
    LoopedRun,
    OpenSession,
    SessionOpened,
    Step,
    Subscribe,
)
from protocol.records import ServerInfo, ServerState
from server import admission
from server.admission import HeldBlocks, SessionCaps
from server.cache_budget import CacheBudget
from server.handler import SessionHandler
from server.open_sessions import OpenSessions
from server.session import ServerSession
from server.subscribe import Subscriptions
from tests.kit.streams import FakePeerID, FakeStream

SECRET = "the client's secret"
SECRET_HASH = hashlib.sha256(SECRET.encode()).hexdigest()
ROUTE = [Hop("head", 0, 4), Hop("middle", 4, 8), Hop("tail", 8, 12)]


def open_session(hop_index: int = 1, max_length: int = 64, route=ROUTE, secret_hash: str = SECRET_HASH) -> OpenSession:
    return OpenSession(session_id="s", max_length=max_length, route=route, hop_index=hop_index, secret_hash=secret_hash)


def refused(code: ErrorCode, check, *args) -> str:
    """The message of the ProtocolError ``check(*args)`` raises, which must carry ``code``."""
    with pytest.raises(ProtocolError) as caught:
        check(*args)
    assert caught.value.code == code, caught.value
    return caught.value.message


# ---- OpenSession: the route, the upstream, the caps ---------------------------------------------


def test_a_route_that_names_this_server_over_its_blocks_is_admitted():
    admission.check_route(open_session(), "middle", HeldBlocks(4, 8, 12), True)
    admission.check_route(open_session(), "middle", HeldBlocks(0, 12, 12), True)  # holds more than asked


@pytest.mark.parametrize(
    "message, peer, held, code, says",
    [
        (open_session(hop_index=3), "middle", HeldBlocks(4, 8, 12), ErrorCode.BAD_REQUEST, "is not this server"),
        (open_session(), "another", HeldBlocks(4, 8, 12), ErrorCode.BAD_REQUEST, "is not this server"),
        (open_session(), "middle", HeldBlocks(5, 8, 12), ErrorCode.WRONG_BLOCKS, "this server holds 5:8"),
        (
            open_session(hop_index=0, route=[Hop("head", 1, 12)]),
            "head",
            HeldBlocks(0, 12, 12),
            ErrorCode.BAD_REQUEST,
            "start at block 0",
        ),
        (
            open_session(hop_index=0, route=[Hop("head", 0, 11)]),
            "head",
            HeldBlocks(0, 12, 12),
            ErrorCode.BAD_REQUEST,
            "end at the last block",
        ),
        (
            open_session(route=[Hop("head", 0, 3), Hop("middle", 4, 8), Hop("tail", 8, 12)]),
            "middle",
            HeldBlocks(4, 8, 12),
            ErrorCode.BAD_REQUEST,
            "not contiguous",
        ),
        (
            open_session(max_length=0),
            "middle",
            HeldBlocks(4, 8, 12),
            ErrorCode.BAD_REQUEST,
            "max_length must be positive",
        ),
        (open_session(secret_hash="abc"), "middle", HeldBlocks(4, 8, 12), ErrorCode.BAD_REQUEST, "secret_hash"),
    ],
)
def test_a_route_that_does_not_fit_this_server_is_refused_by_name(message, peer, held, code, says):
    assert says in refused(code, admission.check_route, message, peer, held, True)


def test_a_draining_server_refuses_new_sessions():
    refused(ErrorCode.SHUTTING_DOWN, admission.check_route, open_session(), "middle", HeldBlocks(4, 8, 12), False)


def test_past_the_head_only_the_previous_hop_may_open_a_session():
    admission.check_upstream(open_session(hop_index=0), "anyone")
    admission.check_upstream(open_session(hop_index=1), "head")
    message = refused(ErrorCode.UNAUTHORIZED, admission.check_upstream, open_session(hop_index=2), "head")
    assert "previous hop middle, not by head" in message


def test_one_session_id_is_open_once():
    admission.check_new_session_id("s", {"t"})
    refused(ErrorCode.SESSION_EXISTS, admission.check_new_session_id, "s", {"s", "t"})


def record(peer: str, start: int, end: int, state: ServerState = ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(peer_id=peer, model="m", start_block=start, end_block=end, state=state)


def test_an_announced_server_of_the_previous_blocks_is_not_capped_as_a_client():
    known = {
        "head": record("head", 0, 4),
        "joining": record("joining", 0, 4, ServerState.JOINING),
        "short": record("short", 0, 3),
    }
    assert admission.cap_owner(open_session(hop_index=0), "client", known) == "client"  # the head caps its client
    assert admission.cap_owner(open_session(hop_index=1), "head", known) is None
    for peer in ("joining", "short", "stranger"):
        assert admission.cap_owner(open_session(hop_index=1), peer, known) == peer


CAPS = SessionCaps(
    max_sessions=4, max_session_tokens=100, max_sessions_per_peer=2, max_peer_tokens=150, total_tokens=300
)


def test_session_caps_per_server_per_session_and_per_peer():
    admission.check_session_caps(open_session(max_length=100), "p", 3, (1, 50), CAPS)
    admission.check_session_caps(open_session(max_length=100), None, 3, (9, 999), CAPS)  # a server: per-peer caps skip
    assert "4 sessions open" in refused(
        ErrorCode.BUSY, admission.check_session_caps, open_session(), None, 4, (0, 0), CAPS
    )
    assert "max_session_tokens is 100" in refused(
        ErrorCode.BUSY, admission.check_session_caps, open_session(max_length=101), None, 0, (0, 0), CAPS
    )
    assert "already has 2 sessions" in refused(
        ErrorCode.BUSY, admission.check_session_caps, open_session(), "p", 2, (2, 10), CAPS
    )
    assert "share of 150 of 300" in refused(
        ErrorCode.BUSY, admission.check_session_caps, open_session(max_length=100), "p", 1, (1, 51), CAPS
    )


# ---- runs, offers and looped runs ---------------------------------------------------------------


def step(n: int = 3, run_id: int = 0, loop_runs: int = 0) -> Step:
    return Step(session_id="s", run_id=run_id, start_pos=0, token_ids=list(range(n)), loop_runs=loop_runs)


def test_a_step_fits_one_frame_and_the_queue():
    admission.check_step_frame(step(8), 1, limits.MAX_QUEUED_RUNS - 1, 8)
    refused(ErrorCode.STEP_TOO_LARGE, admission.check_step_frame, step(9), 0, 0, 8)
    refused(ErrorCode.QUEUE_FULL, admission.check_step_frame, step(), 0, limits.MAX_QUEUED_RUNS, 8)
    refused(ErrorCode.BAD_REQUEST, admission.check_step_frame, step(), 2, 0, 8)


def test_draft_offers_go_to_the_head_within_their_bounds():
    offer = DraftOffer(session_id="s", run_id=1, options=[(0, 5, [6, 7])])
    admission.check_offer(offer, 0, 10)
    refused(ErrorCode.BAD_REQUEST, admission.check_offer, offer, 1, 10)
    refused(ErrorCode.TOKEN_OUT_OF_VOCAB, admission.check_offer, offer, 0, 7)
    many = DraftOffer(session_id="s", run_id=1, options=[(0, 1, [])] * (limits.MAX_OFFER_OPTIONS + 1))
    refused(ErrorCode.BAD_REQUEST, admission.check_offer, many, 0, 10)
    long = DraftOffer(session_id="s", run_id=1, options=[(0, 1, [2] * (limits.MAX_OFFER_DRAFTS + 1))])
    refused(ErrorCode.BAD_REQUEST, admission.check_offer, long, 0, 10)


def session_at(hop_index: int, route=ROUTE) -> ServerSession:
    return ServerSession("s", 64, route, hop_index, cache=None)


def test_only_the_routes_tail_starts_a_looped_run_and_only_when_asked():
    head = session_at(0)
    head.loop_runs_left = 2
    admission.check_looped_sender(head, step(loop_runs=1), "tail")
    refused(ErrorCode.UNKNOWN_SESSION, admission.check_looped_sender, head, step(loop_runs=1), "middle")
    refused(ErrorCode.UNKNOWN_SESSION, admission.check_looped_sender, None, step(loop_runs=1), "tail")
    refused(ErrorCode.UNKNOWN_SESSION, admission.check_looped_sender, session_at(1), step(loop_runs=1), "tail")
    refused(ErrorCode.BAD_REQUEST, admission.check_looped_sender, head, step(loop_runs=0), "tail")


# ---- Subscribe -----------------------------------------------------------------------------------


def test_subscribes_waiting_for_their_sessions_are_capped_per_server_and_per_peer():
    assert admission.subscribe_slot_refusal("p", {"q": 1}, 3, 2) is None
    assert "2 of them from peer p" in admission.subscribe_slot_refusal("p", {"p": 2}, 3, 2)
    assert "3 Subscribes already wait" in admission.subscribe_slot_refusal("p", {"q": 2, "r": 1}, 3, 2)


def test_results_go_only_to_the_holder_of_the_secret_once_and_only_from_the_tail():
    tail = session_at(2)
    tail.secret_hash = SECRET_HASH
    assert admission.check_subscriber(tail, Subscribe(session_id="s", secret=SECRET)) is None
    assert "does not match" in admission.check_subscriber(tail, Subscribe(session_id="s", secret="guess"))
    assert "not the session's tail" in admission.check_subscriber(
        session_at(1), Subscribe(session_id="s", secret=SECRET)
    )
    tail.subscribed = True
    assert "already has a results stream" in admission.check_subscriber(tail, Subscribe(session_id="s", secret=SECRET))


# ---- the handler's and the results stream's steps over a fake stream --------------------------------


class TinySpan:
    """What the handler reads of a span before any run is computed."""

    start, end, num_blocks, hidden_shape, vocab_size = 0, 12, 12, (8,), 100
    lora = None  # serves no LoRA adapter (server/lora.py)

    def new_cache(self) -> object:
        return object()


def handler() -> SessionHandler:
    p2p = SimpleNamespace(peer_id=FakePeerID("me"))
    return SessionHandler(p2p, TinySpan(), CacheBudget(256))


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_the_handler_opens_a_session_and_its_streams_end_closes_it():
    async def scenario():
        server, client = handler(), FakeStream("client")
        client.put(open_session(hop_index=0, max_length=16, route=[Hop("me", 0, 12)]))
        serving = asyncio.create_task(server._serve_session(client))
        while not client.sent:
            await asyncio.sleep(0.01)
        assert client.messages() == [SessionOpened(session_id="s")] and "s" in server.sessions
        assert server.budget.free_tokens == 256 - 16
        client.end()
        await serving
        return server

    server = run(scenario())
    assert not server.sessions and server.budget.free_tokens == 256 and server.stats["sessions_opened"] == 1


def test_the_handler_refuses_by_name_and_the_stream_goes_on():
    async def scenario():
        server, stranger = handler(), FakeStream("stranger")
        stranger.put(open_session(hop_index=0, route=[Hop("someone else", 0, 12)]))
        stranger.put(step())  # no session on this stream
        stranger.put(LoopedRun(step=step(), accepted=0))  # no such session here
        stranger.end()
        await server._serve_session(stranger)
        return stranger.messages()

    replies = run(scenario())
    assert [type(r) for r in replies] == [ErrorReply] * 3
    assert [r.code for r in replies] == [ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_SESSION, ErrorCode.UNKNOWN_SESSION]
    assert all(r.peer_id == "me" for r in replies) and replies[1].run_id == 0


def test_a_stream_that_holds_no_session_may_not_sit():
    async def scenario():
        server, idle = handler(), FakeStream("idle")
        server.sessionless_timeout = 0.05
        await server._serve_session(idle)
        return idle.messages()

    (reply,) = run(scenario())
    assert reply.code == ErrorCode.BAD_REQUEST and "no OpenSession within" in reply.message


def tail_sessions() -> OpenSessions:
    sessions = OpenSessions(CacheBudget(256), 1 << 20)
    tail = ServerSession("s", 64, [Hop("me", 0, 12)], 0, cache=None)
    tail.secret_hash = SECRET_HASH
    sessions.add(tail)
    return sessions


def test_a_subscribe_without_the_secret_is_refused_and_the_holder_gets_the_results():
    async def scenario():
        sessions = tail_sessions()
        subscriptions = Subscriptions(sessions, "me")
        thief = FakeStream("thief")
        thief.put(Subscribe(session_id="s", secret="guess"))
        await subscriptions.serve(thief, 4, 2)
        client = FakeStream("client")
        client.put(Subscribe(session_id="s", secret=SECRET))
        serving = asyncio.create_task(subscriptions.serve(client, 4, 2))
        sessions.results["s"].post(SessionOpened(session_id="s"), 10)  # any message stands for a result
        while not client.sent:
            await asyncio.sleep(0.01)
        sessions.close(sessions.sessions["s"], "done")
        await serving
        return thief.messages(), client.messages(), subscriptions.pending

    refusal, results, pending = run(scenario())
    assert [r.code for r in refusal] == [ErrorCode.UNAUTHORIZED] and "does not match" in refusal[0].message
    assert results == [SessionOpened(session_id="s")] and not pending


def test_a_subscribe_waits_boundedly_for_its_session_and_extra_ones_are_refused():
    async def scenario():
        subscriptions = Subscriptions(OpenSessions(CacheBudget(256), 1 << 20), "me")
        subscriptions.timeout = 0.2
        waiting = FakeStream("client")
        waiting.put(Subscribe(session_id="never", secret=SECRET))
        serving = asyncio.create_task(subscriptions.serve(waiting, 4, 1))
        while not subscriptions.pending:
            await asyncio.sleep(0.01)
        extra = FakeStream("client")
        await subscriptions.serve(extra, 4, 1)
        await serving
        return waiting.messages(), extra.messages(), subscriptions.pending

    nothing, busy, pending = run(scenario())
    assert nothing == [] and not pending
    assert [r.code for r in busy] == [ErrorCode.BUSY] and "1 of them from peer client" in busy[0].message
