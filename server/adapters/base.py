"""The one interface every model family implements so the server can run a span of its blocks.

The server knows nothing about attention or MLPs: it asks the adapter to embed ids (head only),
run blocks [start, end) over new positions with a session's cache, trim that cache to a position
(the only rollback), and turn final hidden states into logits (tail only). Adding a family is one
new adapter file registered in ``server.adapters``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from server.quantization import Quant, replace_linears

Cache = Any  # each adapter chooses its own cache type


class SpanCancelled(Exception):
    """Raised between blocks when the run being computed was cancelled."""


@dataclass
class BatchMember:
    """One session's part of a batched pass (server/batching.py): its new positions, its own
    cache, and whether it has been cancelled (asked between blocks; a cancelled member leaves the
    batch there and its output is None)."""

    hidden: torch.Tensor  # [1, S, *hidden_shape]
    token_ids: torch.Tensor  # [1, S]
    start_pos: int
    cache: Cache
    tree: Optional[list[int]] = None  # parents of the run's last len(tree) positions (supports_trees)
    cancelled: Callable[[], bool] = lambda: False


def add_deep_prompts(hidden: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
    """``hidden`` [1, S, ...] with ``prompts`` [P, ...] added to its first min(P, S) positions (a new tensor:
    autograd reaches both; the positions past P are untouched)."""
    count = min(prompts.shape[0], hidden.shape[1])
    added = hidden[:, :count] + prompts[:count].to(hidden.device, hidden.dtype).unsqueeze(0)
    return torch.cat([added, hidden[:, count:]], dim=1)


class SpanAdapter(abc.ABC):
    """Modules of blocks [start, end) of one model, plus embeddings at the head and the final
    norm and LM head at the tail."""

    start: int
    end: int
    num_blocks: int  # blocks in the whole model
    hidden_shape: tuple[int, ...]  # shape of one position's activations between stages
    vocab_size: int
    drafter: Any = None  # a server.tail_drafter.EagleDrafter at a tail that drafts, else None
    taps: Any = None  # a server.feature_taps.FeatureTaps when the tail's drafter reads inner blocks' outputs
    constraints: Any = None  # a server.constraints.TailConstraints at a tail (structured outputs), else None
    lora: Any = None  # a server.lora.ServerAdapters when the server serves LoRA adapters (--adapters), else None
    # whether forward() takes a tree of drafts (``tree=``) and gather_cache() works (docs/protocol.md,
    # "Token trees"); families whose caches roll back exactly only for chains keep this False
    supports_trees: bool = False

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.num_blocks

    @abc.abstractmethod
    def new_cache(self) -> Cache: ...

    @abc.abstractmethod
    def cache_length(self, cache: Cache) -> int:
        """Positions held in the cache of the blocks a session uses."""

    @abc.abstractmethod
    def trim_cache(self, cache: Cache, length: int) -> None:
        """Forget every position >= length, exactly as if it had never been computed."""

    @abc.abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[1, S] ids -> [1, S, *hidden_shape] activations (head only)."""

    @abc.abstractmethod
    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        start_pos: int,
        cache: Cache,
        blocks: range,
        check_cancelled: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """Run ``blocks`` (a sub-range of this span) over positions start_pos.. of ``hidden``.

        ``check_cancelled`` is called between blocks and raises :class:`SpanCancelled` to abandon
        the run; the caller then trims the cache back. An adapter with ``supports_trees`` also takes
        ``tree=parents`` (protocol/trees.py): the run's last ``len(parents)`` positions are then a
        tree of drafts, computed in the same pass with a tree attention mask and depth-based
        positions, and cached in run order until :meth:`gather_cache` keeps the accepted path.
        """

    def forward_batch(
        self, members: list[BatchMember], blocks: range, between_blocks: Callable[[], None] = lambda: None
    ) -> list[Optional[torch.Tensor]]:
        """Run ``blocks`` over every member's new positions, each with its own cache, positions and
        mask; returns each member's output, or None for a member cancelled on the way.

        This default computes the members one after another (a batch of one at a time): families
        that batch for real override it, and give each member what :meth:`forward` gives it alone,
        up to the rounding of rows computed together (docs/design.md).
        """
        outputs: list[Optional[torch.Tensor]] = []
        for member in members:

            def check(member: BatchMember = member) -> None:
                between_blocks()
                if member.cancelled():
                    raise SpanCancelled()

            tree = {"tree": member.tree} if member.tree else {}
            try:
                outputs.append(
                    self.forward(member.hidden, member.token_ids, member.start_pos, member.cache, blocks, check, **tree)
                )
            except SpanCancelled:
                outputs.append(None)
        return outputs

    def gather_cache(self, cache: Cache, base: int, nodes: list[int]) -> None:
        """Move the entries of positions ``base + nodes[j]`` to ``base + j`` (a tree's accepted path
        into a chain; the caller then trims). Only where ``supports_trees``."""
        raise NotImplementedError(f"{type(self).__name__} computes chains only")

    @abc.abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, S, *hidden_shape] final activations -> [S, vocab] float32 logits (tail only)."""

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, S, *hidden_shape] final activations -> [S, hidden] float32: what the LM head reads
        (after the final norm; transformers' ``hidden_states[-1]``). Tail only; for forward passes."""
        raise NotImplementedError(f"{type(self).__name__} does not return final hidden states")

    def backward_refusal(self) -> str:
        """Why this span cannot take part in a training step (docs/design.md, "Fine-tuning"); "" when it can."""
        return f"{type(self).__name__} spans do not support backward (training) yet"

    def train_span(
        self, hidden: torch.Tensor, blocks: range, deep: Optional[torch.Tensor] = None, cache=None
    ) -> torch.Tensor:
        """[1, S, *hidden_shape] -> the output of ``blocks`` over positions 0..S-1, without a cache, under
        the caller's grad mode (so autograd reaches ``hidden``; the weights stay frozen). ``deep``
        ``[len(blocks), P, *hidden_shape]``: deep prompts, added to the first P positions at each block's
        input (:func:`add_deep_prompts`; Petals' deep_ptune). ``cache`` (server/train_chunks.py TrainCache):
        the positions run after ``cache.offset`` earlier ones whose keys and values it holds (a long row's chunk)."""
        raise NotImplementedError(self.backward_refusal())

    def train_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, S, *hidden_shape] final activations -> [S, vocab] float32 logits, under the caller's grad mode."""
        raise NotImplementedError(self.backward_refusal())

    def train_final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, S, *hidden_shape] final activations -> [1, S, hidden] after the final norm, under the caller's
        grad mode (what a sequence classification head scores)."""
        raise NotImplementedError(self.backward_refusal())

    def cache_bytes_per_token(self) -> int:
        """KV bytes one position costs across this span; used for the cache budget."""
        return self.span_cache_bytes_per_token(self.config, self.start, self.end, self.dtype)

    @staticmethod
    def span_cache_bytes_per_token(config: Any, start: int, end: int, dtype: torch.dtype) -> int:
        """:meth:`cache_bytes_per_token` from the config alone, so the memory plan can size the cache
        before any weights load."""
        return 0

    @staticmethod
    def quantize_skeleton(layers: torch.nn.Module, quant: Quant, dtype: torch.dtype) -> None:
        """Swap the meta-device layers' quantizable modules for bitsandbytes ones (in place)."""
        replace_linears(layers, quant, dtype)

    stacked_linears: tuple[type, ...] = ()  # modules whose 3-D parameters a quantized span splits into linears

    @staticmethod
    def dtype_plan(dtype: torch.dtype) -> Callable[[str], torch.dtype]:
        """The dtype each floating parameter is held in, by name (some families keep a few in float32)."""
        return lambda name: dtype
