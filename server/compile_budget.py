"""The tail's ration of fresh constraint compiles, per requester (docs/design.md, "Constraints at the tail").

Compiling a large JSON schema takes CPU seconds, so a tail counts the compiles that miss its cache.
One server-wide count would let one stranger sending many distinct schemas spend every other
client's share; so the count is kept per requesting peer *and* per its source address (a peer id
costs nothing, an address does: server/address_caps.py), at most ``per_peer`` and ``per_address`` per
window, with a server-wide ``total`` behind them as the backstop against many addresses (the
server's ``--compile-budget-per-peer``, ``--compile-budget-per-address`` and ``--compile-budget-total``).
Past any of them the run is refused with its own error code, ``compile_budget`` (protocol v9), which the client and the
gateway turn into a message naming the budget; sessions reusing a cached constraint never count.

Who requests: the client that holds the session's secret (its Subscribe to the tail's results,
server/subscribe.py), or, before that, whoever opened the session here (server/handler.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, NamedTuple, Optional

from protocol.errors import ErrorCode, ProtocolError

PER_PEER = 16  # fresh compiles per requesting peer per window (--compile-budget-per-peer)
PER_ADDRESS = 16  # fresh compiles per source address group per window, any peer ids (--compile-budget-per-address)
TOTAL = 64  # fresh compiles per window on this tail, whoever asks (--compile-budget-total)
WINDOW_S = 60.0
MAX_KEYS = 4096  # requesters remembered at once (stale ones are dropped first)


class Requester(NamedTuple):
    """Whom a session's compiles count against: a peer id and the source address its connection
    came from (None: loopback, exempt as in the address caps, or not known)."""

    peer_id: str
    address: Optional[str] = None


class CompileBudget:
    """Counts fresh compiles in a sliding window per peer, per address and in total."""

    def __init__(
        self,
        per_peer: int = PER_PEER,
        per_address: int = PER_ADDRESS,
        total: int = TOTAL,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        check_limits(per_peer, per_address, total)
        if not window_s > 0:
            raise ValueError(f"the compile budget's window must be positive, got {window_s}")
        self.per_peer, self.per_address, self.total = per_peer, per_address, total
        self.window_s, self._clock = window_s, clock
        self._spent: dict[str, deque[float]] = {}
        self._lock = threading.Lock()  # compiles run in the worker's executor threads

    def spend(self, requester: Optional[Requester]) -> None:
        """Count one fresh compile for ``requester``; ProtocolError (compile_budget) naming the budget it
        would pass, and nothing counted then."""
        keys = ["*"]
        if requester is not None:
            keys.append(f"peer {requester.peer_id}")
            if requester.address is not None:
                keys.append(f"address {requester.address}")
        with self._lock:
            now = self._clock()
            for key in keys:
                spent = self._fresh(key, now)
                limit = self._limit(key)
                if len(spent) >= limit:
                    whom = "on this tail" if key == "*" else f"for {key}"
                    raise ProtocolError(
                        ErrorCode.COMPILE_BUDGET,
                        f"constraint compile budget spent: {limit} new constraints per {self.window_s:g} s {whom}; "
                        "reuse a constraint (cached ones are free) or retry later",
                    )
            for key in keys:
                self._spent.setdefault(key, deque()).append(now)
            if len(self._spent) > MAX_KEYS:
                self._forget_stale(now)

    def _limit(self, key: str) -> int:
        if key == "*":
            return self.total
        return self.per_peer if key.startswith("peer ") else self.per_address

    def _fresh(self, key: str, now: float) -> deque[float]:
        spent = self._spent.get(key, deque())
        while spent and now - spent[0] >= self.window_s:
            spent.popleft()
        return spent

    def _forget_stale(self, now: float) -> None:
        """Drop requesters with nothing in the window; if all are fresh, the oldest ones."""
        for key in [k for k in self._spent if not self._fresh(k, now)]:
            del self._spent[key]
        while len(self._spent) > MAX_KEYS:
            oldest = min((k for k in self._spent if k != "*"), key=lambda k: self._spent[k][-1])
            del self._spent[oldest]


def check_limits(per_peer: int, per_address: int, total: int) -> None:
    """Refuse a budget that cannot work, naming the server flag: each limit a whole number >= 1 (0 would
    refuse every constraint not already compiled, which no client could tell from a spent budget)."""
    for flag, value in (
        ("--compile-budget-per-peer", per_peer),
        ("--compile-budget-per-address", per_address),
        ("--compile-budget-total", total),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}")
