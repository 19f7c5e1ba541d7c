"""Token trees of drafts (docs/protocol.md, "Token trees"): their shape, checks and layout.

A run's drafts may form a tree instead of a chain: ``Step.parents`` holds, for each draft, the index
of its parent among the run's drafts, or -1 for the run's last committed id (the root); a parent
comes before its child, so the drafts are in a topological order and every prefix of them is a
tree. Node j sits at depth ``depths(parents)[j]`` (1 for a child of the root), and its absolute
position is ``start_pos + committed - 1 + depth``: siblings share a position. Every server computes
the whole tree in one pass, each node seeing the cache, the run's committed ids and its own
ancestors (``visibility``), at its depth-based position (``offsets``). The tail walks it with the
seeded rule (protocol/sampling.py ``verify_tree``) and names the accepted path (draft indices, root
first); the next Step names that path again (``Step.tree_path``) so that every server gathers those
cache entries into a chain before trimming to the new ``start_pos``.

No model code here: the Llama adapter turns ``offsets`` and ``visibility`` into position ids and an
attention mask.
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_tree(parents: Sequence[int], n_draft: int, max_nodes: int) -> None:
    """Raise ValueError naming what is wrong with a run's tree (``parents``, one per draft)."""
    if len(parents) != n_draft:
        raise ValueError(f"parents has {len(parents)} entries for {n_draft} drafts (one per draft is needed)")
    if n_draft > max_nodes:
        raise ValueError(f"a tree of {n_draft} drafts exceeds the limit of {max_nodes} nodes per run")
    for child, parent in enumerate(parents):
        if not -1 <= parent < n_draft:
            raise ValueError(
                f"parents[{child}] = {parent} is out of range: a draft index in [0, {n_draft}) or -1 (the root)"
            )
        if parent >= child:
            raise ValueError(f"parents[{child}] = {parent} does not come before its child: a parent must precede it")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root (the run's last committed id)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def is_chain(parents: Sequence[int]) -> bool:
    """Whether the nodes form a chain in run order (node j's parent is j - 1)."""
    return all(parent == child - 1 for child, parent in enumerate(parents))


def check_path(path: Sequence[int], parents: Sequence[int]) -> None:
    """Raise ValueError unless ``path`` (draft indices, root first) is a path down the tree from its root."""
    previous = -1
    for step, node in enumerate(path):
        if not 0 <= node < len(parents):
            raise ValueError(f"path[{step}] = {node} is not a node of the tree's {len(parents)}")
        if parents[node] != previous:
            raise ValueError(f"path[{step}] = {node} is not a child of {'the root' if previous < 0 else previous}")
        previous = node


def path_ids(path: Sequence[int], ids: Sequence[int]) -> list[int]:
    return [ids[node] for node in path]


def offsets(num_committed: int, parents: Sequence[int]) -> list[int]:
    """Position of each of the run's ids relative to ``start_pos``: committed ids in order, then
    each draft at ``num_committed - 1 + depth``."""
    return list(range(num_committed)) + [num_committed - 1 + d for d in depths(parents)]


def visibility(num_committed: int, parents: Sequence[int]) -> torch.Tensor:
    """[S, S] boolean (True = attends), S = committed + drafts: which of the run's own positions
    each one sees (every position also sees the whole cache before the run). Committed ids are
    causal; a draft sees every committed id, its ancestors and itself."""
    size = num_committed + len(parents)
    seen = torch.zeros(size, size, dtype=torch.bool)
    seen[:num_committed, :num_committed] = torch.ones(num_committed, num_committed, dtype=torch.bool).tril()
    for node, parent in enumerate(parents):
        row = num_committed + node
        if parent < 0:
            seen[row, :num_committed] = True
        else:
            seen[row] = seen[num_committed + parent]
        seen[row, row] = True
    return seen
