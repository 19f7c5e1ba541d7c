"""The server's KV budget in tokens: a session reserves its max_length when it opens.

Reserving up front means a session never runs out of cache mid-generation; a server without
room refuses at open time with BUSY, and the client routes elsewhere.
"""

from __future__ import annotations


class CacheBudget:
    def __init__(self, total_tokens: int):
        if total_tokens <= 0:
            raise ValueError(f"the cache budget must be positive, got {total_tokens} tokens")
        self.total_tokens = total_tokens
        self._reserved: dict[str, int] = {}

    @property
    def free_tokens(self) -> int:
        return self.total_tokens - sum(self._reserved.values())

    def reserve(self, session_id: str, tokens: int) -> bool:
        if tokens > self.free_tokens:
            return False
        self._reserved[session_id] = tokens
        return True

    def release(self, session_id: str) -> None:
        self._reserved.pop(session_id, None)
