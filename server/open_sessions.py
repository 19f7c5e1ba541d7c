"""The sessions open at a server, and what they hold: cache reservations and the tail's unread results.

One place opens and closes a session, so whatever closes one (its upstream going away, the idle
reaper, a drain, the unread bounds) frees the same things: its reservation in the cache budget, its
queue of unread results (server/unread.py), its stream to the head, the run it is computing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from server.cache_budget import CacheBudget
from server.session import ServerSession
from server.unread import ResultQueue, UnreadLedger

logger = logging.getLogger(__name__)


class OpenSessions:
    """Sessions by id (and the ids whose OpenSession waits for the next hop), with the tail's
    results queues under one unread ledger."""

    def __init__(self, budget: CacheBudget, max_unread_bytes: int):
        self.budget = budget
        self.sessions: dict[str, ServerSession] = {}
        self.opening: set[str] = set()  # session ids whose OpenSession waits for the next hop
        self.results: dict[str, ResultQueue] = {}  # tail: per open session
        self.unread = UnreadLedger(max_unread_bytes)  # results held for clients that have not read them
        self._opened = asyncio.Event()  # set (and replaced) whenever a session opens here

    def held(self) -> int:
        """Sessions open or opening: what max_sessions caps."""
        return len(self.sessions) + len(self.opening)

    def add(self, session: ServerSession, address: Optional[str] = None) -> None:
        """A session is open: the tail gets a results queue (counted against ``address`` until a
        client subscribes: server/unread.py); a Subscribe waiting for it wakes."""
        self.sessions[session.session_id] = session
        if session.next_hop is None:
            self.results[session.session_id] = ResultQueue(self.unread, address)
        self._opened.set()
        self._opened = asyncio.Event()

    def close(self, session: ServerSession, reason: str) -> None:
        """Close a session once: stop its worker and running run, free its cache tokens, end its
        results (what is unread no longer counts)."""
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
        results = self.results.pop(session.session_id, None)
        if results is not None:
            results.end()
        logger.info(f"Closed session {session.session_id} ({reason})")

    async def wait_for(self, session_id: str, closed: "asyncio.Task", timeout: float) -> Optional[ServerSession]:
        """The session once it is open here; None after ``timeout`` seconds or once ``closed`` is done.
        The client subscribes before it opens the session through the head, so its Subscribe waits."""
        deadline = time.monotonic() + timeout
        while (session := self.sessions.get(session_id)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or closed.done():
                return None
            opened = asyncio.create_task(self._opened.wait())
            await asyncio.wait({opened, closed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
        return session
