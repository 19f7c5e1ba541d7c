"""A client's results stream at the tail: the Subscribe that authorises it, then the session's results.

The client opens this stream before it opens the session through the head, so its first message, a
Subscribe carrying the secret whose sha256 the session was opened with, may arrive before the session
does: it then waits, bounded, for the session to open here. At most max_sessions Subscribes wait at
once (max_sessions_per_peer per peer, and the address share of max_sessions per source address:
server/address_caps.py), each at most ``timeout`` seconds, so waiting Subscribes cannot pile up.
Once authorised (server/admission.py, ``check_subscriber``), the session's results go out in order
until the client or the session goes away.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, Subscribe
from protocol.streams import MessageStream
from server.admission import check_subscriber, subscribe_slot_refusal
from server.compile_budget import Requester
from server.open_sessions import OpenSessions
from server.replies import send_quietly
from server.session import ServerSession, Verdict

logger = logging.getLogger(__name__)

Subscribed = tuple[ServerSession, Subscribe, "asyncio.Task"]  # the session, its Subscribe, the client's end


class Subscriptions:
    """The tail's results streams: Subscribes waiting for their sessions, and results going out."""

    def __init__(self, open_sessions: OpenSessions, peer_id: str):
        self.open_sessions, self.peer_id = open_sessions, peer_id
        self.timeout = limits.SUBSCRIBE_TIMEOUT
        self.pending: dict[str, int] = {}  # peer id -> its Subscribes waiting for their session
        self.pending_by_address: dict[str, int] = {}  # source address -> its peers' Subscribes waiting

    async def serve(
        self,
        client: MessageStream,
        max_sessions: int,
        max_per_peer: int,
        address: Optional[str] = None,
        max_per_address: int = 0,
    ) -> None:
        """One client's results stream: a Subscribe, within the pending caps, then its results.
        ``address``: the source address the caps count it under (None: per peer only)."""
        peer = client.peer_id.to_base58()
        refusal = subscribe_slot_refusal(peer, self.pending, max_sessions, max_per_peer)
        waiting = self.pending_by_address.get(address, 0) if address is not None else 0
        if refusal is None and address is not None and waiting >= max_per_address:
            refusal = f"address {address} already has {waiting} Subscribes waiting here (at most {max_per_address})"
        if refusal is not None:
            logger.info(f"Refused a Subscribe from {peer}: {refusal}")
            await send_quietly(
                client, ErrorReply(session_id="", code=ErrorCode.BUSY, message=refusal, peer_id=self.peer_id)
            )
            await _linger(client)
            return
        self.pending[peer] = self.pending.get(peer, 0) + 1
        if address is not None:
            self.pending_by_address[address] = waiting + 1
        try:
            subscribed = await self._subscribed_session(client, address)
        finally:
            left = self.pending.pop(peer) - 1
            if left:
                self.pending[peer] = left
            if address is not None:
                self.pending_by_address[address] -= 1
                if not self.pending_by_address[address]:
                    del self.pending_by_address[address]
        if subscribed is not None:
            await self._send_results(client, *subscribed, address)

    async def _subscribed_session(self, client: MessageStream, address: Optional[str] = None) -> Optional[Subscribed]:
        """(session, its Subscribe, the task that ends when the client goes away) once a valid
        Subscribe names a session open here; None (the client told why) otherwise. The subscriber
        (it holds the session's secret: the client) becomes the session's requester, whose budget
        its constraint compiles spend (server/compile_budget.py), from wherever its route came in."""
        subscribe = await self._first_subscribe(client)
        if subscribe is None:
            return None
        closed = asyncio.create_task(client.receive())  # returns when the client goes away
        try:
            session = await self.open_sessions.wait_for(subscribe.session_id, closed, self.timeout)
            if session is None:
                return _forget(closed)  # the client went away, or the session never opened here
            refusal = check_subscriber(session, subscribe)
            if refusal is not None:
                logger.info(f"Refused a Subscribe to {session.session_id} from {client.peer_id}: {refusal}")
                error = ErrorReply(
                    session_id=subscribe.session_id, code=ErrorCode.UNAUTHORIZED, message=refusal, peer_id=self.peer_id
                )
                await send_quietly(client, error)
                return _forget(closed)
            session.requester = Requester(client.peer_id.to_base58(), address)
        except BaseException:
            _forget(closed)
            raise
        return session, subscribe, closed

    async def _first_subscribe(self, client: MessageStream) -> Optional[Subscribe]:
        """The stream's first message if it is a Subscribe in time; None (the client told why) if not."""
        try:
            first = await asyncio.wait_for(client.receive(), self.timeout)
        except (asyncio.TimeoutError, ProtocolError) as e:
            code = e.code if isinstance(e, ProtocolError) else ErrorCode.BAD_REQUEST
            await send_quietly(client, ErrorReply(session_id="", code=code, message=str(e) or "no Subscribe in time"))
            return None
        if first is None:
            return None
        if not isinstance(first.message, Subscribe):
            await send_quietly(
                client, ErrorReply(session_id="", code=ErrorCode.BAD_REQUEST, message="expected Subscribe")
            )
            return None
        return first.message

    async def _send_results(
        self,
        client: MessageStream,
        session: ServerSession,
        subscribe: Subscribe,
        closed: "asyncio.Task",
        address: Optional[str] = None,
    ) -> None:
        """The session's results, in order, to its client, until either goes away; what it leaves
        unread counts against its ``address`` from now on (server/unread.py)."""
        try:
            session.subscribed = True
            queue = self.open_sessions.results.get(session.session_id)
            if queue is None:
                return  # the session closed meanwhile
            if address is not None:
                queue.address = address
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait(
                    {getter, closed}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if getter not in done:
                    getter.cancel()
                    if closed in done or session.closed:
                        return  # client gone, or the session closed
                    continue
                item = getter.result()
                if isinstance(item, Verdict):
                    item = item.sealed(subscribe.secret)  # the secret it proved
                if item is None or not await _send(client, item):
                    return
        finally:
            _forget(closed)


async def _send(client: MessageStream, item: object) -> bool:
    """Send one result; False when the client went away mid-send (e.g. with a run's verdict still on
    its way after it cancelled that run): nothing to report."""
    try:
        if isinstance(item, tuple):  # (RunOutputs, its tensors)
            await client.send(*item)
        else:
            await client.send(item)
    except (ConnectionError, OSError):
        return False
    return True


def _forget(closed: "asyncio.Task") -> None:
    """Stop watching a results stream's end."""
    closed.cancel()
    if closed.done() and not closed.cancelled():
        closed.exception()  # a malformed frame after Subscribe: retrieved, nothing to report


async def _linger(client: MessageStream, seconds: float = 1.0) -> None:
    """Keep a refused stream open until the client closes it (at most ``seconds``), so the refusal is
    read before the close: a close right after the write lost it now and then on a loaded machine."""
    try:
        await asyncio.wait_for(client.receive(), seconds)
    except Exception:  # noqa: BLE001 - timeout, or a frame we refuse: the stream closes either way
        pass
