"""What one training lap's backward holds, from the model's shapes alone: the rule a server's backward budget
checks (server/train_budget.py) and a client's chunking of a long row follows (client/_training.py), so the two
agree: each server announces its budget in its records, and the client sizes a row's chunks to the smallest on
its route (docs/design.md, "Long rows in chunks")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


def backward_bytes(config: Any, dtype: torch.dtype, positions: int, blocks: int, tail: bool, offset: int = 0) -> int:
    """Activation bytes of one training row's backward through ``blocks`` blocks: its recompute with autograd
    keeps, per block and position, the block's input and its norms' outputs, q, k, v (before and after
    rotary), the attention output, the MLP's gate, up, activation and product (in ``dtype``), and the
    attention probabilities (heads x positions per position, twice: eager attention keeps them before and
    after the softmax); at the tail the float32 logits, their log-softmax and gradient (3 x vocab per
    position). A server computes one row at a time (one compute thread), so this is its backward's peak;
    the no-grad forward before it keeps nothing. An estimate from the shapes (tests/training/test_train_budget.py
    measures it against the tensors autograd saves).

    ``offset``: a long row's chunk after that many earlier positions, whose keys and values enter the
    recompute as leaves: per block and earlier position, the attention's scores and mask widen by the chunk's
    positions (2 x heads + 1 per chunk position), and the earlier keys and values are held again concatenated
    before the chunk's and as their gradients (4 x key/value width)."""
    size = torch.finfo(dtype).bits // 8
    hidden, inner = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    per_position = size * (5 * hidden + 2 * heads * head_dim + 4 * kv + 4 * inner + 2 * heads * positions)
    earlier = size * offset * ((2 * heads + 1) * positions + 4 * kv)
    return blocks * (positions * per_position + earlier) + (3 * 4 * config.vocab_size * positions if tail else 0)


def fitting_positions(
    config: Any, dtype: torch.dtype, blocks: int, logits: bool, budget: int, offset: int, limit: int
) -> int:
    """The most positions (at most ``limit``) of a chunk after ``offset`` earlier positions whose
    :func:`backward_bytes` through ``blocks`` blocks (with the LM head's ``logits``) is at most ``budget``; 0 when
    not even one position fits."""
    low, high = 0, limit  # the answer lies in low..high: backward_bytes grows with the positions
    while low < high:
        middle = (low + high + 1) // 2
        if backward_bytes(config, dtype, middle, blocks, logits, offset) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def chunk_positions(config: Any, offset: int, limit: int) -> int:
    """The most positions (at most ``limit``) a long row's chunk after ``offset`` earlier positions may have
    for its backward to hold no more than a row of ``limit`` positions does (a server's default backward
    budget: what its memory plan counted for its step limit); 0 when not even one position fits. The dtype
    and the blocks scale both sides alike, and the tail's logits grow with the positions only, so one float32
    block decides. What a client without the route's announced budgets (:class:`HopBudget`) sizes by."""
    budget = backward_bytes(config, torch.float32, limit, 1, False)
    return fitting_positions(config, torch.float32, 1, False, budget, offset, limit)


@dataclass(frozen=True)
class HopBudget:
    """What one hop of a route checks a lap's backward against (server/training.py): the activation bytes its
    record announces (``ServerInfo.max_backward_bytes``: ``--max-backward-mib``, or what its step limit needs),
    the hop's blocks, whether it is the tail (whose estimate counts the LM head's logits) and its dtype."""

    budget: int
    blocks: int
    tail: bool
    dtype: torch.dtype = torch.float32
    peer_id: str = ""

    def positions(self, config: Any, offset: int, limit: int, logits: bool = True) -> int:
        """The most positions (at most ``limit``) of a chunk after ``offset`` this hop takes; ``logits`` False: a
        classification row, whose tail reads one position's score head, not the vocabulary's logits."""
        return fitting_positions(config, self.dtype, self.blocks, self.tail and logits, self.budget, offset, limit)


def route_chunk_positions(
    config: Any, offset: int, limit: int, hops: Sequence[HopBudget], logits: bool = True
) -> tuple[int, Optional[HopBudget]]:
    """The most positions (at most ``limit``) a chunk after ``offset`` may have for every hop's backward check to
    pass, and the hop that decides it (None: the step limit does)."""
    best, decider = limit, None
    for hop in hops:
        fits = hop.positions(config, offset, limit, logits)
        if fits < best:
            best, decider = fits, hop
    return best, decider
