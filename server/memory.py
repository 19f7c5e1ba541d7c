"""How many blocks a server can hold: weights, the ends it holds, cache and headroom in the free memory.

A volunteer who runs ``python -m swarm.server --model deepseek-v4-pro`` without ``--blocks`` or
``--num-blocks`` gets as many blocks as fit. Only the head holds the embeddings and only the tail
the final norm, LM head and the tail's drafter, so a span in the middle needs none of them: the
plan counts them only for a span that touches an end (on a 24 GB card that is the difference
between one DeepSeek-V4-Pro block and none). The cache takes a quarter of the free memory, but
never more than :data:`MAX_CACHE_TOKENS` tokens of the span need: a budget is capped there, and
for DeepSeek-V4's compressed caches a quarter of a GPU would be gigabytes held for nothing.

The arithmetic is pure (:class:`MemoryPlan`, given the sizes and a free-memory figure) so tests
drive it with made-up budgets on the meta device; measuring (free memory of the device, bytes of
one block from a meta-device model) lives beside it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from protocol.train_memory import backward_bytes
from server.quantization import Quant, estimate_module_bytes
from server.train_budget import REPLY_SHARE

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CACHE_FRACTION = 0.25  # of free memory kept for the KV cache budget at most
HEADROOM_FRACTION = 0.05  # of free memory left for activations and allocator slack
MAX_CACHE_TOKENS = 1 << 20  # the cache budget's cap, in tokens
MIN_CACHE_TOKENS = 2048  # the smallest cache budget a server runs with
DEFAULT_MAX_BATCH_POSITIONS = 1024  # positions of one batched pass (server/batching.py), at most

GiB = 1 << 30


@dataclass(frozen=True)
class ModelSizes:
    """Bytes of a model's parts once loaded (from the config, on the meta device)."""

    block_bytes: int  # the largest block
    embed_bytes: int  # the embeddings (the head)
    tail_bytes: int  # final norm, LM head and any extra head (the tail); the embeddings again when tied
    tied: bool  # LM head and embeddings are one tensor: a server holding both ends holds it once
    cache_bytes_per_token: int  # KV bytes of one position in the block that needs most


