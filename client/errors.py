"""What can go wrong for a client, as one tree of exceptions:

    SwarmError
    ├── RoutingError            no chain of servers covers the model (names the missing blocks)
    ├── ServerError             a server failed or refused; ``peer_id`` and ``code`` say which and why
    │   ├── ServerTimeout       no answer in time
    │   ├── ServerRejected      the server refused the request (bad input, busy, ...)
    │   └── RouteFault          the route misbehaved, no single hop provably (a verdict on a Step
    │                           or a run the client did not send, outputs unasked or missing, a
    │                           refused secret, a hop's refusal of what the head accepted): failover
    │                           avoids the whole route
    ├── GenerationError         failover gave up after its retries; ``__cause__`` is the last failure
    └── UnconfirmedTokensError  ``audit="required"``: some tokens no second tail confirmed

    UnconfirmedTokensWarning    (a UserWarning) a generation returned tokens no second tail confirmed

Retryable server failures (busy, unreachable, dead, timed out) are handled by failover and only
reach the user as GenerationError once retries run out; requests the head refuses as invalid
are raised at once as ServerRejected, because retrying them elsewhere cannot help.

Evidence, not accusations: an error built from an ErrorReply is ``hearsay`` (its ``peer_id`` is
what some route member says; the client cannot tell which member wrote it, as replies are relayed
hop by hop). Failover excludes a server only on what the client saw itself: its own failed dial
or send, a stream it opened that broke, a ping it sent unanswered, a malformed verdict on the
tail's own stream, an audit conviction. Hearsay makes the client check (ping the route) instead.
A tail's ``compile_budget`` counts only on the tail's own results stream (client/_remote_session.py);
relayed up the route it is a RouteFault.
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
    def __init__(self, message: str, peer_id: str = "", code: ErrorCode = ErrorCode.INTERNAL, *, hearsay: bool = False):
        super().__init__(f"{message} (server {peer_id or 'unknown'})")
        self.peer_id, self.code = peer_id, code
        self.hearsay = hearsay  # peer_id is a route member's claim, not what this client saw

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES


class ServerTimeout(ServerError):
    pass


class ServerRejected(ServerError):
    pass


class RouteFault(ServerError):
    @property
    def retryable(self) -> bool:
        return True


class GenerationError(SwarmError):
    pass


class UnconfirmedTokensError(SwarmError):
    """``audit="required"``: the generation would return tokens that no independent or trusted second
    tail confirmed (docs/reliability.md, "What is confirmed"); ``stats`` says how many and why."""

    def __init__(self, message: str, stats=None):
        super().__init__(message)
        self.stats = stats


class UnconfirmedTokensWarning(UserWarning):
    """A generation returned tokens that no independent or trusted second tail confirmed."""


class UnconfirmedOutputsError(UnconfirmedTokensError):
    """``audit="required"``: a forward pass's logits (or prompt log-probs) were not confirmed by an
    independent or trusted second route (docs/reliability.md, "Forward passes and log-probs")."""


class UnconfirmedOutputsWarning(UnconfirmedTokensWarning):
    """A forward pass returned logits that its audit could not confirm (client/_output_audits.py)."""
