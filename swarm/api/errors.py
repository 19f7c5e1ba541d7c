"""Every failure the gateway reports, in OpenAI's error shape, and how swarm errors map onto it.

{"error": {"message": "...", "type": "...", "param": "max_tokens" | null, "code": "..." | null}}

400 invalid_request_error   malformed JSON, a bad or unsupported parameter, prompt too long
401 authentication_error    missing or wrong API key
404 not_found_error         unknown model or path
429 rate_limit_error        the API key already has its limit of requests in flight; or (code
                            compile_budget) the tails' ration of new constraints for this gateway is spent
502 swarm_error             a server failed and failover gave up, or a server refused the request
503 no_route_error          no chain of servers covers the model (the missing blocks are named)
504 timeout_error           no answer from the swarm in time (the gateway's deadline or a server's)
500 internal_error          a bug in the gateway; logged here, never sent as a traceback
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from client import GenerationError, RoutingError, ServerError, ServerTimeout
from client.errors import UnconfirmedTokensError
from protocol.errors import ErrorCode

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type: str, *, param: Optional[str] = None, code: Optional[str] = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code=code)


class RetractedError(RuntimeError):
    """Tokens already streamed were replaced: a server of the route was caught returning wrong
    results (docs/reliability.md, "Spot-checks"). A stream cannot take text back, so it ends with
    this error; a buffered response is rebuilt from the tokens that stand."""


def from_exception(error: BaseException, model: str = "") -> APIError:
    """Map what generation raised to an APIError; unknown errors become a logged 500."""
    if isinstance(error, APIError):
        return error
    routing = _in_chain(error, RoutingError)
    if routing is not None:
        return APIError(503, _no_route_message(routing, model), "no_route_error", code="no_route")
    if isinstance(error, TimeoutError) or _in_chain(error, ServerTimeout) is not None:
        return APIError(504, f"the swarm did not answer in time: {error}", "timeout_error", code="timeout")
    unconfirmed = _in_chain(error, UnconfirmedTokensError)
    if unconfirmed is not None:  # the request asked for audit="required"
        return APIError(502, f"audit='required': {unconfirmed}", "swarm_error", code="tokens_unconfirmed")
    refused = _in_chain(error, ServerError)
    if refused is not None and refused.code == ErrorCode.COMPILE_BUDGET:
        message = f"too many new constraints (response_format, guided_*, tool schemas) in a short time: {refused}"
        return APIError(429, message, "rate_limit_error", code="compile_budget")
    if isinstance(error, RetractedError):
        return APIError(502, str(error), "swarm_error", code="tokens_retracted")
    if isinstance(error, (GenerationError, ServerError)):
        return APIError(502, f"the swarm failed to generate: {error}", "swarm_error", code="swarm_failed")
    if isinstance(error, ValueError):
        return bad_request(str(error))
    logger.error("Unexpected error while serving a request", exc_info=error)
    return APIError(500, f"internal error ({type(error).__name__}); see the gateway's log", "internal_error")


def _in_chain(error: BaseException, kind: type) -> Any:
    """The first exception of ``kind`` among ``error`` and its causes (failover wraps them)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _no_route_message(error: RoutingError, model: str) -> str:
    blocks = compact_ranges(error.missing_blocks)
    missing = f"no server holds blocks {blocks}" if blocks else str(error)
    return f"no route through the swarm for model {model!r}: {missing}"


def compact_ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    for block in sorted(set(blocks)):
        if parts and block == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{block}"
        else:
            parts.append(str(block))
    return ", ".join(parts)
