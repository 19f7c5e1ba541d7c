"""Error codes a server sends back, and the exception that carries one.

Every refusal names what was wrong, so a client (or a person reading a log) can tell bad input
from a busy server from a broken peer. Codes are strings on the wire (readable in a dump), but
decoded into :class:`ErrorCode`: a reply with a code the receiver does not know fails to decode
as a whole (``malformed``), so a new code comes with a new protocol version (protocol/version.py),
which peers compare before anything else.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    MALFORMED = "malformed"  # the bytes did not decode into a known message
    VERSION_MISMATCH = "version_mismatch"  # the peer speaks another protocol version
    UNKNOWN_SESSION = "unknown_session"
    SESSION_EXISTS = "session_exists"
    RUN_ID_NOT_INCREASING = "run_id_not_increasing"
    START_POS_BEYOND_CACHE = "start_pos_beyond_cache"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    TOO_LONG = "too_long"  # more positions than the session's max_length
    BAD_REQUEST = "bad_request"  # any other invalid field
    UNKNOWN_ADAPTER = "unknown_adapter"  # a LoRA adapter this server does not serve (--adapters)
    WRONG_BLOCKS = "wrong_blocks"  # the route asks this server for blocks it does not hold
    BUSY = "busy"  # no cache room for the session's max_length
    DOWNSTREAM_FAILED = "downstream_failed"  # the next server could not be reached or failed
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"
    # v4 (hostile peers): a frame or Step larger than this server takes, a results subscription
    # without the session's secret, and a session that queued more runs or results than allowed
    FRAME_TOO_LARGE = "frame_too_large"  # the frame's declared length exceeds this protocol's limit
    STEP_TOO_LARGE = "step_too_large"  # more positions in one Step than max_positions_per_step
    # Subscribe without the session's secret; OpenSession past the head not from the previous hop
    UNAUTHORIZED = "unauthorized"
    QUEUE_FULL = "queue_full"  # too many runs queued (or results unread) in one session
    # v9: the tail's ration of fresh constraint compiles, per requesting peer and source address, is spent
    COMPILE_BUDGET = "compile_budget"


# Errors the client may cure by routing around the reporting server (failover); the others are
# the caller's fault and are raised to the user as they are. A spent compile budget is one tail's:
# another tail has its own.
RETRYABLE_CODES = frozenset(
    {ErrorCode.BUSY, ErrorCode.DOWNSTREAM_FAILED, ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL, ErrorCode.COMPILE_BUDGET}
)


class ProtocolError(Exception):
    """A peer's request or reply broke the protocol; ``code`` says how."""

    def __init__(self, code: ErrorCode, message: str, peer_id: str = ""):
        super().__init__(f"[{code.value}] {message}")
        self.code = code
        self.message = message
        self.peer_id = peer_id  # the peer at fault when it is not the one reporting (a dead next hop)
