"""gpt-oss checkpoints in the layout OpenAI publishes them: routed experts as MXFP4
``*_blocks`` (uint8, two 4-bit codes a byte, 32 values a block) and ``*_scales`` (uint8, one
power-of-two exponent + 127 a block), everything else as it was; the config's
``quantization_config`` as the hub's (``quant_method: mxfp4``).

The packing here is the inverse of transformers' ``integrations.mxfp4.convert_moe_packed_tensors``
(what dequantizes them): tests check it round-trips through that function rather than trusting
it. Only tests use it; servers read the published layout with transformers' own function.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

BLOCK = 32  # values per MXFP4 block (one scale each)
PROJECTIONS = ("gate_up_proj", "down_proj")


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [E, rows, G, 16] uint8, scales [E, rows, G] uint8) of a fused expert parameter as
    the module holds it ([E, in, out]; rows = out, G * 32 = in): each block's exponent the smallest
    that brings its largest magnitude within 6 (FP4's largest), each value the nearest FP4 code."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    rows = weight.transpose(1, 2).float()  # [E, out, in]: transformers dequantizes to this, then transposes
    experts, out, inner = rows.shape
    if inner % BLOCK:
        raise ValueError(f"the input size {inner} is not a multiple of {BLOCK}")
    groups = rows.reshape(experts, out, inner // BLOCK, BLOCK)
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)  # ties: the first (+0.0 over -0.0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # transformers: low nibble even, high nibble odd
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def mxfp4_like_the_hub(src: Path, dst: Path) -> Path:
    """A copy of the tiny gpt_oss at ``src`` whose experts' ``gate_up_proj``/``down_proj`` are
    MXFP4 ``_blocks``/``_scales`` (biases, attention, router, embeddings unchanged), with the
    hub's ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {}
    for key, tensor in load_file(src / "model.safetensors").items():
        if key.endswith(tuple(f"mlp.experts.{p}" for p in PROJECTIONS)):
            tensors[key + "_blocks"], tensors[key + "_scales"] = pack_mxfp4(tensor)
        else:
            tensors[key] = tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
