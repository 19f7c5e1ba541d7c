"""The hidden state at one block boundary inside the tail's span, for a Step that asks ``hidden_at``
(protocol/messages.py): what a client bisecting a dispute between two tails over the span's blocks
reads (client/_bisection.py, docs/reliability.md "Bisection over the span's blocks").

Why a pass of its own: the batched pass (server/batching.py) keeps only the span's output. A run that
asks for a boundary is computed alone, in two passes over ``[start, hidden_at)`` and
``[hidden_at, end)`` on the same cache, which is what one pass over the span computes (each block
reads only its input and its own cache), and the state between the two is kept. Such runs are a
dispute's evidence sessions: rare, never a live lap.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from server import deep_prompts
from server.adapters import SpanAdapter
from server.adapters.base import BatchMember
from server.session import ServerSession


def wants_boundary(session: ServerSession, hidden_at: int) -> bool:
    """Whether a run asks for a boundary state (only the tail answers one: the field is checked there)."""
    return hidden_at != -1 and session.next_hop is None


def forward_split(
    span: SpanAdapter, member: BatchMember, session: ServerSession, blocks: range, at: int
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(the span's output, the state entering block ``at``) of one member; (None, None) if cancelled."""
    hidden, state = member.hidden, member.hidden if at <= blocks.start else None
    for part in (range(blocks.start, at), range(at, blocks.stop)):
        if not len(part):
            continue
        hidden = deep_prompts.forward_batch(span, [dataclasses.replace(member, hidden=hidden)], [session], part)[0]
        if hidden is None:
            return None, None
        if part.stop == at:
            state = hidden
    return hidden, state
