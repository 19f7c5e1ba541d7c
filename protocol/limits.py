"""How large a frame or a Step a peer may send, derived from the model, and other per-peer caps.

A frame's length is read before its bytes, so the receiver can refuse a declared length above its
limit before allocating anything (hostile peers; docs/design.md, "Trust"). The session protocol's limit
follows from the largest Step a server takes: ``max_positions_per_step`` positions of activations
(``hidden_shape``: hidden size, times DeepSeek-V4's ``hc_mult`` hidden streams) at 4 bytes per
element (float32, the widest dtype a server sends), plus the ids and a margin. Prompts longer than
``max_positions_per_step`` go as chunked prefill (several Steps), so no honest frame is larger.
"""

from __future__ import annotations

import math
from typing import Sequence

DEFAULT_MAX_POSITIONS_PER_STEP = 512  # positions one Step may carry; longer prompts are chunked
# a server announces its own limit (ServerInfo.max_positions_per_step) and clients chunk to the smallest
# on their route; not below MIN_POSITIONS_PER_STEP, so no record can make a client crawl a prompt
# one position per Step, nor above MAX_POSITIONS_PER_STEP (a frame of that many positions stays bounded)
MIN_POSITIONS_PER_STEP = 8
MAX_POSITIONS_PER_STEP = 1 << 16
ACTIVATION_BYTES_PER_ELEMENT = 4  # float32: the widest activations a server sends
FRAME_MARGIN_BYTES = 64 * 1024  # message fields, protobuf and codec headers
CONTROL_FRAME_BYTES = 64 * 1024  # frames that carry no tensors: Subscribe, Ping, ErrorReply, ...

# caps on what one peer may hold open at a server (clear ``busy`` / ``queue_full`` errors past them)
DEFAULT_MAX_SESSIONS = 256  # open sessions per server
DEFAULT_MAX_SESSIONS_PER_PEER = 64  # open sessions per upstream peer (a client, or the previous server)
MAX_TREE_NODES = 64  # drafts in one tree run (Step.parents); a Step's positions stay under max_positions_per_step too
MAX_OFFER_OPTIONS = 16  # verdicts a DraftOffer may prepare drafts for (the client's hedges: MAX_HEDGES)
MAX_OFFER_DRAFTS = 32  # drafts per option; a looped run's positions stay under max_positions_per_step too
MAX_QUEUED_RUNS = 64  # runs received and not yet computed, per session
MAX_UNREAD_RESULTS = 256  # messages the tail holds for a session whose client does not read them


def step_tensor_elements(hidden_shape: Sequence[int], max_positions: int) -> int:
    """The most activation values one Step may carry."""
    return max_positions * math.prod(hidden_shape)


def session_frame_bytes(hidden_shape: Sequence[int], max_positions: int) -> int:
    """The largest frame on the session protocol: a Step of ``max_positions`` positions with its
    activations (up to 10 bytes of MessagePack per id)."""
    activations = ACTIVATION_BYTES_PER_ELEMENT * step_tensor_elements(hidden_shape, max_positions)
    return activations + 10 * max_positions + FRAME_MARGIN_BYTES
