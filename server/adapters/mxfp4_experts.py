"""gpt-oss's routed experts as OpenAI publishes them: MXFP4 ``experts.gate_up_proj_blocks`` /
``_scales`` (uint8: two 4-bit codes a byte, 32 values sharing one power-of-two exponent), read
and dequantized on the CPU by transformers' own ``convert_moe_packed_tensors`` (what
``Mxfp4Config(dequantize=True)`` runs), into the fused float parameter ``experts.gate_up_proj``
that transformers' ``GptOssExperts`` holds.

Why dequantize: transformers' MXFP4 matmuls need its Triton kernels (a GPU and a download from the
kernels hub), and a span must equal transformers' CPU reference; the experts are then held in
``--dtype``, which is what the memory plan counts (the meta model it measures has float experts).
Only the span's layers are read, a few experts at a time (transformers' function takes any
leading expert axis), so the host's peak beyond the fused parameter is those experts' temporaries,
not a whole layer's; a quantized span takes them expert by expert and never holds the fused
parameter in float (server/adapters/gpt_oss_experts.py).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from server.weights import Checkpoint

BLOCKS, SCALES = "_blocks", "_scales"
EXPERTS_PER_DEQUANTIZE = 16


def packed_target(key: str, wanted: Iterable[str]) -> Optional[str]:
    """The parameter a ``*_blocks`` key makes (its name without the suffix) when the span wants it."""
    if not key.endswith(BLOCKS):
        return None
    target = key.removesuffix(BLOCKS)
    return target if target in wanted else None


def scales_key(blocks_key: str, keys: Iterable[str]) -> str:
    """The ``*_scales`` companion of ``blocks_key``; an error naming it when the checkpoint lacks it."""
    key = blocks_key.removesuffix(BLOCKS) + SCALES
    if key not in keys:
        raise KeyError(f"the checkpoint has MXFP4 blocks {blocks_key!r} but no scales {key!r}")
    return key


def iter_dequantized(
    checkpoint: Checkpoint, blocks_key: str, scales_key: str, dtype: torch.dtype
) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its slice [in, out] of the fused parameter) of one MXFP4 pair, in ``dtype``,
    EXPERTS_PER_DEQUANTIZE experts dequantized at a time (a quantized span assigns each as it comes)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    raw = checkpoint.read([blocks_key, scales_key], torch.float32, progress=False)  # uint8 stays uint8
    blocks, scales = raw[blocks_key], raw[scales_key]
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"{blocks_key}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
            f"{scales.dtype} do not match (uint8, blocks [..., G, 16] over scales [..., G])"
        )
    for begin in range(0, blocks.shape[0], EXPERTS_PER_DEQUANTIZE):
        end = begin + EXPERTS_PER_DEQUANTIZE
        part = convert_moe_packed_tensors(blocks[begin:end], scales[begin:end], dtype=dtype)
        yield from zip(range(begin, begin + part.shape[0]), part)


def dequantize(checkpoint: Checkpoint, blocks_key: str, scales_key: str, dtype: torch.dtype) -> torch.Tensor:
    """The fused parameter ([E, in, out], as ``GptOssExperts`` holds it) of one MXFP4 pair, in ``dtype``."""
    return torch.stack([expert for _, expert in iter_dequantized(checkpoint, blocks_key, scales_key, dtype)])
