"""The tail's results on their way to the client, within the unread bounds.

A run's verdict (and a forward pass's outputs before it) goes into its session's results queue,
which the client's results stream reads (server/subscribe.py). server/unread.py says why each bound
is what it is: more than MAX_UNREAD_RESULTS messages unread closes the session; over its byte share
the session waits for its client to read (its worker computes nothing meanwhile) and closes after
``wait`` seconds; over the server's byte budget, the session holding the most unread bytes closes.
Each session closed here is told why (queue_full) on its upstream stream.
"""

from __future__ import annotations

import asyncio
from typing import Any

from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from server.open_sessions import OpenSessions
from server.replies import report
from server.session import ServerSession
from server.unread import largest, size_of

CLOSE_AFTER_REPORT_SECONDS = 1.0


class TailResults:
    """Posts a session's results to its queue, closing sessions that leave too much unread."""

    def __init__(self, open_sessions: OpenSessions, peer_id: str, max_unread_bytes: int):
        self.open_sessions, self.peer_id = open_sessions, peer_id
        self.max_session_bytes = max_unread_bytes // limits.UNREAD_SESSION_SHARE
        self.wait = limits.UNREAD_WAIT_SECONDS

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
        await self._make_room(session, size)
        if not session.closed:
            queue.post(item, size)

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
