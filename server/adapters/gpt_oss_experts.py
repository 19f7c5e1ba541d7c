"""gpt-oss's routed experts as bitsandbytes linears, one per expert and projection, under ``--quant``.

transformers' ``GptOssExperts`` holds a layer's experts fused and transposed (``gate_up_proj``
[E, H, 2I] with ``gate_up_proj_bias`` [E, 2I]; ``down_proj`` [E, I, H] with ``down_proj_bias``
[E, H]) and computes ``x @ W[e] + b[e]``, then its own clamped, interleaved gate (``_apply_gate``).
bitsandbytes' linears hold 2-D weights, and transformers' bitsandbytes path leaves these experts in
float, yet they are nearly all of a gpt-oss block (gpt-oss-120b: 128 experts of 3 x 2880 x 2880).
So a quantized span splits them into ``E`` pairs of int8/NF4 linears with biases (weight ``W[e].T``),
and the forward is transformers' expert loop with ``x @ W[e] + b[e]`` replaced by the expert's
linear and transformers' own ``_apply_gate``. The memory plan counts them the same way
(:class:`GptOssStackedExperts`, whose 3-D parameters are [E, in, out]).
"""

from __future__ import annotations

from typing import Optional

import torch

from server.quantization import Quant, assign_tensor, replace_linears

PARAMETERS = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}


def is_gpt_oss_experts(module: torch.nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return set(params) == PARAMETERS and params["gate_up_proj"].ndim == 3 and hasattr(module, "_apply_gate")


class _GptOssExpertsMeta(type):
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, torch.nn.Module) and is_gpt_oss_experts(instance)


class GptOssStackedExperts(metaclass=_GptOssExpertsMeta):
    """``isinstance(module, GptOssStackedExperts)`` is :func:`is_gpt_oss_experts`: for the memory
    plan's ``stacked_linears``, whose 3-D parameters here are laid out [E, in, out]."""

    in_out = True


class QuantizedGptOssExperts(torch.nn.Module):
    def __init__(self, experts: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.hidden_size, double_inner = experts.gate_up_proj.shape
        self.intermediate_size = double_inner // 2
        self.alpha, self.limit = experts.alpha, experts.limit
        with torch.device("meta"):
            gate_up = [
                torch.nn.Linear(self.hidden_size, double_inner, dtype=compute_dtype) for _ in range(self.num_experts)
            ]
            down = [
                torch.nn.Linear(self.intermediate_size, self.hidden_size, dtype=compute_dtype)
                for _ in range(self.num_experts)
            ]
        self.gate_up = replace_linears(torch.nn.ModuleList(gate_up), quant, compute_dtype)
        self.down = replace_linears(torch.nn.ModuleList(down), quant, compute_dtype)

    def assign(self, param: str, tensor: torch.Tensor, device: torch.device, expert: Optional[int] = None) -> None:
        """Fill the experts' linears from one of transformers' fused parameters (``param`` in
        PARAMETERS), each quantized as it is assigned; with ``expert``, ``tensor`` is that expert's
        slice only (an MXFP4 checkpoint's experts arrive one by one)."""
        if param not in PARAMETERS:
            raise KeyError(f"gpt-oss experts have no parameter {param!r}")
        linears = self.gate_up if param.startswith("gate_up") else self.down
        slices = enumerate(tensor) if expert is None else [(expert, tensor)]
        for e, part in slices:
            if param.endswith("_bias"):
                assign_tensor(linears[e], "bias", part, device)
            else:
                assign_tensor(linears[e], "weight", part.t().contiguous(), device)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """transformers' own gate (clamp, interleaved gate/up, sigmoid), with this module's alpha and limit."""
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts._apply_gate(self, gate_up)

    def forward(
        self, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> torch.Tensor:
        next_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit.flatten().tolist():
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            gated = self._apply_gate(self.gate_up[expert_idx](hidden_states[token_idx]))
            out = self.down[expert_idx](gated) * routing_weights[token_idx, top_k_pos, None]
            next_states.index_add_(0, token_idx, out.to(hidden_states.dtype))
        return next_states


def quantize_experts(
    experts: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype, device: str = "cpu"
) -> QuantizedGptOssExperts:
    """A loaded float ``GptOssExperts`` quantized by the spans' recipe (for single-process references)."""
    new = QuantizedGptOssExperts(experts, quant, compute_dtype)
    for param in PARAMETERS:
        new.assign(param, getattr(experts, param).data.clone(), torch.device(device))
    return new.train(experts.training)
