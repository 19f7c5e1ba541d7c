"""The tail's results that their clients have not read yet, bounded in bytes per session and per server.

A verdict is a few bytes, but a forward pass's ``RunOutputs`` carry up to OUTPUTS_FRAME_BYTES (64 MiB)
of logits each, so counting messages does not bound memory. Each session's results wait in a
:class:`ResultQueue` that knows its bytes; a :class:`UnreadLedger` adds them up for the server.

What happens past a bound (docs/reliability.md, "Resource bounds"):
- a session over its share (``--max-unread-mib`` / UNREAD_SESSION_SHARE) *waits*: its worker posts
  nothing more, so it computes no further run, until its client reads, for at most
  UNREAD_WAIT_SECONDS; then the session closes with ``queue_full``. Waiting rather than dropping
  the oldest unread result, because a dropped verdict or logits row is a silent hole the client
  would only notice as a timeout; and rather than refusing at once, because an honest client on a
  slow link reading large outputs is then only slowed, never failed. A client that never reads
  holds at most its share, for at most the wait.
- the server's total over ``--max-unread-mib``: the session holding the most unread bytes is closed
  (``queue_full``), so many sessions cannot add up, and an honest client that reads its results
  (holding next to nothing) is never the one closed.
- one address group's total over its share (``--max-share-per-address`` of ``--max-unread-mib``;
  server/address_caps.py): that address's session holding the most unread bytes is closed, so
  one machine's many peer ids cannot take the server's budget from the others. A queue counts
  against the address its client subscribed from, or else the address that opened the session
  here (a one-hop route); a session opened through another server with no subscriber counts
  against none (the per-session and server bounds still hold).
A session with nothing unread may always queue one message, whatever its size (one frame of a
forward pass never fails here): the server's total stays under max(budget, one frame).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import msgspec

from server.session import Verdict

MESSAGE_OVERHEAD_BYTES = 256  # what a RunOutputs message adds to its tensors' bytes


def size_of(item: Any) -> int:
    """The bytes a queued result holds: a (RunOutputs, tensors) pair's tensors, else the message's encoding
    (a Verdict's: its StepResult, whose digest is sealed as it goes out)."""
    if isinstance(item, tuple):
        return MESSAGE_OVERHEAD_BYTES + sum(t.nelement() * t.element_size() for t in item[1])
    return len(msgspec.msgpack.encode(item.result if isinstance(item, Verdict) else item))


class UnreadLedger:
    """The server's unread bytes over all sessions, and the most it ever held (for tests and stats)."""

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"the unread-results budget must be positive, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.total = 0
        self.peak = 0

    def add(self, size: int) -> None:
        self.total += size
        self.peak = max(self.peak, self.total)


class ResultQueue(asyncio.Queue):
    """One session's unread results (an asyncio.Queue of messages, None ending it) with their bytes."""

    def __init__(self, ledger: UnreadLedger, address: Optional[str] = None):
        super().__init__()
        self.ledger = ledger
        self.address = address  # the address group its bytes count against (server/address_caps.py); None: none
        self.bytes = 0
        self._read = asyncio.Event()  # set whenever the client takes a result

    def post(self, item: Any, size: int) -> None:
        self.bytes += size
        self.ledger.add(size)
        self.put_nowait((item, size))

    def end(self) -> None:
        """No more results: the reader gets None; what is unread no longer counts."""
        self.ledger.total -= self.bytes
        self.bytes = 0
        self._queue.clear()
        self.put_nowait((None, 0))
        self._read.set()  # a session waiting for room stops waiting

    def _get(self) -> Any:  # asyncio.Queue's hook under get() and get_nowait()
        item, size = super()._get()
        self.bytes -= size
        self.ledger.total -= size
        self._read.set()
        return item

    async def room_for(self, size: int, cap: int, wait: float) -> bool:
        """Wait until ``size`` more bytes fit under ``cap`` (or nothing is unread); False after ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while self.bytes > 0 and self.bytes + size > cap:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._read.clear()
            try:
                await asyncio.wait_for(self._read.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True


def largest(queues: dict[str, ResultQueue], address: Optional[str] = None) -> Optional[str]:
    """The session holding the most unread bytes (of those counted against ``address``, if given), if any holds some."""
    mine = queues if address is None else {s: q for s, q in queues.items() if q.address == address}
    session_id = max(mine, key=lambda s: mine[s].bytes, default=None)
    return session_id if session_id is not None and mine[session_id].bytes > 0 else None


def held_by_address(queues: dict[str, ResultQueue], address: str) -> int:
    """Unread bytes of the sessions counted against ``address``."""
    return sum(q.bytes for q in queues.values() if q.address == address)
