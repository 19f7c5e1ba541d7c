"""The streams a server serves: sessions (from a client or the previous server) and results.

Data path of one run through this server, top to bottom:
  1) ``_serve_session`` reads a Step (+ activations) from the upstream stream and checks it;
  2) the session's worker (``_run_session``) computes it in the compute thread, in run order;
  3) a middle server pushes the Step and its output activations to the next server's stream;
     the tail puts the StepResult on the results stream the client opened.
Errors found here go back upstream on the session stream (each server relays what its
downstream reports), so the client hears about every failure on the stream it opened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
from hivemind.p2p import P2P, PeerID

from protocol import compression as codecs
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    Cancel,
    CloseSession,
    ErrorReply,
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
from server.cache_budget import CacheBudget
from server.session import QueuedRun, QueuedTrim, ServerSession, TailReply, compute_run
from swarm.streams import PING_PROTOCOL, RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream, serve

logger = logging.getLogger(__name__)

DOWNSTREAM_OPEN_TIMEOUT = 30.0
SUBSCRIBE_TIMEOUT = 60.0


class SessionHandler:
    def __init__(
        self,
        p2p: P2P,
        span: SpanAdapter,
        budget: CacheBudget,
        *,
        session_timeout: float = 600.0,
        compression: str = codecs.LOSSLESS,  # protocol.compression codec of the activations sent on
        block_delay: float = 0.0,
    ):
        self.p2p, self.span, self.budget = p2p, span, budget
        self.peer_id = p2p.peer_id.to_base58()
        self.session_timeout = session_timeout
        self.compression = compression
        self.block_delay = block_delay
        self.sessions: dict[str, ServerSession] = {}
        self._results: dict[str, asyncio.Queue[Optional[Message]]] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="span-compute")
        self.accepting = True
        self.stats = {"runs": 0, "cancelled_runs": 0, "sessions_opened": 0, "accepted_tokens": 0,
                      "cancelled_queued": 0, "cancelled_running": 0, "cancelled_computed": 0}  # fmt: skip

    async def start(self) -> None:
        await serve(self.p2p, SESSION_PROTOCOL, self._serve_session)
        await serve(self.p2p, RESULTS_PROTOCOL, self._serve_results)
        await serve(self.p2p, PING_PROTOCOL, self._serve_ping)
        # bitsandbytes takes seconds to import: not on the first run's path
        asyncio.get_running_loop().run_in_executor(None, codecs.preload, self.compression)
        self._reaper = asyncio.create_task(self._reap_idle_sessions())

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
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- session streams -------------------------------------------------------------------

    async def _serve_session(self, upstream: MessageStream) -> None:
        session: Optional[ServerSession] = None
        downstream: Optional[MessageStream] = None
        try:
            while True:
                message: Optional[Message] = None
                try:
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
                    elif session is None or getattr(message, "session_id", None) != session.session_id:
                        raise ProtocolError(
                            ErrorCode.UNKNOWN_SESSION,
                            f"session {getattr(message, 'session_id', None)!r} is not open on this stream",
                        )
                    elif isinstance(message, Step):
                        self._enqueue(session, message, received.tensors)
                    elif isinstance(message, Cancel):
                        await self._cancel(session, message, downstream)
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
        if message.session_id in self.sessions:
            raise ProtocolError(ErrorCode.SESSION_EXISTS, f"session {message.session_id} is already open here")
        if not self.budget.reserve(message.session_id, message.max_length):
            raise ProtocolError(
                ErrorCode.BUSY,
                f"no cache room for max_length={message.max_length}: {self.budget.free_tokens} of "
                f"{self.budget.total_tokens} tokens free",
            )
        session = ServerSession(
            message.session_id, message.max_length, message.route, message.hop_index, self.span.new_cache()
        )
        session.upstream = upstream
        downstream = None
        try:
            if session.next_hop is not None:
                downstream = await self._open_downstream(session)
                asyncio.create_task(self._relay_reports(downstream, upstream, session))
        except BaseException:
            self.budget.release(session.session_id)
            raise
        self.sessions[session.session_id] = session
        session.worker = asyncio.create_task(self._run_session(session, downstream))
        self.stats["sessions_opened"] += 1
        logger.info(
            f"Opened session {session.session_id} (blocks {session.hop.start}:{session.hop.end}, "
            f"max_length {session.max_length}, hop {session.hop_index + 1}/{len(session.route)})"
        )
        await upstream.send(SessionOpened(session_id=session.session_id))
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
        if not self.accepting:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "this server is shutting down")

    async def _open_downstream(self, session: ServerSession) -> MessageStream:
        next_hop = session.next_hop
        try:
            stream = await asyncio.wait_for(
                MessageStream.open(self.p2p, PeerID.from_base58(next_hop.peer_id), SESSION_PROTOCOL),
                DOWNSTREAM_OPEN_TIMEOUT,
            )
            await stream.send(
                OpenSession(
                    session_id=session.session_id,
                    max_length=session.max_length,
                    route=session.route,
                    hop_index=session.hop_index + 1,
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
        """Pass what the next server reports (errors) back upstream; report if it dies."""
        while True:
            try:
                received = await downstream.receive()
            except ProtocolError:
                continue
            if received is None:
                break
            await _send_quietly(upstream, received.message)
        if not session.closed:
            error = ProtocolError(
                ErrorCode.DOWNSTREAM_FAILED, f"next server {session.next_hop.peer_id} dropped the session"
            )
            await self._report(upstream, session, error, None, peer_id=session.next_hop.peer_id)

    def _enqueue(self, session: ServerSession, step: Step, tensors: list[torch.Tensor]) -> None:
        hidden = tensors[0] if tensors else None
        session.check_step(step, hidden, self.span)
        session.accept(step)
        session.touch()
        session.queue.put_nowait(QueuedRun(step, hidden))

    async def _cancel(self, session: ServerSession, cancel: Cancel, downstream: Optional[MessageStream]) -> None:
        """Drop the run and every later one; forward after any data already sent downstream."""
        trim_to = session.cancel_from(cancel.run_id, self.stats)
        if trim_to is not None:  # no server keeps positions of cancelled runs
            session.queue.put_nowait(QueuedTrim(trim_to))
        session.touch()
        if downstream is not None:
            await _send_quietly(downstream, cancel)

    async def _run_session(self, session: ServerSession, downstream: Optional[MessageStream]) -> None:
        loop = asyncio.get_running_loop()
        while (run := await session.queue.get()) is not None:
            if isinstance(run, QueuedTrim):
                session.trim(self.span, min(run.length, self.span.cache_length(session.cache)))
                continue
            if run.cancelled:
                self.stats["cancelled_runs"] += 1
                continue
            session.running = run
            try:
                output = await loop.run_in_executor(
                    self._executor, compute_run, self.span, session, run, self.block_delay
                )
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
                    self._results_queue(session.session_id).put_nowait(frame)
                output = output.result
            if isinstance(output, StepResult):
                self.stats["accepted_tokens"] += output.accepted + 1
                self._results_queue(session.session_id).put_nowait(output)
            else:
                await _send_quietly(downstream, run.step, [output], self.compression)

    async def _report_run(self, session: ServerSession, error: ProtocolError, run_id: int) -> None:
        """A run failed here: the tail tells the client directly, others tell their upstream."""
        reply = ErrorReply(
            session_id=session.session_id, code=error.code, message=error.message, run_id=run_id, peer_id=self.peer_id
        )
        if session.next_hop is None:
            self._results_queue(session.session_id).put_nowait(reply)
        else:
            await _send_quietly(session.upstream, reply)

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
        if session.running is not None:
            session.running.cancelled = True
        session.queue.put_nowait(None)
        self.budget.release(session.session_id)
        self.sessions.pop(session.session_id, None)
        results = self._results.pop(session.session_id, None)
        if results is not None:
            results.put_nowait(None)
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

    def _results_queue(self, session_id: str) -> "asyncio.Queue[Optional[Message]]":
        return self._results.setdefault(session_id, asyncio.Queue())

    async def _serve_results(self, client: MessageStream) -> None:
        try:
            first = await asyncio.wait_for(client.receive(), SUBSCRIBE_TIMEOUT)
        except (asyncio.TimeoutError, ProtocolError) as e:
            await _send_quietly(client, ErrorReply(session_id="", code=ErrorCode.BAD_REQUEST, message=str(e)))
            return
        if first is None:
            return
        if not isinstance(first.message, Subscribe):
            error = ErrorReply(session_id="", code=ErrorCode.BAD_REQUEST, message="expected Subscribe")
            await _send_quietly(client, error)
            return
        session_id = first.message.session_id
        queue = self._results_queue(session_id)
        closed = asyncio.create_task(client.receive())  # returns when the client goes away
        try:
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, closed}, timeout=SUBSCRIBE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if closed in done or session_id not in self.sessions:
                        return  # client gone, or a subscription for a session that never opened
                    continue
                item = getter.result()
                if item is None:
                    return
                if isinstance(item, tuple):  # (RunOutputs, its tensors)
                    await client.send(*item)
                else:
                    await client.send(item)
        finally:
            closed.cancel()
            if session_id not in self.sessions:
                self._results.pop(session_id, None)


async def _send_quietly(stream: Optional[MessageStream], message: Message, tensors=(), codec=codecs.LOSSLESS) -> None:
    """Send, ignoring a peer that is already gone (its own stream end reports that)."""
    if stream is None:
        return
    try:
        await stream.send(message, tensors, codec)
    except (ConnectionError, OSError, RuntimeError) as e:
        logger.debug(f"Could not send {type(message).__name__} to {stream.peer_id}: {e!r}")
