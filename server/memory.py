"""How many blocks a server can hold: weights in the device's free memory after the cache budget.

A volunteer who runs ``python -m swarm.server --model deepseek-v4-pro`` without ``--blocks`` or
``--num-blocks`` gets as many blocks as fit. The arithmetic is a pure function
(:func:`blocks_that_fit`) so it can be tested with a made-up memory budget; the measuring
(free memory of the device, bytes of one block) lives beside it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from server.quantization import Quant, estimate_module_bytes

CACHE_FRACTION = 0.25  # of free memory kept for the KV cache budget (also server.cache_budget.default_cache_tokens)
HEADROOM_FRACTION = 0.05  # of free memory left for activations and allocator slack
DEFAULT_MAX_BATCH_POSITIONS = 1024  # positions of one batched pass (server/batching.py), at most

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers behind a block count, for the server's log."""

    blocks: int
    total_blocks: int
    free_bytes: int
    bytes_per_block: int
    cache_bytes: int
    reserve_bytes: int
    quant: str = "none"
    drafter_bytes: int = 0  # the tail's drafter (DeepSeek-V4's MTP block, a tail drafter), beyond its blocks
    tail_blocks: int = 0  # blocks that fit beside the drafter: the most a span ending at the last block takes

    def describe(self, device: str) -> str:
        text = (
            f"{self.blocks} of {self.total_blocks} blocks fit: {self.free_bytes / GiB:.1f} GiB free on {device}, "
            f"{self.cache_bytes / GiB:.1f} GiB kept for the cache budget, {self.reserve_bytes / GiB:.1f} GiB for "
            f"embeddings/LM head and headroom, {self.bytes_per_block / GiB:.2f} GiB per block ({self.quant} weights)"
        )
        if self.tail_blocks < self.blocks:
            text += f"; {self.tail_blocks} beside the drafter ({self.drafter_bytes / GiB:.2f} GiB) if the span ends at the tail"
        return text


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


def model_bytes(config, dtype: torch.dtype, quant: Quant = Quant.NONE) -> tuple[int, int]:
    """(bytes of the largest block, bytes of embeddings + LM head) once loaded in ``dtype`` and
    ``quant``, from a meta-device model (no memory, no download). Embeddings and the LM head
    stay unquantized, as transformers leaves them."""
    from transformers import AutoModelForCausalLM

    from server.adapters import adapter_class

    adapter = adapter_class(config)
    config = copy.deepcopy(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    dtype_of = adapter.dtype_plan(dtype)
    per_block = 0
    for layer in model.model.layers:
        per_block = max(per_block, estimate_module_bytes(layer, quant, dtype, dtype_of, adapter.stacked_linears))
    size = torch.finfo(dtype).bits // 8

    def nbytes(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters()) * size

    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embeddings.weight  # one tensor when a server holds both ends
    return per_block, nbytes(embeddings) + (0 if tied else nbytes(head))


def activation_bytes_per_position(config, dtype: torch.dtype) -> int:
    """Activation bytes one position of a batched pass holds at its peak inside a block: the
    hidden row and its residual, q/k/v and the attention output, the MLP's gate, up and product
    (in ``dtype``), and at the tail one float32 logits row. Attention scores are per session and
    bounded by its own Step, so they are not multiplied by the batch."""
    hidden, inner = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    width = getattr(config, "hc_mult", 1)  # DeepSeek-V4's hyper-connection streams
    return (torch.finfo(dtype).bits // 8) * (width * 2 * hidden + 4 * hidden + 3 * inner) + 4 * config.vocab_size


def batch_bytes(config, dtype: torch.dtype, positions: int = DEFAULT_MAX_BATCH_POSITIONS) -> int:
    """What the memory plan reserves for the largest batched pass of ``positions`` positions."""
    return positions * activation_bytes_per_position(config, dtype)


def batch_positions_that_fit(config, dtype: torch.dtype, free_bytes: int) -> int:
    """The default ``--max-batch-positions``: what the headroom share of free memory holds, at
    most DEFAULT_MAX_BATCH_POSITIONS and at least 64."""
    fit = int(free_bytes * HEADROOM_FRACTION) // activation_bytes_per_position(config, dtype)
    return max(64, min(DEFAULT_MAX_BATCH_POSITIONS, fit))


def plan_blocks(
    config, dtype: torch.dtype, device: str, total_blocks: int, free_bytes: int | None = None, quant: Quant = Quant.NONE,
    drafter_bytes: int = 0, batch_positions: int = DEFAULT_MAX_BATCH_POSITIONS,
) -> MemoryPlan:
    """How many blocks this server should hold when the volunteer did not say; a span that ends at
    the last block also holds the tail's drafter (``drafter_bytes``), so it may take fewer
    (``tail_blocks``, at least one: a drafter that still does not fit is left out when it fails to load).
    The reserve also holds the activations of the largest batched pass (``batch_positions``)."""
    free = free_device_bytes(device) if free_bytes is None else free_bytes
    per_block, ends = model_bytes(config, dtype, quant)
    cache = int(free * CACHE_FRACTION)
    reserve = ends + int(free * HEADROOM_FRACTION)
    reserve += batch_bytes(config, dtype, batch_positions)  # the largest batched pass
    blocks = blocks_that_fit(per_block, free, cache, total_blocks, reserve_bytes=reserve)
    tail_blocks = max(1, min(blocks, (free - cache - reserve - drafter_bytes) // per_block))
    return MemoryPlan(blocks, total_blocks, free, per_block, cache, reserve, quant.value, drafter_bytes, tail_blocks)
