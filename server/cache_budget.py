"""The server's KV budget in tokens: a session reserves its max_length when it opens.

Reserving up front means a session never runs out of cache mid-generation; a server without
room refuses at open time with BUSY, and the client routes elsewhere. Each reservation names
its owner (the upstream peer it counts against, server/handler.py), so the handler can cap what
one peer holds: sessions and tokens per owner; and the source address the owner connects from
(server/address_caps.py), so one machine's many peer ids are capped together.
"""

from __future__ import annotations

from typing import Optional


class CacheBudget:
    def __init__(self, total_tokens: int):
        if total_tokens <= 0:
            raise ValueError(f"the cache budget must be positive, got {total_tokens} tokens")
        self.total_tokens = total_tokens
        self._reserved: dict[str, int] = {}
        self._owners: dict[str, Optional[str]] = {}  # session id -> owner (None: counted for nobody)
        self._addresses: dict[str, Optional[str]] = {}  # session id -> its owner's source address (None: uncapped)

    @property
    def free_tokens(self) -> int:
        return self.total_tokens - sum(self._reserved.values())

    def reserve(self, session_id: str, tokens: int, owner: Optional[str] = None, address: Optional[str] = None) -> bool:
        if tokens > self.free_tokens:
            return False
        self._reserved[session_id] = tokens
        self._owners[session_id] = owner
        self._addresses[session_id] = address
        return True

    def release(self, session_id: str) -> None:
        self._reserved.pop(session_id, None)
        self._owners.pop(session_id, None)
        self._addresses.pop(session_id, None)

    def held_by_address(self, address: str) -> tuple[int, int]:
        """(sessions, tokens) reserved for owners connected from ``address``."""
        mine = [self._reserved[s] for s, a in self._addresses.items() if a == address]
        return len(mine), sum(mine)

    def held_by(self, owner: str) -> tuple[int, int]:
        """(sessions, tokens) reserved for ``owner``."""
        mine = [self._reserved[s] for s, o in self._owners.items() if o == owner]
        return len(mine), sum(mine)
