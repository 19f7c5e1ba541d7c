"""What the batching tests share (tests/server/test_batching.py, test_moe_families.py, test_moe_sessions.py,
test_dense_families.py): prompts of different lengths, members of a batched pass run alone and together
through a span, transformers' greedy truth, and rows padded on the left for ``generate``."""

from __future__ import annotations

import copy

import torch

from server.adapters.base import BatchMember
from tests.kit.threads import single_torch_thread


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    """Distinct prompts of different lengths (3 to 18 ids), some repeating themselves so that
    retrieval drafting has something to draft."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        row = torch.randint(10, 2000, (3 + i % 8,), generator=generator).tolist()
        rows.append(row + row[: i % 11] if i % 2 else row)
    return rows


def filled_cache(span, length: int, seed: int):
    cache = span.new_cache()
    if length:
        ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(seed))
        span.forward(span.embed(ids), ids, 0, cache, span_blocks(span))
    return cache


def span_blocks(span) -> range:
    return range(span.start, span.end)


# (cached positions, new positions, tree parents or None): decode steps, a prefill, drafts, a tree
MEMBERS = [(5, 1, None), (0, 7, None), (3, 4, [-1, 0, 0]), (9, 3, None), (2, 1, None), (12, 5, [-1, 0, 1, 0])]


def alone_and_together(span, seed: int, members_spec=MEMBERS):
    """Each of ``members_spec`` through ``span`` alone ((output, cache) pairs), the same members
    (on twin caches) and their outputs from one batched pass."""
    alone, members = [], []
    with single_torch_thread():
        for i, (length, num_new, tree) in enumerate(members_spec):
            cache = filled_cache(span, length, seed=i)
            twin = copy.deepcopy(cache)
            ids = torch.randint(0, 1000, (1, num_new), generator=torch.Generator().manual_seed(seed + i))
            hidden = span.embed(ids)
            extra = {"tree": tree} if tree else {}
            alone.append((span.forward(hidden, ids, length, cache, span_blocks(span), **extra), cache))
            members.append(BatchMember(hidden, ids, length, twin, tree))
        outputs = span.forward_batch(members, span_blocks(span))
    return alone, members, outputs


def greedy_truth(reference, row: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([row])
    with torch.no_grad(), single_torch_thread():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return out[0, len(row) :].tolist()


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask
