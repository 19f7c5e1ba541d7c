"""The streams a server serves: sessions (from a client or the previous server), results and pings.

Data path of one run through this server, top to bottom:
  1) ``_serve_session`` reads a Step (+ activations) from the upstream stream, checks it
     (server/admission.py, ServerSession.check_step) and queues it;
  2) the session's worker (``_run_session``) takes its runs in run order and computes each with the
     other sessions' runs (server/batching.py -> server/compute.py -> the span's adapter);
  3) a middle server pushes the Step and its output activations to the next server's stream
     (server/next_hop.py); the tail posts the StepResult for the results stream the client opened
     (server/results.py, read out by server/subscribe.py), and may start the next run at the head
     (server/looped_runs.py).
Errors found here go back upstream on the session stream (each server relays what its
downstream reports), so the client hears about every failure on the stream it opened. Nothing but
ErrorReply travels upstream: a verdict reaches the client only from the tail, on the results stream
the client opened and authenticated with its session secret (docs/design.md, "Trust").

Every peer is a stranger: frames are limited per protocol by what the model can need
(protocol/limits.py), and sessions per server, sessions and cache tokens per upstream peer, a
session's max_length, runs queued, results unread (in messages and bytes: server/unread.py), and
streams that hold no session yet are capped, so no peer can make a server allocate without bound
(docs/reliability.md, "Resource bounds"). An upstream that is an announced server of the route's
previous blocks carries many clients' sessions and is not capped as one client (admission.cap_owner).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch
from hivemind.p2p import P2P

from protocol import compression as codecs
from protocol import limits, relay
from protocol.errors import ErrorCode, ProtocolError
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
)
from protocol.records import ServerInfo
from protocol.streams import PING_PROTOCOL, RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream, serve
from server import admission, deep_prompts, next_hop
from server.adapters import SpanAdapter
from server.address_caps import AddressCaps
from server.batching import DEFAULT_GATHER_WINDOW, DEFAULT_MAX_BATCH_POSITIONS, BatchScheduler
from server.cache_budget import CacheBudget
from server.compile_budget import Requester
from server.lora import check_adapter
from server.open_sessions import OpenSessions
from server.replies import report, send_quietly
from server.results import TailResults
from server.session import QueuedRun, QueuedTrim, ServerSession
from server.subscribe import Subscriptions
from server.training import TrainingHandler
from server.unread import UnreadLedger
from server.worker import SessionWorker

logger = logging.getLogger(__name__)

STATS = (
    "runs",
    "cancelled_runs",
    "sessions_opened",
    "accepted_tokens",
    "cancelled_queued",
    "cancelled_running",
    "cancelled_computed",
    "dropped_upstream",
    "looped_runs",
    "looped_runs_dropped",
    "offers_used",
)


class SessionHandler(SessionWorker):
    """Serves a span's sessions: dispatches what arrives on each stream; each session's worker
    (server/worker.py) computes its runs and sends their outputs on."""

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
        max_train_bytes: int = limits.DEFAULT_MAX_TRAIN_MIB << 20,
        max_backward_bytes: int = 0,  # one training row's backward activations; 0: what the step limit allows
        address_caps: Optional[AddressCaps] = None,  # the share one source address may hold
    ):
        self.p2p, self.span, self.budget = p2p, span, budget
        self.peer_id = p2p.peer_id.to_base58()
        self.session_timeout = session_timeout
        self.compression = compression
        self.max_positions_per_step = max_positions_per_step
        self.max_sessions, self.max_sessions_per_peer = max_sessions, max_sessions_per_peer
        self.address_caps = address_caps or AddressCaps()
        self.max_session_tokens = max_session_tokens or limits.default_max_session_tokens(budget.total_tokens)
        if not 0 < self.max_session_tokens <= budget.total_tokens:
            raise ValueError(
                f"--max-session-tokens must be in 1..{budget.total_tokens} (the cache budget), "
                f"got {self.max_session_tokens}"
            )
        self.max_peer_tokens = max(self.max_session_tokens, budget.total_tokens // limits.PEER_CACHE_SHARE)
        self.sessionless_timeout = limits.SESSIONLESS_TIMEOUT
        # announced ONLINE servers of this model (peer id -> record), refreshed by the server's upkeep:
        # an upstream among them that serves the route's previous blocks is a server, not a client
        self.known_servers: dict[str, ServerInfo] = {}
        # the largest frame a Step of max_positions_per_step positions needs, and its activations
        self.max_frame_bytes = limits.session_frame_bytes(span.hidden_shape, max_positions_per_step)
        self.max_tensor_elements = limits.step_tensor_elements(span.hidden_shape, max_positions_per_step)
        self.open_sessions = OpenSessions(budget, max_unread_bytes)
        self.results = TailResults(self.open_sessions, self.peer_id, max_unread_bytes, self.address_caps)
        self.subscriptions = Subscriptions(self.open_sessions, self.peer_id)  # the tail's results streams
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="span-compute")
        # every session's runs go through the span together (server/batching.py)
        self.batches = BatchScheduler(
            span,
            self._executor,
            max_batch_positions=max_batch_positions,
            gather_window=gather_window,
            open_sessions=lambda: len(self.sessions),
        )
        self.accepting = True
        self.stats = dict.fromkeys(STATS, 0)
        # training steps (server/training.py), on the same compute thread as the sessions' runs
        self.training = TrainingHandler(
            p2p,
            span,
            self._executor,
            max_positions_per_step=max_positions_per_step,
            max_kept_bytes=max_train_bytes,
            max_backward_bytes=max_backward_bytes,
            known_servers=lambda: self.known_servers,
        )

    @property
    def sessions(self) -> dict[str, ServerSession]:
        """The sessions open here, by id."""
        return self.open_sessions.sessions

    @property
    def unread(self) -> UnreadLedger:
        """The tail's unread result bytes over all sessions."""
        return self.open_sessions.unread

    async def start(self) -> None:
        """Serve the three protocols; start the idle reaper and the batch scheduler."""
        await serve(
            self.p2p,
            SESSION_PROTOCOL,
            self._serve_session,
            max_frame_bytes=self.max_frame_bytes,
            max_tensor_elements=self.max_tensor_elements,
        )
        # a client sends only Subscribe (results stream) or Ping (ping stream): small, no tensors
        await serve(
            self.p2p,
            RESULTS_PROTOCOL,
            self._serve_results,
            max_frame_bytes=limits.CONTROL_FRAME_BYTES,
            max_tensor_elements=0,
        )
        await serve(
            self.p2p, PING_PROTOCOL, self._serve_ping, max_frame_bytes=limits.CONTROL_FRAME_BYTES, max_tensor_elements=0
        )
        await self.training.start()
        # bitsandbytes takes seconds to import: not on the first run's path
        asyncio.get_running_loop().run_in_executor(None, codecs.preload, self.compression)
        self._reaper = asyncio.create_task(self._reap_idle_sessions())
        self.batches.start()

    async def drain(self, grace: float) -> None:
        """Stop taking sessions, give open ones ``grace`` seconds to finish, then close them:
        their clients see the stream end and move the session elsewhere."""
        self.accepting = self.training.accepting = False
        deadline = time.monotonic() + grace
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for session in list(self.sessions.values()):
            self._close(session, reason="server draining")
            if session.upstream is not None:
                session.upstream.close()

    async def shutdown(self, grace: float = 0.0) -> None:
        """Drain, then stop the reaper, the scheduler and the compute thread."""
        await self.drain(grace)
        self._reaper.cancel()
        self.batches.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- session streams: dispatch -----------------------------------------------------------

    async def _serve_session(self, upstream: MessageStream) -> None:
        """One upstream stream: at most one session, then its runs, cancels and offers; or looped runs
        from a tail. A refused message is answered with an ErrorReply and the stream goes on."""
        session: Optional[ServerSession] = None
        downstream: Optional[MessageStream] = None
        try:
            while True:
                message: Optional[Message] = None
                try:
                    received = await self._receive(upstream, session)
                    if received is None:
                        return  # the client or previous server closed the stream, or died (or sat idle)
                    message = received.message
                    if isinstance(message, OpenSession):
                        if session is not None:
                            raise ProtocolError(ErrorCode.SESSION_EXISTS, "this stream already has a session")
                        session, downstream = await self._open(message, upstream, received.tensors)
                    elif isinstance(message, CloseSession):
                        return
                    else:
                        await self._dispatch(message, received.tensors, upstream, session, downstream)
                except ProtocolError as e:
                    await self._report(upstream, session, e, getattr(message, "run_id", None))
        finally:
            if session is not None:
                self._close(session, reason="upstream closed")
            if downstream is not None:
                downstream.close()

    async def _receive(self, upstream: MessageStream, session: Optional[ServerSession]):
        """The stream's next message; None at its end, or when a stream that holds nothing yet sat for
        limits.SESSIONLESS_TIMEOUT (it is told why)."""
        if session is not None:
            return await upstream.receive()
        try:
            return await asyncio.wait_for(upstream.receive(), self.sessionless_timeout)
        except asyncio.TimeoutError:
            why = f"no OpenSession within {self.sessionless_timeout:.0f} s: closing the stream"
            await self._report(upstream, None, ProtocolError(ErrorCode.BAD_REQUEST, why), None)
            return None

    async def _dispatch(
        self,
        message: Message,
        tensors: list[torch.Tensor],
        upstream: MessageStream,
        session: Optional[ServerSession],
        downstream: Optional[MessageStream],
    ) -> None:
        """A message other than OpenSession and CloseSession: a looped run, or one for this stream's session."""
        if isinstance(message, LoopedRun):  # from a tail, on a stream of its own
            return await self._take_looped_run(message, upstream)
        if session is None or session.closed or getattr(message, "session_id", None) != session.session_id:
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"session {getattr(message, 'session_id', None)!r} is not open on this stream",
            )
        if isinstance(message, Step):
            self._enqueue(session, message, tensors)
        elif isinstance(message, Cancel):
            await self._cancel(session, message, downstream)
        elif isinstance(message, DraftOffer):
            admission.check_offer(message, session.hop_index, self.span.vocab_size)
            session.offer = message  # the client's drafts for this run's verdicts (the latest offer only)
            session.touch()
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {type(message).__name__}")

    # ---- opening a session --------------------------------------------------------------------

    async def _open(
        self, message: OpenSession, upstream: MessageStream, tensors: Sequence[torch.Tensor] = ()
    ) -> tuple[ServerSession, Optional[MessageStream]]:
        """Admit a session (server/admission.py), reserve its cache, open it on the next hop, start its worker."""
        address = self.address_caps.key_of(upstream)
        owner = self._admit(message, upstream.peer_id.to_base58(), address)
        address = address if owner is not None else None  # a forwarding server carries many machines' sessions
        tensors, deep = deep_prompts.split_open(
            message, tensors, self.span.hidden_shape, self.max_positions_per_step, self.span.num_blocks
        )
        prompts = admission.check_prompts(message, tensors, self.span.hidden_shape, self.max_positions_per_step)
        adapter = check_adapter(message.active_adapter, self.span.lora)
        if not self.budget.reserve(message.session_id, message.max_length, owner, address):
            raise ProtocolError(
                ErrorCode.BUSY,
                f"no cache room for max_length={message.max_length}: {self.budget.free_tokens} of "
                f"{self.budget.total_tokens} tokens free",
            )
        session = ServerSession(
            message.session_id, message.max_length, message.route, message.hop_index, self.span.new_cache()
        )
        session.upstream = upstream
        session.secret_hash, session.prompts, session.adapter = message.secret_hash, prompts, adapter
        session.requester = Requester(upstream.peer_id.to_base58(), address)  # until its client subscribes
        deep_prompts.keep(session, deep)
        downstream = await self._chain(session, upstream)
        self.open_sessions.add(session, address)  # a tail's unread results count against the opener's address
        session.worker = asyncio.create_task(self._run_session(session, downstream))
        self.stats["sessions_opened"] += 1
        logger.info(
            f"Opened session {session.session_id} (blocks {session.hop.start}:{session.hop.end}, "
            f"max_length {session.max_length}, hop {session.hop_index + 1}/{len(session.route)})"
        )
        # quietly: if the opener is already gone, the stream's end closes the session at once
        await send_quietly(upstream, SessionOpened(session_id=session.session_id))
        return session, downstream

    def _admit(self, message: OpenSession, upstream_peer: str, address: Optional[str] = None) -> Optional[str]:
        """Refuse a session this server may not open; else whom it counts against (admission.cap_owner)."""
        span = self.span
        admission.check_route(
            message, self.peer_id, admission.HeldBlocks(span.start, span.end, span.num_blocks), self.accepting
        )
        admission.check_upstream(message, upstream_peer)
        admission.check_new_session_id(message.session_id, self.sessions.keys() | self.open_sessions.opening)
        owner = admission.cap_owner(message, upstream_peer, self.known_servers)
        caps = admission.SessionCaps(
            self.max_sessions,
            self.max_session_tokens,
            self.max_sessions_per_peer,
            self.max_peer_tokens,
            self.budget.total_tokens,
        )
        owner_holds = self.budget.held_by(owner) if owner is not None else (0, 0)
        admission.check_session_caps(message, owner, self.open_sessions.held(), owner_holds, caps)
        if owner is not None and address is not None:  # one machine's peer ids together (server/address_caps.py)
            held = self.budget.held_by_address(address)
            self.address_caps.check(address, held, message.max_length, self.max_sessions, self.budget.total_tokens)
        return owner

    async def _chain(self, session: ServerSession, upstream: MessageStream) -> Optional[MessageStream]:
        """Open the session on the next hop, if any, and relay its reports upstream; on failure the
        session's cache reservation is released."""
        downstream = None
        self.open_sessions.opening.add(session.session_id)  # the same id on another stream, meanwhile: session_exists
        try:
            if session.next_hop is not None:
                # the next hop may sit behind NAT: dial it through its relays (remembered only now,
                # once the OpenSession is authorised and admitted: nothing before changes our state)
                relay.remember(session.next_hop.peer_id, session.next_hop.addrs)
                downstream = await self._open_downstream(session)
                asyncio.create_task(next_hop.relay_reports(downstream, upstream, session, self.stats, self.peer_id))
        except BaseException:
            self.budget.release(session.session_id)
            raise
        finally:
            self.open_sessions.opening.discard(session.session_id)
        return downstream

    async def _open_downstream(self, session: ServerSession) -> MessageStream:
        """The session's stream to its next hop (a method: tests/kit/faults.py wraps it)."""
        return await next_hop.open_downstream(self.p2p, session)

    # ---- runs arriving ----------------------------------------------------------------------

    def _enqueue(self, session: ServerSession, step: Step, tensors: list[torch.Tensor]) -> None:
        """Check a run on arrival and queue it for the session's worker (a method: tests/kit/faults.py wraps it)."""
        admission.check_step_frame(step, len(tensors), session.queue.qsize(), self.max_positions_per_step)
        hidden = tensors[0] if tensors else None
        session.check_step(step, hidden, self.span)
        session.accept(step)
        session.touch()
        session.queue.put_nowait(QueuedRun(step, hidden))

    async def _take_looped_run(self, message: LoopedRun, tail: MessageStream) -> None:
        """The head's side of a looped run: only the route's tail may start one (server/looped_runs.py)."""
        step = message.step
        session = self.sessions.get(step.session_id)
        admission.check_looped_sender(session, step, tail.peer_id.to_base58())
        try:
            self._admit_looped_run(session, message)
        except ProtocolError as e:  # the client waits for this run: tell it on the stream it opened
            await self._report(session.upstream, session, e, step.run_id)

    async def _cancel(self, session: ServerSession, cancel: Cancel, downstream: Optional[MessageStream]) -> None:
        """Drop the run and every later one; forward after any data already sent downstream."""
        trim_to = session.cancel_from(cancel.run_id, self.stats)
        if trim_to is not None:  # no server keeps positions of cancelled runs
            session.queue.put_nowait(QueuedTrim(trim_to))
        session.touch()
        if downstream is not None:
            await send_quietly(downstream, cancel)

    # ---- errors and closing -----------------------------------------------------------------

    async def _report_run(self, session: ServerSession, error: ProtocolError, run_id: int) -> None:
        """A run failed here: the tail tells the client directly, others tell their upstream."""
        reply = ErrorReply(
            session_id=session.session_id, code=error.code, message=error.message, run_id=run_id, peer_id=self.peer_id
        )
        if session.next_hop is None:
            await self.results.post(session, reply)
        else:
            await send_quietly(session.upstream, reply)

    async def _report(
        self, upstream: MessageStream, session: Optional[ServerSession], error: ProtocolError, run_id: Optional[int]
    ) -> None:
        """Refuse a request on the stream it came on, naming this server unless the error names another. A
        spent compile budget at the tail goes to the client's own results stream instead: the one stream no
        other hop writes to, so the client believes it only there (a relayed one is forged: docs/reliability.md)."""
        at_tail = session is not None and session.next_hop is None and run_id is not None
        if error.code == ErrorCode.COMPILE_BUDGET and at_tail:
            return await self._report_run(session, error, run_id)
        await report(upstream, session.session_id if session is not None else "", error, run_id, self.peer_id)

    def _close(self, session: ServerSession, reason: str) -> None:
        """Close a session (server/open_sessions.py frees what it holds)."""
        self.open_sessions.close(session, reason)

    async def _reap_idle_sessions(self) -> None:
        """Close sessions idle for more than ``session_timeout``: their clients are gone."""
        while True:
            await asyncio.sleep(min(30.0, self.session_timeout / 4))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_active > self.session_timeout:
                    self._close(session, reason=f"idle for more than {self.session_timeout:.0f} s")

    # ---- pings and results streams ----------------------------------------------------------

    async def _serve_ping(self, peer: MessageStream) -> None:
        """Answer one Ping with a Pong carrying how many sessions are open here."""
        try:
            received = await asyncio.wait_for(peer.receive(), 10)
        except (asyncio.TimeoutError, ProtocolError):
            return
        if received is not None and isinstance(received.message, Ping):
            await send_quietly(peer, Pong(received.message.nonce, len(self.sessions)))

    async def _serve_results(self, client: MessageStream) -> None:
        """One client's results stream (tail only): server/subscribe.py, under this server's session caps."""
        address = self.address_caps.key_of(client)
        most = self.address_caps.most_sessions(self.max_sessions)
        await self.subscriptions.serve(client, self.max_sessions, self.max_sessions_per_peer, address, most)
