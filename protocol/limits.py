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
DEFAULT_MAX_SHARE_PER_ADDRESS = 0.5  # of a server's slots and cache per client address (server/address_caps.py)
MAX_TREE_NODES = 64  # drafts in one tree run (Step.parents); a Step's positions stay under max_positions_per_step too
MAX_OFFER_OPTIONS = 16  # verdicts a DraftOffer may prepare drafts for (the client's hedges: MAX_HEDGES)
MAX_OFFER_DRAFTS = 32  # drafts per option; a looped run's positions stay under max_positions_per_step too
MAX_QUEUED_RUNS = 64  # runs received and not yet computed, per session
MAX_UNREAD_RESULTS = 256  # messages the tail holds for a session whose client does not read them

# Bytes of results the tail holds unread (server/unread.py): a RunOutputs may carry 64 MiB of logits, so a
# count alone does not bound memory. The server's budget is --max-unread-mib; one session may hold a
# quarter of it (so a few forward passes of honest clients fit together), and a session with nothing
# unread may always queue one run's outputs whatever their size (a single forward pass never fails here)
DEFAULT_MAX_UNREAD_MIB = 1024
UNREAD_SESSION_SHARE = 4  # a session holds at most 1/4 of the server's unread budget before it waits
UNREAD_WAIT_SECONDS = 60.0  # a session over its share waits this long for its client to read, then closes

# The cache a session and an upstream peer may reserve (server/handler.py): one client at most half
# of the budget, so a stranger asking for the largest max_length cannot starve the others; a session
# at most --max-session-tokens positions, by default a quarter of the budget but at least
# MIN_DEFAULT_SESSION_TOKENS (a chat's context) where the client's half holds that many
PEER_CACHE_SHARE = 2  # one upstream peer (a client) reserves at most 1/2 of the cache budget
SESSION_TOKENS_SHARE = 4
MIN_DEFAULT_SESSION_TOKENS = 2048

# Streams that hold nothing yet: a session stream must carry its OpenSession (or a LoopedRun) within
# this many seconds of the last message, and a results stream's Subscribe waits at most
# SUBSCRIBE_TIMEOUT for its session; at most max_sessions Subscribes wait at once, max_sessions_per_peer per peer
SESSIONLESS_TIMEOUT = 30.0
SUBSCRIBE_TIMEOUT = 60.0
# the most seconds a server's ready batch waits for runs of its other open sessions (server/batching.py;
# docs/benchmarks.md, "Batching sessions at a server": on an idle 2-core machine 5 ms gave 16-32
# sessions a median 1.14x the tokens/s of no window, 0.99-1.36x, and shorter laps in every cell)
DEFAULT_GATHER_WINDOW = 0.005

# Training steps (docs/design.md, "Fine-tuning"): prompt positions a row may carry before its ids, the bytes
# of kept span inputs a server holds for steps whose backward has not come back (--max-train-mib), and how
# long it waits for that backward before it frees the input and fails the step
MAX_PROMPT_POSITIONS = 256
MAX_TRAIN_STEPS_IN_FLIGHT = 64  # training rows a server computes or waits on at once (more: busy)
DEFAULT_MAX_TRAIN_MIB = 256
TRAIN_STEP_TIMEOUT = 120.0
# deep prompt tuning: the most values of deep prompts (blocks x prompts x hidden) one message carries
# (32 MiB of float32; SmolLM2-135M's 30 blocks x 256 prompts x 576 are 4.4 M)
MAX_DEEP_PROMPT_ELEMENTS = 1 << 23
MAX_NUM_LABELS = 1024  # sequence classification: the most classes a score head may have
MAX_STOP_TOKEN_IDS = 16  # Constraint.stop_token_ids: ids besides EOS that end a constrained output (a model has a few)
# a row longer than a step goes in chunks (docs/design.md, "Long rows in chunks"): at most this many chunks and
# positions per row (what each hop keeps for it also counts against --max-train-mib)
MAX_TRAIN_CHUNKS = 256
MAX_TRAIN_ROW_POSITIONS = 1 << 16
MAX_TRAIN_SPARES = 16  # spare servers one training row may name (TrainForward.spares)


def default_max_session_tokens(cache_tokens: int) -> int:
    """A fair share of a server's cache budget for one session: a quarter, but at least
    MIN_DEFAULT_SESSION_TOKENS within one client's half (so a small server still takes a chat)."""
    half = max(1, cache_tokens // PEER_CACHE_SHARE)
    return max(cache_tokens // SESSION_TOKENS_SHARE, min(half, MIN_DEFAULT_SESSION_TOKENS), 1)


def step_tensor_elements(hidden_shape: Sequence[int], max_positions: int) -> int:
    """The most activation values one Step may carry."""
    return max_positions * math.prod(hidden_shape)


def session_frame_bytes(hidden_shape: Sequence[int], max_positions: int) -> int:
    """The largest frame on the session protocol: a Step of ``max_positions`` positions with its
    activations (up to 10 bytes of MessagePack per id)."""
    activations = ACTIVATION_BYTES_PER_ELEMENT * step_tensor_elements(hidden_shape, max_positions)
    return activations + 10 * max_positions + FRAME_MARGIN_BYTES


def deep_prompt_elements(blocks_from_here: int, hidden_size: int) -> int:
    """The most deep-prompt values one training message may carry to a hop ``blocks_from_here`` blocks
    before the model's end: those blocks, MAX_PROMPT_POSITIONS each, within MAX_DEEP_PROMPT_ELEMENTS.
    Sized by the model (a server's frames use its whole depth, so they hold after a move; a message is
    checked against its hop's own blocks), not a flat cap, so a small model's frames stay small
    (MAX_TRAIN_STEPS_IN_FLIGHT of them may be in flight)."""
    return min(MAX_DEEP_PROMPT_ELEMENTS, max(0, blocks_from_here) * MAX_PROMPT_POSITIONS * hidden_size)


def train_frame_bytes(hidden_shape: Sequence[int], max_positions: int, deep_elements: int = 0) -> int:
    """The largest frame on the training protocol: a TrainForward of ``max_positions`` positions with
    its activations (or a TrainBackward with their gradient), ids and targets up to 10 bytes each,
    ``deep_elements`` values of deep prompts (deep_prompt_elements) and a classification row's score
    weights."""
    deep = ACTIVATION_BYTES_PER_ELEMENT * deep_elements  # a deep prompt tuning step's second tensor
    score = ACTIVATION_BYTES_PER_ELEMENT * MAX_NUM_LABELS * hidden_shape[-1]  # a classification row's score weights
    return session_frame_bytes(hidden_shape, max_positions) + 10 * max_positions + deep + score
