"""Intermediate activations a tail keeps for its drafter: the outputs of chosen blocks of a run.

Why: an EAGLE-3 drafter (server/eagle3_drafter.py) reads three features per position, the hidden
states at a low, a middle and a high layer of the target (arXiv 2503.01840), not only the final one
that a run's output already is. The span's forward (server/adapters/llama.py) hands each run's
activations at the wanted boundaries to :meth:`FeatureTaps.record`; the tail's verdict code
(server/compute.py) takes them back with :meth:`FeatureTaps.take` for the positions it drafts from.

Boundaries are counted as vLLM counts its ``eagle_aux_hidden_state_layer_ids``: boundary ``j`` is
the input of block ``j`` (the output of block ``j - 1``; 0: the embeddings). A tail holds only its own
span ``[start, end)``, so a boundary before ``start`` is stood in for by the span's input (boundary
``start``, the activations that arrived from the previous server): the nearest feature the tail has.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch


class FeatureTaps:
    """The activations at ``boundaries`` of the runs being computed, kept per session cache (a weak
    key: a cache dropped with its session drops its features) until the verdict takes them."""

    def __init__(self, boundaries: tuple[int, ...]):
        self.boundaries = tuple(boundaries)
        # cache -> chunks of one run: (start_pos, [1, n, len(boundaries) * H])
        self._pending: weakref.WeakKeyDictionary[Any, list[tuple[int, torch.Tensor]]] = weakref.WeakKeyDictionary()
        self._held: weakref.WeakSet[Any] = weakref.WeakSet()  # caches whose passes record themselves (:meth:`holding`)

    def sources(self, blocks: range) -> dict[int, int]:
        """Each wanted boundary -> the boundary a pass over ``blocks`` reads it from: itself inside the
        pass, else the pass's input (``blocks.start``), the nearest the tail holds."""
        return {j: j if blocks.start <= j <= blocks.stop else blocks.start for j in self.boundaries}

    def wanted(self, blocks: range) -> frozenset[int]:
        """The boundaries a pass over ``blocks`` must keep (block ``b``'s output is boundary ``b + 1``)."""
        return frozenset(self.sources(blocks).values())

    def record(self, cache: Any, start_pos: int, kept: dict[int, torch.Tensor], blocks: range) -> None:
        """A pass over ``blocks`` for positions start_pos.. of a session kept these boundaries. A chunk
        that does not continue the pending ones (a run cancelled half way) starts the run over."""
        if cache in self._held:
            return
        sources = self.sources(blocks)
        features = torch.cat([kept[sources[j]] for j in self.boundaries], dim=-1)
        chunks = self._pending.setdefault(cache, [])
        if chunks and chunks[-1][0] + chunks[-1][1].shape[1] != start_pos:
            chunks.clear()
        chunks.append((start_pos, features))

    @contextlib.contextmanager
    def holding(self, cache: Any) -> Iterator[None]:
        """Passes over ``cache`` record nothing meanwhile: a caller that runs a span block by block
        (server/deep_prompts.py: deep prompts added at each block's input) keeps the boundaries itself and
        records the whole pass once, as one pass over the span would."""
        self._held.add(cache)
        try:
            yield
        finally:
            self._held.discard(cache)

    def take(self, cache: Any, start_pos: int, length: int) -> Optional[torch.Tensor]:
        """[1, length, len(boundaries) * H]: the features of positions start_pos.. of the run just
        verified, or None when they were not all kept (a pass that did not reach the span's end)."""
        chunks = self._pending.pop(cache, [])
        while chunks and chunks[0][0] != start_pos:
            chunks.pop(0)
        if not chunks:
            return None
        features = torch.cat([chunk for _, chunk in chunks], dim=1)
        return features if features.shape[1] == length else None