@dataclass(frozen=True)
class MemoryPlan:
    """What fits in ``free_bytes``: the block counts for a span in the middle, at the head and at
    the tail, and the numbers behind them for the server's log and ``--plan-only``."""

    total_blocks: int
    free_bytes: int
    sizes: ModelSizes
    quant: str = "none"
    drafter_bytes: int = 0  # the tail's drafter (DeepSeek-V4's MTP block, a tail drafter), beyond its blocks
    cache_tokens: Optional[int] = None  # --cache-tokens, when the volunteer set the budget
    batch_bytes: int = 0  # activations of the largest batched pass beyond what the headroom holds
    # training steps (server/train_budget.py): the span inputs kept for backwards in flight (--max-train-mib),
    # and the activations of the largest backward recompute, per block of the span and at the tail
    train_kept_bytes: int = 0
    train_replies_bytes: int = 0  # the replies kept for resends (server/train_replay.py): a share of --max-train-mib
    backward_block_bytes: int = 0
    backward_tail_bytes: int = 0
    backward_bytes: int = 0  # --max-backward-mib: a flat budget instead of the two above (0: theirs)

    @property
    def bytes_per_block(self) -> int:
        return self.sizes.block_bytes

    @property
    def headroom_bytes(self) -> int:
        return int(self.free_bytes * HEADROOM_FRACTION) + self.batch_bytes

    def backward_budget(self, num_blocks: int, tail: bool) -> int:
        """Activation bytes of the largest backward a span of ``num_blocks`` takes (recompute included)."""
        if self.backward_bytes:
            return self.backward_bytes
        return num_blocks * self.backward_block_bytes + (self.backward_tail_bytes if tail else 0)

    def train_bytes(self, num_blocks: int, tail: bool) -> int:
        """What training steps add to the headroom: the kept inputs, the replies kept for resends, and the largest
        backward's activations beyond what the headroom and the batched pass's reserve hold. A batched pass and
        a backward run on the span's one compute thread, never at once, so they share that memory."""
        shared = int(self.free_bytes * HEADROOM_FRACTION) + self.batch_bytes
        kept = self.train_kept_bytes + self.train_replies_bytes
        return kept + max(0, self.backward_budget(num_blocks, tail) - shared)

    def cache_bytes(self, num_blocks: int) -> int:
        """Memory kept for the KV cache of a span of ``num_blocks``."""
        per_token = self.sizes.cache_bytes_per_token * max(1, num_blocks)
        if self.cache_tokens is not None:
            return self.cache_tokens * per_token
        return max(
            MIN_CACHE_TOKENS * per_token, min(int(self.free_bytes * CACHE_FRACTION), MAX_CACHE_TOKENS * per_token)
        )

    def cache_budget_tokens(self, num_blocks: int) -> int:
        """The cache budget in tokens that :meth:`cache_bytes` pays for."""
        if self.cache_tokens is not None:
            return self.cache_tokens
        per_token = self.sizes.cache_bytes_per_token * max(1, num_blocks)
        if per_token <= 0:
            return MAX_CACHE_TOKENS
        return max(MIN_CACHE_TOKENS, min(MAX_CACHE_TOKENS, self.cache_bytes(num_blocks) // per_token))

    def ends_bytes(self, head: bool, tail: bool, drafter: bool = True) -> int:
        """Bytes beyond the blocks: embeddings at the head; norm, LM head (and drafter) at the tail."""
        size = (self.sizes.embed_bytes if head else 0) + (self.sizes.tail_bytes if tail else 0)
        if head and tail and self.sizes.tied:
            size -= self.sizes.embed_bytes
        return size + (self.drafter_bytes if tail and drafter else 0)

    def needed_bytes(self, num_blocks: int, head: bool = False, tail: bool = False, drafter: bool = True) -> int:
        return (
            num_blocks * self.sizes.block_bytes
            + self.ends_bytes(head, tail, drafter)
            + self.cache_bytes(num_blocks)
            + self.headroom_bytes
            + self.train_bytes(num_blocks, tail)
        )

    def most_blocks(self, head: bool = False, tail: bool = False, drafter: bool = True) -> int:
        """The longest span with these ends that fits (0: not even one block)."""
        limit = self.total_blocks - (0 if head else 1) - (0 if tail else 1)  # a middle span leaves both ends to others
        if head and tail:
            return (
                self.total_blocks if self.needed_bytes(self.total_blocks, True, True, drafter) <= self.free_bytes else 0
            )
        best = 0
        for n in range(1, max(0, limit) + 1):  # needed_bytes grows with n: stop at the first that does not fit
            if self.needed_bytes(n, head, tail, drafter) > self.free_bytes:
                break
            best = n
        return best

    @property
    def blocks(self) -> int:
        """Blocks of the longest span that fits anywhere (a middle span, unless the model is that small)."""
        return max(self.most_blocks(), self.head_blocks, self.tail_blocks, self.most_blocks(True, True))

    @property
    def head_blocks(self) -> int:
        return self.most_blocks(head=True)

    @property
    def tail_blocks(self) -> int:
        """Blocks of the longest span ending at the last block: beside the drafter if one block fits
        beside it, else without it (the drafter is then left out: see :attr:`tail_drafter`)."""
        return self.most_blocks(tail=True) or self.most_blocks(tail=True, drafter=False)

    @property
    def tail_drafter(self) -> bool:
        """Whether a tail has room for the drafter at all."""
        return self.most_blocks(tail=True) > 0

    def fits(self, start: int, end: int, drafter: bool = True) -> bool:
        head, tail = start == 0, end == self.total_blocks
        return self.needed_bytes(end - start, head, tail, drafter and tail) <= self.free_bytes

    def fits_beside(self, old: tuple[int, int], new: tuple[int, int]) -> bool:
        """Whether span ``new`` loads while ``old`` is still resident (a move that keeps serving)."""

        def weights(start: int, end: int) -> int:
            tail = end == self.total_blocks
            return (end - start) * self.sizes.block_bytes + self.ends_bytes(start == 0, tail, tail)

        longest = max(old[1] - old[0], new[1] - new[0])
        train = self.train_bytes(longest, self.total_blocks in (old[1], new[1]))
        reserved = self.cache_bytes(longest) + self.headroom_bytes + train
        return weights(*old) + weights(*new) + reserved <= self.free_bytes

    def describe(self, device: str) -> str:
        """The plan in one line, with what is reserved and why."""
        n, size = self.blocks, self.sizes.block_bytes
        text = (
            f"{n} of {self.total_blocks} blocks fit: {self.free_bytes / GiB:.1f} GiB free on {device}, "
            f"{size / GiB:.2f} GiB per block ({self.quant} weights), {self.cache_bytes(n) / GiB:.2f} GiB for a "
            f"cache budget of {self.cache_budget_tokens(n)} tokens, {self.headroom_bytes / GiB:.2f} GiB headroom "
            "for activations"
        )
        if self.train_kept_bytes or self.backward_block_bytes or self.backward_bytes:
            text += (
                f", {self.train_bytes(n, False) / GiB:.2f} GiB more for training steps (inputs kept for backwards: "
                f"{self.train_kept_bytes / GiB:.2f} GiB; replies kept for resends: "
                f"{self.train_replies_bytes / GiB:.2f} GiB; the largest backward's activations: "
                f"{self.backward_budget(n, False) / GiB:.2f} GiB, shared with the headroom)"
            )
        head, tail = self.head_blocks, self.tail_blocks
        text += (
            f"; a span at the head also holds the embeddings ({self.sizes.embed_bytes / GiB:.2f} GiB): "
            f"{_count(head)}; at the tail the final norm and LM head ({self.sizes.tail_bytes / GiB:.2f} GiB)"
        )
        if self.drafter_bytes and self.tail_drafter:
            text += f" and the drafter ({self.drafter_bytes / GiB:.2f} GiB): {_count(tail)}"
            without = self.most_blocks(tail=True, drafter=False)
            if without > tail:
                text += f" ({without} without it)"
        elif self.drafter_bytes:
            text += f": {_count(tail)}, without the drafter ({self.drafter_bytes / GiB:.2f} GiB does not fit)"
        else:
            text += f": {_count(tail)}"
        return text

    def shortfall(self, start: int, end: int, device: str) -> str:
        """One line for blocks the volunteer asked for that do not fit."""
        head, tail = start == 0, end == self.total_blocks
        n = end - start
        parts = [f"{n} x {self.sizes.block_bytes / GiB:.2f} GiB of blocks ({self.quant} weights)"]
        ends = self.ends_bytes(head, tail, drafter=False)
        if ends:
            parts.append(
                f"{ends / GiB:.2f} GiB for the {'embeddings' if head else ''}"
                f"{' and ' if head and tail else ''}{'LM head' if tail else ''}"
            )
        parts.append(f"{self.cache_bytes(n) / GiB:.2f} GiB of cache ({self.cache_budget_tokens(n)} tokens)")
        parts.append(f"{self.headroom_bytes / GiB:.2f} GiB headroom")
        if self.train_bytes(n, tail):
            parts.append(f"{self.train_bytes(n, tail) / GiB:.2f} GiB for training steps")
        needed = self.needed_bytes(n, head, tail, drafter=False)
        most = self.most_blocks(head, tail, drafter=False)
        return (
            f"blocks {start}:{end} do not fit: they need {needed / GiB:.2f} GiB ({', '.join(parts)}) and "
            f"{self.free_bytes / GiB:.2f} GiB is free on {device}; {_count(most)} would fit there "
            "(try fewer blocks, --quant nf4 or int8, a smaller --dtype or --cache-tokens, or another --device)"
        )


def _count(blocks: int) -> str:
    return "none" if blocks == 0 else f"{blocks} block" + ("s" if blocks > 1 else "")


def blocks_that_fit(
    bytes_per_block: int, free_bytes: int, cache_bytes: int, total_blocks: int, *, reserve_bytes: int = 0
) -> int:
    """Blocks whose weights fit in ``free_bytes`` after ``cache_bytes`` and ``reserve_bytes``.

    Raises ValueError, naming the numbers, when not even one block fits.
    """
    if bytes_per_block <= 0 or total_blocks <= 0:
        raise ValueError(f"bytes_per_block and total_blocks must be positive, got {bytes_per_block}, {total_blocks}")
    room = free_bytes - cache_bytes - reserve_bytes
    blocks = min(total_blocks, max(0, room) // bytes_per_block)
    if blocks < 1:
        raise ValueError(
            f"not even one block fits: a block needs {bytes_per_block / GiB:.2f} GiB and only {room / GiB:.2f} GiB "
            f"of {free_bytes / GiB:.2f} GiB free is left after {cache_bytes / GiB:.2f} GiB for the cache and "
            f"{reserve_bytes / GiB:.2f} GiB reserved; pass --num-blocks or --blocks, --quant nf4 or int8, "
            "a smaller --dtype, or another --device"
        )
    return blocks


def free_device_bytes(device: str) -> int:
    """Free memory of ``device``: CUDA's free bytes, or the host's available RAM for the CPU."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    import psutil

    return psutil.virtual_memory().available


def model_sizes(config: PretrainedConfig, dtype: torch.dtype, quant: Quant = Quant.NONE) -> ModelSizes:
    """Bytes of a block, the embeddings and the tail's modules once loaded in ``dtype`` and
    ``quant``, from a meta-device model (no memory, no download). Embeddings and the LM head
    stay unquantized, as transformers leaves them."""
    from transformers import AutoModelForCausalLM

    from server.adapters import adapter_class

    adapter = adapter_class(config)
    config = copy.deepcopy(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    dtype_of = _held_dtypes(type(model), adapter.dtype_plan(dtype), dtype)
    per_block = 0
    for layer in model.model.layers:
        per_block = max(per_block, estimate_module_bytes(layer, quant, dtype, dtype_of, adapter.stacked_linears))
    size = torch.finfo(dtype).bits // 8

    def nbytes(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters()) * size

    embeddings, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = lm_head.weight is embeddings.weight
    extras = [m for name, m in model.model.named_children() if name not in ("embed_tokens", "layers")]  # norm, hc_head
    tail = sum(nbytes(m) for m in extras) + size * lm_head.weight.numel()
    cache = max(adapter.span_cache_bytes_per_token(config, i, i + 1, dtype) for i in range(config.num_hidden_layers))
    return ModelSizes(per_block, nbytes(embeddings), tail, tied, cache)


def _held_dtypes(
    model_class: type, plan: Callable[[str], torch.dtype], dtype: torch.dtype
) -> Callable[[str], torch.dtype]:
    """The adapter's plan, plus transformers' own float32 rule for ``model_class`` (DeepSeek-V3's and
    GLM-4-MoE's routers stay float32 in a bfloat16 span, as :mod:`server.adapters.llama` loads them):
    a plan that priced them at ``dtype`` would let a server take more blocks than it can hold."""
    from server.adapters.llama import keeps_float32

    keeps = keeps_float32(model_class, dtype)
    return lambda name: torch.float32 if keeps(name) else plan(name)


def model_bytes(config: PretrainedConfig, dtype: torch.dtype, quant: Quant = Quant.NONE) -> tuple[int, int]:
    """(bytes of the largest block, bytes of embeddings + LM head) once loaded in ``dtype`` and
    ``quant``: what a server holding the whole model keeps besides its blocks, roughly."""
    sizes = model_sizes(config, dtype, quant)
    lm_head = sizes.tail_bytes if not sizes.tied else 0
    return sizes.block_bytes, sizes.embed_bytes + lm_head


def activation_bytes_per_position(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Activation bytes one position of a batched pass holds at its peak inside a block: the
    hidden row and its residual, q/k/v and the attention output, the MLP's gate, up and product
    (in ``dtype``), and at the tail one float32 logits row. Attention scores are per session and
    bounded by its own Step, so they are not multiplied by the batch."""
    hidden, inner = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    width = getattr(config, "hc_mult", 1)  # DeepSeek-V4's hyper-connection streams
    return (torch.finfo(dtype).bits // 8) * (width * 2 * hidden + 4 * hidden + 3 * inner) + 4 * config.vocab_size


def trains(config: PretrainedConfig, quant: Quant) -> bool:
    """Whether spans of this model take training steps at all (else the plan keeps no room for them)."""
    from server.adapters import adapter_class
    from server.adapters.base import SpanAdapter

    return quant == Quant.NONE and adapter_class(config).backward_refusal is not SpanAdapter.backward_refusal


def batch_bytes(config: PretrainedConfig, dtype: torch.dtype, positions: int = DEFAULT_MAX_BATCH_POSITIONS) -> int:
    """What the memory plan reserves for the largest batched pass of ``positions`` positions."""
    return positions * activation_bytes_per_position(config, dtype)


def batch_positions_that_fit(config: PretrainedConfig, dtype: torch.dtype, free_bytes: int) -> int:
    """The default ``--max-batch-positions``: what the headroom share of free memory holds, at
    most DEFAULT_MAX_BATCH_POSITIONS and at least 64."""
    fit = int(free_bytes * HEADROOM_FRACTION) // activation_bytes_per_position(config, dtype)
    return max(64, min(DEFAULT_MAX_BATCH_POSITIONS, fit))


def plan_blocks(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: str,
    total_blocks: int,
    free_bytes: int | None = None,
    quant: Quant = Quant.NONE,
    drafter_bytes: int = 0,
    cache_tokens: int | None = None,
    batch_positions: int | None = None,
    adapter_bytes: int = 0,
    training: Optional[tuple[int, int, int]] = None,
) -> MemoryPlan:
    """The memory plan of this server: ``free_bytes`` stands in for the device's free memory when given.
    ``batch_positions`` (--max-batch-positions): the largest batched pass; by default it is what the
    headroom holds (:func:`batch_positions_that_fit`), and a larger one reserves the rest beside it.
    ``adapter_bytes``: what LoRA adapters add to a block at most (server/lora.py), counted in every block.
    ``training``: (--max-train-mib, --max-positions-per-step, --max-backward-mib): the kept inputs, the replies
    kept for resends (1/REPLY_SHARE of --max-train-mib, server/train_replay.py) and the largest backward
    counted (:meth:`MemoryPlan.train_bytes`); none for spans that refuse training."""
    free = free_device_bytes(device) if free_bytes is None else free_bytes
    sizes = model_sizes(config, dtype, quant)
    sizes = dataclasses.replace(sizes, block_bytes=sizes.block_bytes + adapter_bytes)
    extra = 0
    if batch_positions is not None:  # the activations of the largest pass beyond the headroom
        extra = max(0, batch_bytes(config, dtype, batch_positions) - int(free * HEADROOM_FRACTION))
    plan = MemoryPlan(total_blocks, free, sizes, quant.value, drafter_bytes, cache_tokens, extra)
    if training is None or not trains(config, quant):
        return plan
    kept_mib, positions, backward_mib = training
    tail_only = backward_bytes(config, dtype, positions, 0, True)
    return dataclasses.replace(
        plan,
        train_kept_bytes=kept_mib << 20,
        train_replies_bytes=(kept_mib << 20) // REPLY_SHARE,
        backward_block_bytes=backward_bytes(config, dtype, positions, 1, False),
        backward_tail_bytes=tail_only,
        backward_bytes=backward_mib << 20,
    )
