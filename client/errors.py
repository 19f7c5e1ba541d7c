"""What can go wrong for a client, as one tree of exceptions:

    SwarmError
    ├── RoutingError            no chain of servers covers the model (names the missing blocks)
    ├── ServerError             a server failed or refused; ``peer_id`` and ``code`` say which and why
    │   ├── ServerTimeout       no answer in time
    │   └── ServerRejected      the server refused the request (bad input, busy, ...)
    └── GenerationError         failover gave up after its retries; ``__cause__`` is the last failure

Retryable server failures (busy, unreachable, dead, timed out) are handled by failover and only
reach the user as GenerationError once retries run out; requests the swarm refuses as invalid
are raised at once as ServerRejected, because retrying them elsewhere cannot help.
"""

from __future__ import annotations

from typing import Optional

from protocol.errors import RETRYABLE_CODES, ErrorCode


class SwarmError(Exception):
    pass


class RoutingError(SwarmError):
    def __init__(self, message: str, missing_blocks: Optional[list[int]] = None):
        super().__init__(message)
        self.missing_blocks = missing_blocks or []


class ServerError(SwarmError):
    def __init__(self, message: str, peer_id: str = "", code: ErrorCode = ErrorCode.INTERNAL):
        super().__init__(f"{message} (server {peer_id or 'unknown'})")
        self.peer_id, self.code = peer_id, code

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES


class ServerTimeout(ServerError):
    pass


class ServerRejected(ServerError):
    pass


class GenerationError(SwarmError):
    pass
