"""Deep prompts on the inference path (Petals' ``deep_ptune``; docs/fine_tuning.md).

A deep-prompt-tuned session has, besides the head's prompts, ``num_prompts`` prompts per block that the
block adds to the prompt positions of its input. The OpenSession brings each server the deep prompts of
its blocks and of every block after them (``[num_blocks - hop.start, num_prompts, hidden]``, its last
tensor); a server keeps its span's rows and sends the rest on with the OpenSession it relays. Runs whose
positions fall among the prompt positions (a session's first prefill) are computed block by block with the
prompts added; every later run takes the batch's usual path, so decoding costs nothing extra.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import OpenSession
from server.adapters import SpanAdapter, SpanCancelled
from server.adapters.base import BatchMember
from server.session import ServerSession
from server.train_checks import check_deep_tensor


def split_open(
    message: OpenSession, tensors: Sequence[torch.Tensor], hidden_shape: Sequence[int], max_positions: int, blocks: int
) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
    """An OpenSession's tensors without its deep prompts, and the deep prompts checked (None without
    ``deep_prompts``): one float32 ``[blocks - hop.start, num_prompts, hidden]`` tensor of finite values, no
    larger than one Step's activations (the session protocol's frame bound)."""
    tensors = list(tensors)
    if not message.deep_prompts:
        return tensors, None
    start, count, hidden = message.route[message.hop_index].start, message.num_prompts, math.prod(hidden_shape)
    if count <= 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "deep prompts need num_prompts >= 1")
    expected = (blocks - start, count, hidden)
    if math.prod(expected) > max_positions * hidden:
        raise ProtocolError(
            ErrorCode.STEP_TOO_LARGE,
            f"deep prompts {expected} exceed one step's {max_positions} positions of activations: "
            "blocks x num_prompts must be at most max_positions_per_step",
        )
    if not tensors:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "expected a tensor of deep prompts, got none")
    deep = tensors.pop()
    check_deep_tensor(deep, expected)
    return tensors, deep


def keep(session: ServerSession, deep: Optional[torch.Tensor]) -> None:
    """The session's own deep prompts (its span's rows) and the rest, for the next hop's OpenSession."""
    if deep is None:
        return
    own = session.hop.end - session.hop.start
    session.deep_prompts, session.deep_rest = deep[:own], deep[own:]


def applies(session: ServerSession, member: BatchMember) -> bool:
    """Whether the member's positions fall among its session's deep prompt positions."""
    deep = session.deep_prompts
    return deep is not None and member.start_pos < deep.shape[1]


def add_at(hidden: torch.Tensor, prompts: torch.Tensor, start_pos: int) -> torch.Tensor:
    """``hidden`` [1, S, H] of positions start_pos.. with ``prompts[p]`` [P, H] added at each position p < P."""
    count = min(prompts.shape[0] - start_pos, hidden.shape[1])
    if count <= 0:
        return hidden
    hidden = hidden.clone()
    hidden[0, :count] += prompts[start_pos : start_pos + count].to(hidden.device, hidden.dtype)
    return hidden


def forward_member(span: SpanAdapter, session: ServerSession, member: BatchMember, blocks: range):
    """``blocks`` over one member, each block's deep prompts added at its input; None if cancelled.

    An EAGLE-3 tail's feature taps (server/feature_taps.py) see the pass as one: boundary ``j`` is
    block ``j - 1``'s output, before block ``j`` adds its prompts (as transformers' ``hidden_states``
    with Petals' pre-block prompts), so the session's prefill drafts like any other run."""

    def check() -> None:
        if member.cancelled():
            raise SpanCancelled()

    taps = span.taps if span.taps is not None and blocks.stop == span.end else None
    wanted = taps.wanted(blocks) if taps is not None else frozenset()
    kept: dict[int, torch.Tensor] = {}
    hidden = member.hidden
    try:
        with taps.holding(member.cache) if taps is not None else contextlib.nullcontext():
            for block in blocks:
                if block in wanted:
                    kept[block] = hidden
                hidden = add_at(hidden, session.deep_prompts[block - session.hop.start], member.start_pos)
                one = range(block, block + 1)
                hidden = span.forward(hidden, member.token_ids, member.start_pos, member.cache, one, check)
    except SpanCancelled:
        return None
    if taps is not None:
        kept[blocks.stop] = hidden
        taps.record(
            member.cache, member.start_pos, {j: kept[j].to(hidden.device, hidden.dtype) for j in wanted}, blocks
        )
    return hidden


def forward_batch(
    span: SpanAdapter, members: list[BatchMember], sessions: list[ServerSession], blocks: range
) -> list[Optional[torch.Tensor]]:
    """``span.forward_batch`` for the members without deep prompts to add, :func:`forward_member` for the rest."""
    deep = [applies(s, m) for s, m in zip(sessions, members)]
    plain = iter(span.forward_batch([m for m, d in zip(members, deep) if not d], blocks) if not all(deep) else [])
    return [forward_member(span, s, m, blocks) if d else next(plain) for s, m, d in zip(sessions, members, deep)]
