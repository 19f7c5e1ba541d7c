"""A tiny DeepSeek-V4 checkpoint rewritten in DeepSeek's own hub layout: FP8 and FP4 weights with
their scales, as the released checkpoints ship them (tests of server/quantization.py's loaders)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0))


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp_min(1e-30))))


def _fp8_blocks(w: torch.Tensor, block: int = 16):
    """FP8 e4m3 weight with one ue8m0 scale per [block, block] tile (DeepSeek's layout, small tiles)."""
    rows, cols = w.shape
    tiles = w.reshape(rows // block, block, cols // block, block)
    scale = _pow2_at_least(tiles.abs().amax(dim=(1, 3)) / 448.0)
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (q.float() * scale[:, None, :, None]).reshape(rows, cols)
    return q.reshape(rows, cols), scale.to(torch.float8_e8m0fnu), dequantized


def _fp4_rows(w: torch.Tensor, group: int = 32):
    """FP4 e2m1, two per int8 byte (low nibble first), one ue8m0 scale per 32 values of a row."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    scale = _pow2_at_least(groups.abs().amax(-1) / 6.0)
    codes = ((groups / scale[..., None]).abs().unsqueeze(-1) - E2M1[:8]).abs().argmin(-1) + 8 * (groups < 0)
    dequantized = (E2M1[codes] * scale[..., None]).reshape(rows, cols)
    codes = codes.reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), dequantized


def quantize_like_deepseek(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A copy in DeepSeek's hub layout: its names (no ``model.`` prefix, ``embed``, ``head``,
    ``hc_head_fn``...), FP8 attention/shared-expert linears and FP4 routed experts with ``.scale``
    companions. Returns the dequantized value of every quantized weight."""
    shutil.copytree(src, dst)
    out, expected = {}, {}
    leaf = {
        "embed_tokens.weight": "embed.weight",
        "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base",
        "hc_head.hc_scale": "hc_head_scale",
    }
    for key, tensor in load_file(src / "model.safetensors").items():
        name = key.removeprefix("model.")
        name = leaf.get(name, name)
        if re.search(r"ffn\.experts\.\d+\.w[123]\.weight$", name):
            out[name], out[name.removesuffix("weight") + "scale"], expected[name] = _fp4_rows(tensor.float())
        elif re.search(r"attn\.(wq_a|wq_b|wkv|wo_b)\.weight$|shared_experts\.w[123]\.weight$", name):
            out[name], out[name.removesuffix("weight") + "scale"], expected[name] = _fp8_blocks(tensor.float())
        else:
            out[name] = tensor
    (dst / "model.safetensors").unlink()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [16, 16],
        "scale_fmt": "ue8m0",
    }
    config["expert_dtype"] = "fp4"
    (dst / "config.json").write_text(json.dumps(config))
    return expected
