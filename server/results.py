"""The tail's results on their way to the client, within the unread bounds.

A run's verdict (and a forward pass's outputs before it) goes into its session's results queue,
which the client's results stream reads (server/subscribe.py). server/unread.py says why each bound
is what it is: more than MAX_UNREAD_RESULTS messages unread closes the session; over its byte share
the session waits for its client to read (its worker computes nothing meanwhile) and closes after
``wait`` seconds; over the server's byte budget, the session holding the most unread bytes closes;
over one address group's share of that budget, that address's largest holder closes.
Each session closed here is told why (queue_full) on its upstream stream.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from server.address_caps import AddressCaps
from server.open_sessions import OpenSessions
from server.replies import report
from server.session import ServerSession
from server.unread import held_by_address, largest, size_of

CLOSE_AFTER_REPORT_SECONDS = 1.0


class TailResults:
    """Posts a session's results to its queue, closing sessions that leave too much unread."""

    def __init__(
        self, open_sessions: OpenSessions, peer_id: str, max_unread_bytes: int, caps: Optional[AddressCaps] = None
    ):
        self.open_sessions, self.peer_id = open_sessions, peer_id
        self.max_session_bytes = max_unread_bytes // limits.UNREAD_SESSION_SHARE
        self.wait = limits.UNREAD_WAIT_SECONDS
        self.max_address_bytes = (caps or AddressCaps()).most_unread(max_unread_bytes)  # one address group's

    async def post(self, session: ServerSession, item: Any) -> None:
        """Queue ``item`` (a message, or a (RunOutputs, tensors) pair) for the session's client."""
        queue = self.open_sessions.results.get(session.session_id)
        if queue is None or session.closed:
            return
        if queue.qsize() >= limits.MAX_UNREAD_RESULTS:
            await self.close_unread(
                session, f"more than {limits.MAX_UNREAD_RESULTS} results unread: closing the session"
            )
            return
        size, cap = size_of(item), self.max_session_bytes
        if not await queue.room_for(size, cap, self.wait):
            await self.close_unread(
                session,
                f"{queue.bytes} bytes of results unread for {self.wait:.0f} s "
                f"(a session may hold {cap} bytes unread): closing the session",
            )
            return
        await self._address_room(session, queue.address, size)
        await self._make_room(session, size)
        if not session.closed:
            queue.post(item, size)

    async def _address_room(self, session: ServerSession, address: Optional[str], size: int) -> None:
        """Over the address group's share of the unread budget: close that address's sessions holding
        the most unread bytes until ``size`` more fit (this session among them)."""
        queues = self.open_sessions.results
        while address is not None and not session.closed:
            held = held_by_address(queues, address)
            hog = largest(queues, address)
            if held + size <= self.max_address_bytes or hog is None or hog not in self.open_sessions.sessions:
                return
            await self.close_unread(
                self.open_sessions.sessions[hog],
                f"address {address} holds {held} bytes of unread results here, {queues[hog].bytes} of them for "
                f"this session: more than its share of {self.max_address_bytes} (--max-share-per-address)",
            )

    async def _make_room(self, session: ServerSession, size: int) -> None:
        """Over the server's unread budget: close the sessions holding the most unread bytes until
        ``size`` more fit (one message always passes when nothing is unread elsewhere)."""
        ledger, queues = self.open_sessions.unread, self.open_sessions.results
        while not session.closed and ledger.total + size > ledger.max_bytes:
            hog = largest(queues)
            if hog is None or hog not in self.open_sessions.sessions:
                break
            held = queues[hog].bytes
            await self.close_unread(
                self.open_sessions.sessions[hog],
                f"this server holds more than {ledger.max_bytes} "
                f"bytes of unread results, {held} of them for this session: closing it",
            )

    async def close_unread(self, session: ServerSession, why: str) -> None:
        """Close a session whose client leaves its results unread, telling it why upstream."""
        await report(session.upstream, session.session_id, ProtocolError(ErrorCode.QUEUE_FULL, why), None, self.peer_id)
        self.open_sessions.close(session, reason="results unread")
        # the upstream stream closes a second later, so the previous hop reads the refusal before the
        # end of the stream: a close right after the write lost it now and then on a loaded machine,
        # and the hop then reported the session as dropped (as server/subscribe.py _linger does)
        asyncio.get_running_loop().call_later(CLOSE_AFTER_REPORT_SECONDS, session.upstream.close)
