"""DeepSeek-V4's routed experts as bitsandbytes linears, one per expert and projection.

transformers keeps a layer's routed experts fused in two 3-D parameters (``gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I]), which bitsandbytes' linear layers cannot hold and
transformers' own bitsandbytes path leaves unquantized. They are nearly all of a V4 block
(V4-Pro: 384 experts of 3 x 3072 x 7168 per layer), so a quantized span splits them into
``E`` pairs of int8/NF4 linears, each quantized as its expert is read. The forward is
transformers' eager expert loop with ``F.linear(x, W[e])`` replaced by the expert's linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

from server.quantization import Quant, assign_tensor, replace_linears


class QuantizedExperts(torch.nn.Module):
    def __init__(self, experts: DeepseekV4Experts, quant: Quant, compute_dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.hidden_dim = experts.num_experts, experts.hidden_dim
        self.intermediate_dim = experts.intermediate_dim
        self.act_fn, self.limit = experts.act_fn, experts.limit
        with torch.device("meta"):
            gate_up = [
                torch.nn.Linear(self.hidden_dim, 2 * self.intermediate_dim, bias=False) for _ in range(self.num_experts)
            ]
            down = [
                torch.nn.Linear(self.intermediate_dim, self.hidden_dim, bias=False) for _ in range(self.num_experts)
            ]
        self.gate_up = replace_linears(torch.nn.ModuleList(gate_up), quant, compute_dtype)
        self.down = replace_linears(torch.nn.ModuleList(down), quant, compute_dtype)

    _apply_gate = DeepseekV4Experts._apply_gate

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
            current = self._apply_gate(self.gate_up[expert_idx](hidden_states[token_idx]))
            current = self.down[expert_idx](current) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final


def quantize_experts_skeleton(
    layers: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype
) -> dict[str, QuantizedExperts]:
    """Swap every fused expert module under ``layers`` for a :class:`QuantizedExperts` (meta)
    and every plain linear for its bitsandbytes counterpart; returns name -> new experts."""
    replaced: dict[str, QuantizedExperts] = {}
    if quant == Quant.NONE:
        return replaced
    for name, module in list(layers.named_modules()):
        if isinstance(module, DeepseekV4Experts):
            replaced[name] = QuantizedExperts(module, quant, compute_dtype)
            layers.set_submodule(name, replaced[name])
    replace_linears(layers, quant, compute_dtype)
    return replaced


def quantize_loaded_experts(
    layers: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype, device: str = "cpu"
) -> None:
    """Quantize the experts of already loaded float layers in place (for single-process
    references: the same modules and the same per-expert quantization as a loaded span)."""
    for name, module in list(layers.named_modules()):
        if isinstance(module, DeepseekV4Experts):
            new = QuantizedExperts(module, quant, compute_dtype)
            for e in range(new.num_experts):
                assign_tensor(new.gate_up[e], "weight", module.gate_up_proj.data[e].clone(), torch.device(device))
                assign_tensor(new.down[e], "weight", module.down_proj.data[e].clone(), torch.device(device))
            layers.set_submodule(name, new.train(module.training))
