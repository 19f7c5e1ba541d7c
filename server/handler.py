"""The streams a server serves: sessions (from a client or the previous server) and results.

Data path of one run through this server, top to bottom:
  1) ``_serve_session`` reads a Step (+ activations) from the upstream stream and checks it;
  2) the session's worker (``_run_session``) computes it in the compute thread, in run order;
  3) a middle server pushes the Step and its output activations to the next server's stream;
     the tail puts the StepResult on the results stream the client opened.
Errors found here go back upstream on the session stream (each server relays what its
downstream reports), so the client hears about every failure on the stream it opened. Nothing but
ErrorReply travels upstream: a verdict reaches the client only from the tail, on the results stream
the client opened and authenticated with its session secret (docs/design.md, "Trust").

Every peer is a stranger: frames are limited per protocol by what the model can need
(protocol/limits.py), and sessions per server, sessions and cache tokens per upstream peer, a
session's max_length, runs queued, results unread (in messages and bytes: server/unread.py), and
streams that hold no session yet are capped, so no peer can make a server allocate without bound
(docs/reliability.md, "Resource bounds"). An upstream that is an announced server of the route's
previous blocks carries many clients' sessions and is not capped as one client (``_cap_owner``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import msgspec
import torch
from hivemind.p2p import P2P, PeerID

from protocol import compression as codecs
from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from protocol.records import ServerInfo, ServerState
from protocol.messages import (
    Cancel,
    CloseSession,
    DraftOffer,
    ErrorReply,
    LoopedRun,
    Message,
    OpenSession,
    Ping,
    Pong,
    SessionOpened,
    Step,
    StepResult,
    Subscribe,
)
from server.adapters import SpanAdapter, SpanCancelled
from server.batching import DEFAULT_GATHER_WINDOW, DEFAULT_MAX_BATCH_POSITIONS, BatchScheduler
from server.cache_budget import CacheBudget
from server.session import QueuedRun, QueuedTrim, ServerSession, TailReply, check_token_ids
from server.unread import ResultQueue, UnreadLedger, largest, size_of
from protocol import relay
from protocol.streams import PING_PROTOCOL, RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream, serve

logger = logging.getLogger(__name__)

DOWNSTREAM_OPEN_TIMEOUT = 30.0


class SessionHandler:
    def __init__(
        self,
        p2p: P2P,
        span: SpanAdapter,
        budget: CacheBudget,
        *,
        session_timeout: float = 600.0,
        compression: str = codecs.LOSSLESS,  # protocol.compression codec of the activations sent on
        max_positions_per_step: int = limits.DEFAULT_MAX_POSITIONS_PER_STEP,
        max_sessions: int = limits.DEFAULT_MAX_SESSIONS,
        max_sessions_per_peer: int = limits.DEFAULT_MAX_SESSIONS_PER_PEER,
        max_batch_positions: int = DEFAULT_MAX_BATCH_POSITIONS,
        gather_window: float = DEFAULT_GATHER_WINDOW,
        max_session_tokens: Optional[int] = None,  # None: limits.default_max_session_tokens of the budget
        max_unread_bytes: int = limits.DEFAULT_MAX_UNREAD_MIB << 20,
    ):
        self.p2p, self.span, self.budget = p2p, span, budget
        self.peer_id = p2p.peer_id.to_base58()
        self.session_timeout = session_timeout
        self.compression = compression
        self.max_positions_per_step = max_positions_per_step
        self.max_sessions, self.max_sessions_per_peer = max_sessions, max_sessions_per_peer
        self.max_session_tokens = max_session_tokens or limits.default_max_session_tokens(budget.total_tokens)
        if not 0 < self.max_session_tokens <= budget.total_tokens:
            raise ValueError(f"--max-session-tokens must be in 1..{budget.total_tokens} (the cache budget), "
                             f"got {self.max_session_tokens}")  # fmt: skip
        self.max_peer_tokens = max(self.max_session_tokens, budget.total_tokens // limits.PEER_CACHE_SHARE)
        self.unread = UnreadLedger(max_unread_bytes)  # results held for clients that have not read them
        self.max_unread_session_bytes = max_unread_bytes // limits.UNREAD_SESSION_SHARE
        self.unread_wait = limits.UNREAD_WAIT_SECONDS
        self.sessionless_timeout = limits.SESSIONLESS_TIMEOUT
        self.subscribe_timeout = limits.SUBSCRIBE_TIMEOUT
        self._pending_subscribes: dict[str, int] = {}  # peer id -> its Subscribes waiting for their session
        # announced ONLINE servers of this model (peer id -> record), refreshed by the server's upkeep:
        # an upstream among them that serves the route's previous blocks is a server, not a client
        self.known_servers: dict[str, ServerInfo] = {}
        # the largest frame a Step of max_positions_per_step positions needs, and its activations
        self.max_frame_bytes = limits.session_frame_bytes(span.hidden_shape, max_positions_per_step)
        self.max_tensor_elements = limits.step_tensor_elements(span.hidden_shape, max_positions_per_step)
        self.sessions: dict[str, ServerSession] = {}
        self._results: dict[str, ResultQueue] = {}  # tail: per open session
        self._session_opened = asyncio.Event()  # set (and replaced) whenever a session opens here
        self._opening: set[str] = set()  # session ids whose OpenSession waits for the next hop
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="span-compute")
        # every session's runs go through the span together (server/batching.py)
        self.batches = BatchScheduler(span, self._executor, max_batch_positions=max_batch_positions,
                                      gather_window=gather_window, open_sessions=lambda: len(self.sessions))  # fmt: skip
        self.accepting = True
        self.stats = {"runs": 0, "cancelled_runs": 0, "sessions_opened": 0, "accepted_tokens": 0,
                      "cancelled_queued": 0, "cancelled_running": 0, "cancelled_computed": 0,
                      "dropped_upstream": 0, "looped_runs": 0, "looped_runs_dropped": 0,
                      "offers_used": 0}  # fmt: skip

    async def start(self) -> None:
        await serve(self.p2p, SESSION_PROTOCOL, self._serve_session,
                    max_frame_bytes=self.max_frame_bytes, max_tensor_elements=self.max_tensor_elements)  # fmt: skip
        # a client sends only Subscribe (results stream) or Ping (ping stream): small, no tensors
        await serve(self.p2p, RESULTS_PROTOCOL, self._serve_results,
                    max_frame_bytes=limits.CONTROL_FRAME_BYTES, max_tensor_elements=0)  # fmt: skip
        await serve(self.p2p, PING_PROTOCOL, self._serve_ping,
                    max_frame_bytes=limits.CONTROL_FRAME_BYTES, max_tensor_elements=0)  # fmt: skip
        # bitsandbytes takes seconds to import: not on the first run's path
        asyncio.get_running_loop().run_in_executor(None, codecs.preload, self.compression)
        self._reaper = asyncio.create_task(self._reap_idle_sessions())
        self.batches.start()

    async def drain(self, grace: float) -> None:
        """Stop taking sessions, give open ones ``grace`` seconds to finish, then close them:
        their clients see the stream end and move the session elsewhere."""
        self.accepting = False
        deadline = time.monotonic() + grace
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for session in list(self.sessions.values()):
            self._close(session, reason="server draining")
            if session.upstream is not None:
                session.upstream.close()

    async def shutdown(self, grace: float = 0.0) -> None:
        await self.drain(grace)
        self._reaper.cancel()
        self.batches.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- session streams -------------------------------------------------------------------

    async def _serve_session(self, upstream: MessageStream) -> None:
        session: Optional[ServerSession] = None
        downstream: Optional[MessageStream] = None
        try:
            while True:
                message: Optional[Message] = None
                try:
                    if session is None:  # a stream that holds nothing yet may not sit (limits.SESSIONLESS_TIMEOUT)
                        try:
                            received = await asyncio.wait_for(upstream.receive(), self.sessionless_timeout)
                        except asyncio.TimeoutError:
                            error = ProtocolError(ErrorCode.BAD_REQUEST, f"no OpenSession within {self.sessionless_timeout:.0f} s: closing the stream")
                            await self._report(upstream, None, error, None)
                            return
                    else:
                        received = await upstream.receive()
                    if received is None:
                        return  # the client or previous server closed the stream, or died
                    message = received.message
                    if isinstance(message, OpenSession):
                        if session is not None:
                            raise ProtocolError(ErrorCode.SESSION_EXISTS, "this stream already has a session")
                        session, downstream = await self._open(message, upstream)
                    elif isinstance(message, CloseSession):
                        return
                    elif isinstance(message, LoopedRun):  # from a tail, on a stream of its own
                        await self._take_looped_run(message, upstream)
                    elif (
                        session is None
                        or session.closed
                        or getattr(message, "session_id", None) != session.session_id
                    ):
                        raise ProtocolError(
                            ErrorCode.UNKNOWN_SESSION,
                            f"session {getattr(message, 'session_id', None)!r} is not open on this stream",
                        )
                    elif isinstance(message, Step):
                        self._enqueue(session, message, received.tensors)
                    elif isinstance(message, Cancel):
                        await self._cancel(session, message, downstream)
                    elif isinstance(message, DraftOffer):
                        self._take_offer(session, message)
                    else:
                        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {type(message).__name__}")
                except ProtocolError as e:
                    await self._report(upstream, session, e, getattr(message, "run_id", None))
        finally:
            if session is not None:
                self._close(session, reason="upstream closed")
            if downstream is not None:
                downstream.close()

    async def _open(
        self, message: OpenSession, upstream: MessageStream
    ) -> tuple[ServerSession, Optional[MessageStream]]:
        self._check_route(message)
        self._check_upstream(message, upstream)
        if message.session_id in self.sessions or message.session_id in self._opening:
            raise ProtocolError(ErrorCode.SESSION_EXISTS, f"session {message.session_id} is already open here")
        owner = self._cap_owner(message, upstream)
        self._check_session_caps(message, owner)
        if not self.budget.reserve(message.session_id, message.max_length, owner):
            raise ProtocolError(
                ErrorCode.BUSY,
                f"no cache room for max_length={message.max_length}: {self.budget.free_tokens} of "
                f"{self.budget.total_tokens} tokens free",
            )
        session = ServerSession(
            message.session_id, message.max_length, message.route, message.hop_index, self.span.new_cache()
        )
        session.upstream = upstream
        session.secret_hash = message.secret_hash
        downstream = None
        self._opening.add(session.session_id)  # the same id on another stream, meanwhile: session_exists
        try:
            if session.next_hop is not None:
                # the next hop may sit behind NAT: dial it through its relays (remembered only now,
                # once the OpenSession is authorised and admitted: nothing before changes our state)
                relay.remember(session.next_hop.peer_id, session.next_hop.addrs)
                downstream = await self._open_downstream(session)
                asyncio.create_task(self._relay_reports(downstream, upstream, session))
        except BaseException:
            self.budget.release(session.session_id)
            raise
        finally:
            self._opening.discard(session.session_id)
        self.sessions[session.session_id] = session
        if session.next_hop is None:
            self._results[session.session_id] = ResultQueue(self.unread)
        self._session_opened.set()
        self._session_opened = asyncio.Event()
        session.worker = asyncio.create_task(self._run_session(session, downstream))
        self.stats["sessions_opened"] += 1
        logger.info(
            f"Opened session {session.session_id} (blocks {session.hop.start}:{session.hop.end}, "
            f"max_length {session.max_length}, hop {session.hop_index + 1}/{len(session.route)})"
        )
        # quietly: if the opener is already gone, the stream's end closes the session at once
        await _send_quietly(upstream, SessionOpened(session_id=session.session_id))
        return session, downstream

    def _check_route(self, message: OpenSession) -> None:
        route, index = message.route, message.hop_index
        if not 0 <= index < len(route) or route[index].peer_id != self.peer_id:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"hop {index} of the route is not this server ({self.peer_id})")
        hop = route[index]
        if not self.span.start <= hop.start < hop.end <= self.span.end:
            raise ProtocolError(
                ErrorCode.WRONG_BLOCKS,
                f"blocks {hop.start}:{hop.end} asked, this server holds {self.span.start}:{self.span.end}",
            )
        if (index == 0) != (hop.start == 0) or (index == len(route) - 1) != (hop.end == self.span.num_blocks):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the route must start at block 0 and end at the last block")
        if index > 0 and route[index - 1].end != hop.start:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the route's hops are not contiguous")
        if message.max_length <= 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"max_length must be positive, got {message.max_length}")
        if not _is_sha256_hex(message.secret_hash):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "secret_hash must be the sha256 (64 hex digits) of the client's secret")
        if not self.accepting:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "this server is shutting down")

    def _check_upstream(self, message: OpenSession, upstream: MessageStream) -> None:
        """Past the head, the stream must come from the route's previous hop (libp2p authenticates
        the peer id), so no peer can enter a chain in the middle or dodge the per-client cap."""
        if message.hop_index > 0:
            previous = message.route[message.hop_index - 1].peer_id
            if upstream.peer_id.to_base58() != previous:
                raise ProtocolError(
                    ErrorCode.UNAUTHORIZED,
                    f"hop {message.hop_index} must be opened by the route's previous hop {previous}, "
                    f"not by {upstream.peer_id.to_base58()}",
                )

    def _cap_owner(self, message: OpenSession, upstream: MessageStream) -> Optional[str]:
        """Whom a new session counts against in the per-peer caps: its upstream peer, unless that
        peer is a server forwarding the session (None: then only the server-wide caps apply).

        A middle hop's upstream is the previous server, which carries many clients' sessions: capping
        it as one client would cap every server pair. It counts as a server only if it is announced
        ONLINE for this model, holding the route's previous hop, in the records this server reads
        (``known_servers``). Why that cannot be abused: every client enters a chain at its head, which
        caps it as a client, and ``_check_upstream`` lets only the route's previous hop open a middle
        session; a stranger who wants to skip the per-peer caps must announce itself as a server of
        the previous blocks (then clients are routed to it and audits check it), and even so its
        sessions stay under the server-wide caps (max_sessions, the cache budget), each under
        max_session_tokens, and its unread results under their byte bounds."""
        peer = upstream.peer_id.to_base58()
        if message.hop_index == 0:
            return peer
        previous = message.route[message.hop_index - 1]
        record = self.known_servers.get(peer)
        if (
            record is not None
            and record.state == ServerState.ONLINE
            and record.start_block <= previous.start
            and previous.end <= record.end_block
        ):
            return None
        return peer

    def _check_session_caps(self, message: OpenSession, owner: Optional[str]) -> None:
        """Open sessions are capped per server; per owner (a client, or a peer not announced as the
        previous server) in sessions and in cache tokens (a share of the budget); and each session's
        max_length by max_session_tokens: one peer cannot take every slot or the whole cache."""
        held = len(self.sessions) + len(self._opening)
        if held >= self.max_sessions:
            raise ProtocolError(ErrorCode.BUSY, f"this server has {held} sessions open, its limit")
        if message.max_length > self.max_session_tokens:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"no cache room for max_length={message.max_length} in one session: this server's "
                f"max_session_tokens is {self.max_session_tokens} (announced in its record)",
            )
        if owner is None:
            return
        sessions, tokens = self.budget.held_by(owner)
        if sessions >= self.max_sessions_per_peer:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"peer {owner} already has {sessions} sessions open here (at most {self.max_sessions_per_peer})",
            )
        if tokens + message.max_length > self.max_peer_tokens:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"peer {owner} already reserves {tokens} cache tokens here: {message.max_length} more exceed its "
                f"share of {self.max_peer_tokens} of {self.budget.total_tokens}",
            )

    async def _open_downstream(self, session: ServerSession) -> MessageStream:
        next_hop = session.next_hop
        try:
            stream = await asyncio.wait_for(
                MessageStream.open(  # the next server sends back only SessionOpened and ErrorReply
                    self.p2p, PeerID.from_base58(next_hop.peer_id), SESSION_PROTOCOL,
                    max_frame_bytes=limits.CONTROL_FRAME_BYTES, max_tensor_elements=0,
                ),  # fmt: skip
                DOWNSTREAM_OPEN_TIMEOUT,
            )
            await stream.send(
                OpenSession(
                    session_id=session.session_id,
                    max_length=session.max_length,
                    route=session.route,
                    hop_index=session.hop_index + 1,
                    secret_hash=session.secret_hash,
                )
            )
            reply = await asyncio.wait_for(stream.receive(), DOWNSTREAM_OPEN_TIMEOUT)
        except (asyncio.TimeoutError, OSError, Exception) as e:
            raise ProtocolError(
                ErrorCode.DOWNSTREAM_FAILED,
                f"could not open the session on next server {next_hop.peer_id}: {e!r}",
                peer_id=next_hop.peer_id,
            ) from None
        if reply is None:
            raise ProtocolError(
                ErrorCode.DOWNSTREAM_FAILED, f"next server {next_hop.peer_id} closed the stream", peer_id=next_hop.peer_id
            )
        if isinstance(reply.message, ErrorReply):
            stream.close()
            raise ProtocolError(reply.message.code, reply.message.message, peer_id=reply.message.peer_id)
        return stream

    async def _relay_reports(self, downstream: MessageStream, upstream: MessageStream, session: ServerSession) -> None:
        """Pass what the next server reports back upstream; report if it dies. Only ErrorReply
        of this session travels upstream: anything else (a forged verdict) is dropped here, and
        the client would drop it too (verdicts count only from the tail's results stream)."""
        while True:
            try:
                received = await downstream.receive()
            except ProtocolError:
                continue
            if received is None:
                break
            message = received.message
            if isinstance(message, ErrorReply) and message.session_id in ("", session.session_id):
                await _send_quietly(upstream, message)
            else:
                self.stats["dropped_upstream"] += 1
                logger.info(f"Dropped a {type(message).__name__} that {downstream.peer_id} sent upstream")
        if not session.closed:
            error = ProtocolError(
                ErrorCode.DOWNSTREAM_FAILED, f"next server {session.next_hop.peer_id} dropped the session"
            )
            await self._report(upstream, session, error, None, peer_id=session.next_hop.peer_id)

    def _enqueue(self, session: ServerSession, step: Step, tensors: list[torch.Tensor]) -> None:
        if len(step.token_ids) > self.max_positions_per_step:
            raise ProtocolError(
                ErrorCode.STEP_TOO_LARGE,
                f"a Step of {len(step.token_ids)} positions exceeds this server's max_positions_per_step "
                f"{self.max_positions_per_step}: send long prompts as several Steps (chunked prefill)",
            )
        if session.queue.qsize() >= limits.MAX_QUEUED_RUNS:
            raise ProtocolError(
                ErrorCode.QUEUE_FULL, f"{session.queue.qsize()} runs already queued (at most {limits.MAX_QUEUED_RUNS})"
            )
        if len(tensors) > 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a Step carries at most one tensor, got {len(tensors)}")
        hidden = tensors[0] if tensors else None
        session.check_step(step, hidden, self.span)
        session.accept(step)
        session.touch()
        session.queue.put_nowait(QueuedRun(step, hidden))

    async def _take_looped_run(self, message: LoopedRun, tail: MessageStream) -> None:
        """The head's side of a looped run: only the route's tail may start one, and only
        right after the run it follows, with no cancel since (else the client has moved on)."""
        step = message.step
        session = self.sessions.get(step.session_id)
        if (
            session is None
            or session.closed
            or session.hop_index != 0
            or len(session.route) < 2
            or tail.peer_id.to_base58() != session.route[-1].peer_id
        ):
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"no session {step.session_id!r} here whose tail is {tail.peer_id.to_base58()}",
            )
        if session.loop_runs_left < 1 or step.loop_runs != session.loop_runs_left - 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"session {step.session_id!r} asked for no looped run here")
        try:
            self._admit_looped_run(session, message)
        except ProtocolError as e:  # the client waits for this run: tell it on the stream it opened
            await self._report(session.upstream, session, e, step.run_id)

    def _admit_looped_run(self, session: ServerSession, message: LoopedRun) -> bool:
        """Queue a looped run at the head, with the client's offered drafts for this verdict
        if it made any; False (and counted) when it is stale."""
        step, cancelled = message.step, session.cancelled_since_accept
        if session.last_run_id != step.run_id - 1 or (cancelled is not None and cancelled <= step.run_id):
            self.stats["looped_runs_dropped"] += 1
            return False
        offer, session.offer = session.offer, None
        if offer is not None and offer.run_id == step.run_id - 1:
            for accepted, next_token, drafts in offer.options:
                if accepted == message.accepted and next_token == step.token_ids[0]:
                    room = max(0, min(session.max_length - step.start_pos, self.max_positions_per_step) - 1)
                    step.token_ids, step.n_draft = [next_token, *drafts[:room]], len(drafts[:room])
                    self.stats["offers_used"] += 1
                    break
        self._enqueue(session, step, [])
        self.stats["looped_runs"] += 1
        return True

    def _take_offer(self, session: ServerSession, offer: DraftOffer) -> None:
        """Keep the client's drafts for the verdicts of run ``offer.run_id`` (the latest offer only)."""
        if session.hop_index != 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a DraftOffer goes to the route's head")
        if len(offer.options) > limits.MAX_OFFER_OPTIONS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(offer.options)} options exceed {limits.MAX_OFFER_OPTIONS}")
        for accepted, next_token, drafts in offer.options:
            if not 0 <= accepted <= limits.MAX_OFFER_DRAFTS or len(drafts) > limits.MAX_OFFER_DRAFTS:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"an option may name and carry at most {limits.MAX_OFFER_DRAFTS} drafts")
            check_token_ids((next_token, *drafts), self.span.vocab_size)
        session.offer = offer
        session.touch()

    async def _looped_verdict(self, session: ServerSession, step: Step, result: StepResult) -> StepResult:
        """The verdict of a Step with loop_runs, or of a run this tail started: the next run leaves
        for the head before the verdict does, and a run the tail started names its drafts."""
        if step.parents:  # a tree's verdict: never looped
            return result
        if step.run_id in session.tail_started:  # the client did not choose these drafts
            session.tail_started.discard(step.run_id)
            result = msgspec.structs.replace(result, run_drafts=step.token_ids[len(step.token_ids) - step.n_draft :])
        if step.loop_runs > 0:
            result = msgspec.structs.replace(result, looped=await self._loop_to_head(session, step, result))
        return result

    async def _loop_to_head(self, session: ServerSession, step: Step, result: StepResult) -> bool:
        """The tail's side: send the run after ``result`` to the head (docs/protocol.md
        "Looped runs"); False when this verdict cannot be continued without the client."""
        if step.parents or step.draft_q is not None or step.return_logits:
            return False  # trees, the rejection exchange (the client draws the token) and forward passes
        start = step.start_pos + len(step.token_ids) - step.n_draft + result.accepted
        ids = [result.next_token, *result.drafts]
        if start + len(ids) > session.max_length:
            return False
        following = LoopedRun(step=Step(
            session_id=session.session_id, run_id=step.run_id + 1, start_pos=start, token_ids=ids,
            n_draft=len(result.drafts), top_logprobs=step.top_logprobs, tail_drafts=step.tail_drafts,
            loop_runs=step.loop_runs - 1,
        ), accepted=result.accepted)  # fmt: skip
        if session.hop_index == 0:  # a one-server route: the tail is the head
            try:
                started = self._admit_looped_run(session, following)
            except ProtocolError:
                started = False
            return started and self._started(session, following.step.run_id)
        try:
            if session.head_stream is None:
                session.head_stream = await asyncio.wait_for(
                    MessageStream.open(
                        self.p2p, PeerID.from_base58(session.route[0].peer_id), SESSION_PROTOCOL,
                        max_frame_bytes=limits.CONTROL_FRAME_BYTES, max_tensor_elements=0,
                    ),  # fmt: skip
                    DOWNSTREAM_OPEN_TIMEOUT,
                )
                asyncio.create_task(self._drain_head_replies(session, session.head_stream))
            await session.head_stream.send(following)
        except (asyncio.TimeoutError, OSError, Exception) as e:  # the client then sends the run itself
            logger.info(f"Could not start run {following.step.run_id} of session {session.session_id} at the head: {e!r}")
            if session.head_stream is not None:
                session.head_stream.close()
                session.head_stream = None
            return False
        return self._started(session, following.step.run_id)

    @staticmethod
    def _started(session: ServerSession, run_id: int) -> bool:
        """Remember a run this tail started, so that its verdict names its drafts (run_drafts)."""
        session.tail_started.add(run_id)
        if len(session.tail_started) > 64:
            session.tail_started.discard(min(session.tail_started))
        return True

    async def _drain_head_replies(self, session: ServerSession, stream: MessageStream) -> None:
        """The head answers a looped run only to refuse it (ErrorReply); log and drop those. The head
        closes a stream that carried nothing for limits.SESSIONLESS_TIMEOUT: the next looped run opens another."""
        while True:
            try:
                received = await stream.receive()
            except ProtocolError:
                continue
            if received is None:
                if session.head_stream is stream:
                    session.head_stream = None
                stream.close()
                return
            logger.info(f"The head refused a looped run: {received.message}")

    async def _cancel(self, session: ServerSession, cancel: Cancel, downstream: Optional[MessageStream]) -> None:
        """Drop the run and every later one; forward after any data already sent downstream."""
        trim_to = session.cancel_from(cancel.run_id, self.stats)
        if trim_to is not None:  # no server keeps positions of cancelled runs
            session.queue.put_nowait(QueuedTrim(trim_to))
        session.touch()
        if downstream is not None:
            await _send_quietly(downstream, cancel)

    async def _run_session(self, session: ServerSession, downstream: Optional[MessageStream]) -> None:
        while (run := await session.queue.get()) is not None:
            if isinstance(run, QueuedTrim):
                session.trim(self.span, min(run.length, self.span.cache_length(session.cache)))
                continue
            if run.cancelled:
                self.stats["cancelled_runs"] += 1
                continue
            session.running = run
            try:
                output = await self.batches.compute(session, run)
            except SpanCancelled:
                self.stats["cancelled_runs"] += 1
                continue
            except ProtocolError as e:
                await self._report_run(session, e, run.step.run_id)
                continue
            except Exception as e:
                logger.exception(f"Run {run.step.run_id} of session {session.session_id} failed")
                await self._report_run(session, ProtocolError(ErrorCode.INTERNAL, repr(e)), run.step.run_id)
                continue
            finally:
                session.running = None
            if run.cancelled or session.closed:  # cancelled while computing: never send it on
                self.stats["cancelled_runs"] += 1
                continue
            self.stats["runs"] += 1
            if isinstance(output, TailReply):  # a forward pass's outputs go first, the verdict after them
                for frame in output.outputs:
                    await self._post_result(session, frame)
                output = output.result
            if isinstance(output, StepResult):
                self.stats["accepted_tokens"] += output.accepted + 1
                if run.step.loop_runs > 0 or run.step.run_id in session.tail_started:
                    output = await self._looped_verdict(session, run.step, output)
                await self._post_result(session, output)
            else:
                await _send_quietly(downstream, run.step, [output], self.compression)

    async def _report_run(self, session: ServerSession, error: ProtocolError, run_id: int) -> None:
        """A run failed here: the tail tells the client directly, others tell their upstream."""
        reply = ErrorReply(
            session_id=session.session_id, code=error.code, message=error.message, run_id=run_id, peer_id=self.peer_id
        )
        if session.next_hop is None:
            await self._post_result(session, reply)
        else:
            await _send_quietly(session.upstream, reply)

    async def _post_result(self, session: ServerSession, item) -> None:
        """Queue a message for the session's results stream (tail), within the unread bounds
        (server/unread.py says why each): more than MAX_UNREAD_RESULTS messages unread closes the
        session; over its byte share it waits for its client to read (computing nothing meanwhile),
        and closes after ``unread_wait`` seconds; over the server's byte budget, the session holding
        the most unread bytes closes. Each closed session is told why (queue_full) upstream."""
        queue = self._results.get(session.session_id)
        if queue is None or session.closed:
            return
        if queue.qsize() >= limits.MAX_UNREAD_RESULTS:
            await self._close_unread(session, f"more than {limits.MAX_UNREAD_RESULTS} results unread: closing the session")
            return
        size = size_of(item)
        cap = self.max_unread_session_bytes
        if not await queue.room_for(size, cap, self.unread_wait):
            await self._close_unread(session, f"{queue.bytes} bytes of results unread for {self.unread_wait:.0f} s "
                                              f"(a session may hold {cap} bytes unread): closing the session")  # fmt: skip
            return
        while not session.closed and self.unread.total + size > self.unread.max_bytes:
            hog = largest(self._results)
            if hog is None or hog not in self.sessions:
                break  # nothing unread elsewhere: one message always passes
            held = self._results[hog].bytes
            await self._close_unread(self.sessions[hog], f"this server holds more than {self.unread.max_bytes} bytes "
                                                         f"of unread results, {held} of them for this session: closing it")  # fmt: skip
        if not session.closed:
            queue.post(item, size)

    async def _close_unread(self, session: ServerSession, why: str) -> None:
        await self._report(session.upstream, session, ProtocolError(ErrorCode.QUEUE_FULL, why), None)
        self._close(session, reason="results unread")
        session.upstream.close()

    async def _report(
        self,
        upstream: MessageStream,
        session: Optional[ServerSession],
        error: ProtocolError,
        run_id: Optional[int],
        peer_id: str = "",
    ) -> None:
        session_id = session.session_id if session is not None else ""
        logger.info(f"Refused {session_id or 'a request'} from {upstream.peer_id}: {error}")
        reply = ErrorReply(
            session_id=session_id,
            code=error.code,
            message=error.message,
            run_id=run_id,
            peer_id=peer_id or error.peer_id or self.peer_id,
        )
        await _send_quietly(upstream, reply)

    def _close(self, session: ServerSession, reason: str) -> None:
        if session.closed:
            return
        session.closed = True
        if session.head_stream is not None:
            session.head_stream.close()
        if session.running is not None:
            session.running.cancelled = True
        session.queue.put_nowait(None)
        self.budget.release(session.session_id)
        self.sessions.pop(session.session_id, None)
        results = self._results.pop(session.session_id, None)
        if results is not None:
            results.end()
        logger.info(f"Closed session {session.session_id} ({reason})")

    async def _reap_idle_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.session_timeout / 4))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_active > self.session_timeout:
                    self._close(session, reason=f"idle for more than {self.session_timeout:.0f} s")

    async def _serve_ping(self, peer: MessageStream) -> None:
        try:
            received = await asyncio.wait_for(peer.receive(), 10)
        except (asyncio.TimeoutError, ProtocolError):
            return
        if received is not None and isinstance(received.message, Ping):
            await _send_quietly(peer, Pong(received.message.nonce, len(self.sessions)))

    # ---- results streams (tail only) --------------------------------------------------------

    async def _serve_results(self, client: MessageStream) -> None:
        """One client's results stream: its first message must be a Subscribe carrying the secret
        whose sha256 the session was opened with; then the session's verdicts go out here. Until
        its session is found, a Subscribe is pending: at most max_sessions wait at once (and
        max_sessions_per_peer per peer), each at most ``subscribe_timeout`` seconds."""
        peer = client.peer_id.to_base58()
        pending = sum(self._pending_subscribes.values())
        mine = self._pending_subscribes.get(peer, 0)
        if pending >= self.max_sessions or mine >= self.max_sessions_per_peer:
            message = (f"{pending} Subscribes already wait for their sessions here, {mine} of them from peer {peer} "
                       f"(at most {self.max_sessions}, {self.max_sessions_per_peer} per peer)")  # fmt: skip
            logger.info(f"Refused a Subscribe from {peer}: {message}")
            await _send_quietly(client, ErrorReply(session_id="", code=ErrorCode.BUSY, message=message, peer_id=self.peer_id))
            return
        self._pending_subscribes[peer] = mine + 1
        try:
            session = await self._subscribed_session(client)
        finally:
            left = self._pending_subscribes.pop(peer) - 1
            if left:
                self._pending_subscribes[peer] = left
        if session is not None:
            await self._send_results(client, *session)

    async def _subscribed_session(self, client: MessageStream):
        """(session, its Subscribe, the task that ends when the client goes away) once a valid
        Subscribe names a session open here; None (the client told why) otherwise."""
        try:
            first = await asyncio.wait_for(client.receive(), self.subscribe_timeout)
        except (asyncio.TimeoutError, ProtocolError) as e:
            code = e.code if isinstance(e, ProtocolError) else ErrorCode.BAD_REQUEST
            await _send_quietly(client, ErrorReply(session_id="", code=code, message=str(e) or "no Subscribe in time"))
            return
        if first is None:
            return
        if not isinstance(first.message, Subscribe):
            error = ErrorReply(session_id="", code=ErrorCode.BAD_REQUEST, message="expected Subscribe")
            await _send_quietly(client, error)
            return
        subscribe = first.message
        closed = asyncio.create_task(client.receive())  # returns when the client goes away
        try:
            session = await self._wait_for_session(subscribe.session_id, closed)
            if session is None:
                return _forget(closed)  # the client went away, or the session never opened here
            refusal = self._check_subscriber(session, subscribe)
            if refusal is not None:
                logger.info(f"Refused a Subscribe to {session.session_id} from {client.peer_id}: {refusal}")
                error = ErrorReply(session_id=subscribe.session_id, code=ErrorCode.UNAUTHORIZED, message=refusal,
                                   peer_id=self.peer_id)  # fmt: skip
                await _send_quietly(client, error)
                return _forget(closed)
        except BaseException:
            _forget(closed)
            raise
        return session, subscribe, closed

    async def _send_results(self, client: MessageStream, session: ServerSession, subscribe: Subscribe,
                            closed: "asyncio.Task") -> None:  # fmt: skip
        """The session's results, in order, to its client, until either goes away."""
        try:
            session.subscribed, session.secret = True, subscribe.secret
            queue = self._results.get(session.session_id)
            if queue is None:
                return  # the session closed meanwhile
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, closed}, timeout=self.subscribe_timeout, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if closed in done or session.closed:
                        return  # client gone, or the session closed
                    continue
                item = getter.result()
                if item is None:
                    return
                try:
                    if isinstance(item, tuple):  # (RunOutputs, its tensors)
                        await client.send(*item)
                    else:
                        await client.send(item)
                except (ConnectionError, OSError):  # the client went away mid-send (e.g. with a run's
                    return  # verdict still on its way after it cancelled that run): nothing to report
        finally:
            _forget(closed)

    async def _wait_for_session(self, session_id: str, closed: "asyncio.Task") -> Optional[ServerSession]:
        """The client subscribes before it opens the session through the head: wait (bounded) for
        the session to open here."""
        deadline = time.monotonic() + self.subscribe_timeout
        while (session := self.sessions.get(session_id)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or closed.done():
                return None
            opened = asyncio.create_task(self._session_opened.wait())
            await asyncio.wait({opened, closed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
        return session

    def _check_subscriber(self, session: ServerSession, subscribe: Subscribe) -> Optional[str]:
        """Why this Subscribe may not have the session's results, or None if it may."""
        if session.next_hop is not None:
            return "this server is not the session's tail"
        given = hashlib.sha256(subscribe.secret.encode()).hexdigest()
        if not hmac.compare_digest(given, session.secret_hash):
            return "the session's secret does not match: results go only to the client that opened the session"
        if session.subscribed:
            return "the session already has a results stream"
        return None


async def _send_quietly(stream: Optional[MessageStream], message: Message, tensors=(), codec=codecs.LOSSLESS) -> None:
    """Send, ignoring a peer that is already gone (its own stream end reports that)."""
    if stream is None:
        return
    try:
        await stream.send(message, tensors, codec)
    except (ConnectionError, OSError, RuntimeError) as e:
        logger.debug(f"Could not send {type(message).__name__} to {stream.peer_id}: {e!r}")


def _forget(closed: "asyncio.Task") -> None:
    """Stop watching a results stream's end."""
    closed.cancel()
    if closed.done() and not closed.cancelled():
        closed.exception()  # a malformed frame after Subscribe: retrieved, nothing to report


def _is_sha256_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
