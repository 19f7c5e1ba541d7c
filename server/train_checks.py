"""What a server admits on the training protocol, as pure checks (docs/design.md, "Fine-tuning").

A TrainForward comes from a stranger: it must name this server at the right hop of a sane route, come
from the route's previous hop (past the head), stay within the positions and prompt bounds, hold ids
and targets inside the vocabulary, and carry exactly the tensor its hop needs (shape and dtype). The
gradient a next hop sends back is checked the same way. Each check raises a ProtocolError naming what
was wrong before anything is computed or kept.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import TrainForward
from server.admission import HeldBlocks, check_hop, check_tensors, check_upstream
from server.session import check_token_ids

IGNORE_INDEX = -100  # a target the loss skips (transformers' ignore_index)


def check_train_forward(
    message: TrainForward,
    tensors: Sequence[torch.Tensor],
    peer_id: str,
    upstream_peer: str,
    held: HeldBlocks,
    hidden_size: int,
    vocab_size: int,
    max_positions: int,
) -> None:
    """A training row this server may compute: the route, the sender, the bounds, ids, targets, tensor."""
    check_hop(message.route, message.hop_index, peer_id, held)
    check_upstream(message, upstream_peer)
    prompts, length = message.num_prompts, len(message.token_ids)
    if not 0 <= prompts <= limits.MAX_PROMPT_POSITIONS:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"num_prompts must be in 0..{limits.MAX_PROMPT_POSITIONS}, got {prompts}"
        )
    if length == 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a training row needs at least one token id")
    if len(message.targets) != length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{len(message.targets)} targets for {length} token ids: one target per id"
        )
    check_chunk(message)
    here = prompts if message.chunk_index == 0 else 0  # the prompts travel in a row's first chunk only
    if here + length > max_positions:
        raise ProtocolError(
            ErrorCode.STEP_TOO_LARGE,
            f"a training row of {here} prompts + {length} ids exceeds this server's {max_positions} positions",
        )
    check_token_ids(message.token_ids, vocab_size)
    if any(not (0 <= t < vocab_size or t == IGNORE_INDEX) for t in message.targets):
        raise ProtocolError(ErrorCode.TOKEN_OUT_OF_VOCAB, f"targets must be in [0, {vocab_size}) or {IGNORE_INDEX}")
    head = message.hop_index == 0
    rows = here if head else here + length
    what = "the prompts" if head else "the previous span's output"
    if message.backward_only:  # a chunk's backward lap: its forward lap brought (and the hop kept) its input
        if tensors:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a backward_only lap carries no tensors, got {len(tensors)}")
        return
    tensors, deep, score = split_train_tensors(message, tensors)
    if message.deep_prompts and message.chunk_index == 0:  # a long row's deep prompts come with its chunk 0
        check_deep_prompts(deep, message, held.num_blocks, hidden_size)
    if message.num_labels:  # the score weights come with the row's last chunk
        check_score(score, message, hidden_size, message.chunk_index == message.num_chunks - 1)
    elif message.multi_labels:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "multi_labels without num_labels: not a classification row")
    check_tensors(tensors, rows, hidden_size, what, optional=head and here == 0)


def check_chunk(message: TrainForward) -> None:
    """A chunk's place in its row (docs/design.md, "Long rows in chunks"): within the limits, backward laps
    before the last chunk."""
    index, count, offset = message.chunk_index, message.num_chunks, message.chunk_offset
    if not 1 <= count <= limits.MAX_TRAIN_CHUNKS or not 0 <= index < count:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"chunk {index} of {count}: num_chunks must be in 1..{limits.MAX_TRAIN_CHUNKS} and chunk_index below it",
        )
    if not 0 <= offset or offset + len(message.token_ids) > limits.MAX_TRAIN_ROW_POSITIONS:
        raise ProtocolError(
            ErrorCode.STEP_TOO_LARGE,
            f"a chunk at offset {offset} with {len(message.token_ids)} ids passes the "
            f"{limits.MAX_TRAIN_ROW_POSITIONS} positions a training row may have",
        )
    if (index == 0) != (offset == 0):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"chunk {index} cannot start at offset {offset}")
    if message.backward_only and index >= count - 1:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"chunk {index} of {count} has no backward_only lap (the last has none)"
        )


def split_train_tensors(
    message: TrainForward, tensors: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """A TrainForward's tensors in their three parts, in this order: the input (none at a head without
    prompts), the deep prompts (with ``deep_prompts``; a long row's chunk 0 only: they sit at the row's start)
    and the score weights (with ``num_labels``; a long row's last chunk only: it holds the scored position);
    any tensor beyond them is left with the input (whose check then names it)."""
    head_without_prompts = message.hop_index == 0 and (message.num_prompts == 0 or message.chunk_index > 0)
    count = 0 if head_without_prompts or message.backward_only else 1
    inputs, rest = list(tensors[:count]), list(tensors[count:])
    deep = rest[:1] if message.deep_prompts and message.chunk_index == 0 else []
    rest = rest[len(deep) :]
    score = rest[:1] if message.num_labels and message.chunk_index == message.num_chunks - 1 else []
    return inputs + rest[len(score) :], deep, score


def check_score(tensors: Sequence[torch.Tensor], message: TrainForward, hidden_size: int, weights: bool = True) -> None:
    """A classification row: 1..MAX_NUM_LABELS labels, a label in range (a class index, or any finite value
    for regression), targets all ignored, and (``weights``: the lap that scores) one float32
    ``[num_labels, hidden]`` score weight."""
    count = message.num_labels
    if not 0 < count <= limits.MAX_NUM_LABELS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"num_labels must be in 1..{limits.MAX_NUM_LABELS}, got {count}")
    label, multi = message.label, message.multi_labels
    if multi:
        if len(multi) != count or count < 2 or not all(math.isfinite(t) and 0.0 <= t <= 1.0 for t in multi):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"multi_labels must be {count} targets in [0, 1] (num_labels >= 2), got {multi}"
            )
    elif not math.isfinite(label) or (count > 1 and (label != int(label) or not 0 <= label < count)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"label must be a class index in [0, {count}), got {label}")
    if any(t != IGNORE_INDEX for t in message.targets):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a classification row's targets must all be {IGNORE_INDEX}")
    if weights:
        check_gradient(tensors, (count, hidden_size), "the score weights")


def check_deep_prompts(tensors: Sequence[torch.Tensor], message: TrainForward, num_blocks: int, hidden: int) -> None:
    """The deep prompts a TrainForward with ``deep_prompts`` carries after its first tensor: one float32
    ``[num_blocks - hop.start, num_prompts, hidden]`` tensor of finite values, within limits.deep_prompt_elements."""
    start, prompts = message.route[message.hop_index].start, message.num_prompts
    if prompts == 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "deep prompts need num_prompts >= 1")
    expected = (num_blocks - start, prompts, hidden)
    most = limits.deep_prompt_elements(num_blocks - start, hidden)
    if (num_blocks - start) * prompts * hidden > most:
        raise ProtocolError(
            ErrorCode.STEP_TOO_LARGE,
            f"deep prompts {expected} exceed the {most} values this span takes (limits.deep_prompt_elements)",
        )
    if len(tensors) != 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected one tensor of deep prompts, got {len(tensors)}")
    check_deep_tensor(tensors[0], expected)


def check_deep_tensor(deep: torch.Tensor, expected: tuple[int, ...]) -> None:
    """A deep-prompt tensor's shape, dtype and values, as training and sessions (server/deep_prompts.py) take it."""
    if tuple(deep.shape) != expected:
        got = tuple(deep.shape)
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the deep prompts must have shape {expected}, got {got}")
    if deep.dtype != torch.float32:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the deep prompts must be float32, got {deep.dtype}")
    if not bool(torch.isfinite(deep).all()):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the deep prompts hold values that are not finite")


def check_gradient(tensors: Sequence[torch.Tensor], shape: tuple[int, ...], what: str) -> None:
    """Exactly one float32 tensor of ``shape`` and finite values (a gradient a next hop sent back)."""
    if len(tensors) != 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected one tensor ({what}), got {len(tensors)}")
    if tuple(tensors[0].shape) != shape or tensors[0].dtype != torch.float32:
        got = f"{tuple(tensors[0].shape)} {tensors[0].dtype}"
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} must be float32 of shape {shape}, got {got}")
    if not bool(torch.isfinite(tensors[0]).all()):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} holds values that are not finite")
