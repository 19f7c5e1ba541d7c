"""Packing a batch's members into one row of positions (continuous batching, server/batching.py),
shared by the families that batch for real (llama_batch.py, deepseek_v4_batch.py).

The members' new positions sit one after another in a row of T positions, so that every
per-position part of a block (projections, norms, MLP/MoE, hyper-connection mixing) runs once
over all T; the parts that read a member's own cache run per member, over its slice
``bounds[j]`` of the row. Packing, not padding: no position is computed that no member asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from server.adapters.base import BatchMember


@dataclass
class Packed:
    """The members still in the batch, and where each one's positions sit in the packed row."""

    members: list[BatchMember]
    bounds: list[tuple[int, int]]  # [start, end) in the packed row, per member
    masks: list[Any]  # each member's attention mask(s), as its family builds them
    position_ids: torch.Tensor  # [1, T]

    def token_ids(self, device: torch.device) -> torch.Tensor:
        """[1, T] the members' token ids, packed like their positions."""
        return torch.cat([member.token_ids.to(device) for member in self.members], dim=1)


def pack(
    members: list[BatchMember],
    dtype: torch.dtype,
    device: torch.device,
    positions_and_mask: Callable[[BatchMember], tuple[torch.Tensor, Any]],
) -> tuple[Packed, torch.Tensor]:
    """One row of every member's positions, with each member's position ids [1, S] and mask."""
    bounds, masks, positions, start = [], [], [], 0
    for member in members:
        position_ids, mask = positions_and_mask(member)
        num_new = member.hidden.shape[1]
        bounds.append((start, start + num_new))
        masks.append(mask)
        positions.append(position_ids)
        start += num_new
    hidden = torch.cat([member.hidden.to(device, dtype) for member in members], dim=1)
    return Packed(list(members), bounds, masks, torch.cat(positions, dim=1)), hidden


def member_rows(packed: Packed, hidden: torch.Tensor, member: BatchMember) -> torch.Tensor:
    """``member``'s rows [1, S, ...] of a packed row ``hidden`` laid out as ``packed``."""
    index = next(i for i, m in enumerate(packed.members) if m is member)
    a, b = packed.bounds[index]
    return hidden[:, a:b]


def drop(packed: Packed, hidden: torch.Tensor, keep: list[int]) -> tuple[Packed, torch.Tensor]:
    """The batch without the members not in ``keep`` (indices into packed.members): their rows
    leave the packed row; returns the new packing and hidden rows."""
    rows, bounds, start = [], [], 0
    for i in keep:
        a, b = packed.bounds[i]
        rows.extend(range(a, b))
        bounds.append((start, start + b - a))
        start += b - a
    index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    smaller = Packed(
        [packed.members[i] for i in keep], bounds, [packed.masks[i] for i in keep], packed.position_ids[:, index]
    )
    return smaller, hidden[:, index]


def run_blocks(
    packed: Packed,
    hidden: torch.Tensor,
    blocks: range,
    between_blocks: Callable[[], None],
    prepare: Callable[[Packed, torch.Tensor], Any],
    block: Callable[[int, torch.Tensor, Packed, Any], torch.Tensor],
) -> list[Optional[torch.Tensor]]:
    """``blocks`` over the packed row: ``prepare(packed, hidden)`` builds what every block shares
    (rotary tables, packed ids), again whenever members leave; ``block(index, hidden, packed,
    prepared)`` computes one block. A member cancelled between blocks leaves the row there (its
    output is None, the caller trims its cache); the others go on."""
    outputs: list[Optional[torch.Tensor]] = [None] * len(packed.members)
    index = list(range(len(packed.members)))  # packed.members[j] is the caller's members[index[j]]
    prepared = prepare(packed, hidden)
    for number in blocks:
        between_blocks()
        keep = [j for j, member in enumerate(packed.members) if not member.cancelled()]
        if not keep:
            return outputs
        if len(keep) < len(packed.members):
            packed, hidden = drop(packed, hidden, keep)
            index = [index[j] for j in keep]
            prepared = prepare(packed, hidden)
        hidden = block(number, hidden, packed, prepared)
    for j, (a, b) in zip(index, packed.bounds):
        outputs[j] = hidden[:, a:b]
    return outputs
