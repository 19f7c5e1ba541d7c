"""Routed experts of any family whose transformers module fuses them (``gate_up_proj`` [E, 2I, H]
and ``down_proj`` [E, H, I], no biases, ``act_fn(gate) * up``: Mixtral, Qwen2/3-MoE,
DeepSeek-V3, GLM-4-MoE), as bitsandbytes linears, one per expert and projection.

bitsandbytes' linear layers cannot hold a 3-D parameter and transformers' own bitsandbytes path
leaves fused experts unquantized, yet they are nearly all of an MoE block (Mixtral-8x22B: 8
experts of 3 x 16384 x 6144 per layer). A quantized span therefore splits them into ``E`` pairs of
int8/NF4 linears, each quantized as its expert is read (server/adapters/expert_weights.py yields
them expert by expert). The forward is transformers' eager expert loop with ``F.linear(x, W[e])``
replaced by the expert's linear. DeepSeek-V4 has its own (server/adapters/deepseek_v4_quant.py:
its experts clamp the gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.adapters import gpt_oss_experts
from server.quantization import Quant, assign_tensor, replace_linears


def is_fused_experts(module: torch.nn.Module) -> bool:
    """A module holding a layer's routed experts fused, in the layout this file can split."""
    params = dict(module.named_parameters(recurse=False))
    return (
        set(params) == {"gate_up_proj", "down_proj"}
        and params["gate_up_proj"].ndim == 3
        and params["down_proj"].ndim == 3
        and hasattr(module, "act_fn")
    )


class _FusedExpertsMeta(type):
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, torch.nn.Module) and is_fused_experts(instance)


class FusedExperts(metaclass=_FusedExpertsMeta):
    """``isinstance(module, FusedExperts)`` is :func:`is_fused_experts`: the generic adapter's
    ``stacked_linears``, so the memory plan counts every family's fused experts per expert."""


class QuantizedExperts(torch.nn.Module):
    def __init__(self, experts: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype):
        super().__init__()
        self.num_experts, double_inner, self.hidden_dim = experts.gate_up_proj.shape
        self.intermediate_dim = double_inner // 2
        self.act_fn = experts.act_fn
        with torch.device("meta"):
            gate_up = [
                torch.nn.Linear(self.hidden_dim, double_inner, bias=False, dtype=compute_dtype)
                for _ in range(self.num_experts)
            ]
            down = [
                torch.nn.Linear(self.intermediate_dim, self.hidden_dim, bias=False, dtype=compute_dtype)
                for _ in range(self.num_experts)
            ]
        self.gate_up = replace_linears(torch.nn.ModuleList(gate_up), quant, compute_dtype)
        self.down = replace_linears(torch.nn.ModuleList(down), quant, compute_dtype)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit.flatten().tolist():
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            gate, up = self.gate_up[expert_idx](hidden_states[token_idx]).chunk(2, dim=-1)
            current = self.down[expert_idx](self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final


def quantize_skeleton(layers: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype) -> None:
    """Swap every fused experts module under ``layers`` for a :class:`QuantizedExperts` (meta; gpt-oss's
    for a ``QuantizedGptOssExperts``: server/adapters/gpt_oss_experts.py) and every plain linear for
    its bitsandbytes counterpart."""
    if quant == Quant.NONE:
        return
    for name, module in list(layers.named_modules()):
        if is_fused_experts(module):
            layers.set_submodule(name, QuantizedExperts(module, quant, compute_dtype))
        elif gpt_oss_experts.is_gpt_oss_experts(module):
            layers.set_submodule(name, gpt_oss_experts.QuantizedGptOssExperts(module, quant, compute_dtype))
    replace_linears(layers, quant, compute_dtype)


def quantize_loaded_experts(
    layers: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype, device: str = "cpu"
) -> None:
    """Quantize the fused experts of already loaded float layers in place (for single-process
    references: the same modules and the same per-expert quantization as a loaded span)."""
    for name, module in list(layers.named_modules()):
        if gpt_oss_experts.is_gpt_oss_experts(module):
            layers.set_submodule(name, gpt_oss_experts.quantize_experts(module, quant, compute_dtype, device))
        if is_fused_experts(module):
            new = QuantizedExperts(module, quant, compute_dtype)
            for e in range(new.num_experts):
                assign_tensor(new.gate_up[e], "weight", module.gate_up_proj.data[e].clone(), torch.device(device))
                assign_tensor(new.down[e], "weight", module.down_proj.data[e].clone(), torch.device(device))
            layers.set_submodule(name, new.train(module.training))
