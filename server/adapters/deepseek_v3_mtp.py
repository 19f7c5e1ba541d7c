"""DeepSeek-V3's multi-token-prediction (MTP) layer as the tail's drafter.

A DeepSeek-V3 checkpoint (also R1, Kimi K2) ships ``num_nextn_predict_layers`` (1) MTP layers
numbered after the main ones (``model.layers.61.*`` for V3's 61 blocks). transformers builds no
module for them, so this file composes one from transformers' own V3 parts, as DeepSeek's
reference inference code does::

    x = eh_proj(cat(enorm(embed(token_{t+1})), hnorm(h_t)))   # h_t: the last main block's output
    x = layer(x)                                               # a DeepseekV3DecoderLayer (MoE)
    logits = lm_head(shared_head.norm(x))                      # the main model's LM head

Like EAGLE (server/tail_drafter.py), position t pairs the main model's hidden state at t with the
embedding of token t + 1 and predicts token t + 2; drafting further feeds the layer's own output
back as the hidden state. The session logic (rollback to a run's ``start_pos``, the entry before
it redone) is :class:`server.tail_drafter.TailDrafter`'s; the layer's cache is a one-layer
``DynamicCache`` (latent attention's compressed latent), trimmed exactly like the span's.

The checkpoint's ``embed_tokens`` and ``shared_head.head`` copies under the MTP layer are the main
model's (DeepSeek shares them), so the drafter reads the main ``model.embed_tokens.weight`` and
uses the tail's LM head. The layer's tensors are mapped like a main block's
(server/adapters/expert_weights.py: per-expert tensors fused, FP8 dequantized) and quantized like
the span's under ``--quant``.
"""

from __future__ import annotations

import copy
import itertools
from typing import Callable, Optional

import torch
from transformers import DynamicCache, PretrainedConfig

from server.adapters import expert_weights, fused_experts
from server.quantization import Quant, assign_tensor, checkpoint_names
from server.tail_drafter import DEFAULT_TAIL_DRAFTS, EagleDrafter
from server.weights import Checkpoint

# the MTP layer's own tensors besides its decoder layer: checkpoint name (after the layer's prefix) -> module name
OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "shared_norm.weight",
}


def has_mtp(config: PretrainedConfig, checkpoint: Optional[Checkpoint]) -> bool:
    if not (getattr(config, "num_nextn_predict_layers", 0) or 0) >= 1:
        return False
    return checkpoint is None or f"model.layers.{config.num_hidden_layers}.eh_proj.weight" in checkpoint.weight_map()


class DeepseekV3MTP(torch.nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
            DeepseekV3RotaryEmbedding,
        )

        self.config = copy.deepcopy(config)
        self.config._attn_implementation = "sdpa"
        self.config.num_hidden_layers = 1
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = DeepseekV3RMSNorm(hidden, eps), DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)  # >= first_k_dense_replace: MoE
        self.layer.self_attn.layer_idx = 0  # its own one-layer cache
        self.shared_norm = DeepseekV3RMSNorm(hidden, eps)
        self.rotary_emb = DeepseekV3RotaryEmbedding(config=self.config)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def forward(
        self,
        features: torch.Tensor,  # [1, S, H] the main model's last block output at positions t
        embeds: torch.Tensor,  # [1, S, H] embeddings of the tokens at t + 1
        position_ids: torch.Tensor,
        cache: Optional[DynamicCache] = None,
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1))
        position_embeddings = self.rotary_emb(x, position_ids=position_ids)
        return self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            position_embeddings=position_embeddings,
        )


def load_mtp(
    config: PretrainedConfig, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, quant: Quant
) -> DeepseekV3MTP:
    with torch.device("meta"):
        mtp = DeepseekV3MTP(config).to(dtype)
    prefix = f"model.layers.{config.num_hidden_layers}."
    targets = {prefix + key: name for key, name in OWN.items()}  # checkpoint name -> module name
    targets.update({prefix + name: "layer." + name for name in checkpoint_names(mtp.layer)})  # before quantizing
    fused_experts.quantize_skeleton(mtp.layer, quant, dtype)
    split = set()
    if quant != Quant.NONE:
        split = {t for t, n in targets.items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    sources = expert_weights.map_keys("deepseek_v3", checkpoint.weight_map(), targets)
    desc = f"Loading the MTP layer {prefix}"
    # its router stays float32, as in the blocks (llama.keeps_float32): routing picks the experts transformers' would
    keeps = _keeps_float32(dtype)
    kept = [source for target, source in sources.items() if keeps(target)]
    rest = [source for target, source in sources.items() if not keeps(target)]
    tensors = itertools.chain(
        expert_weights.iter_tensors(checkpoint, rest, dtype, desc=desc, per_expert=split),
        expert_weights.iter_tensors(checkpoint, kept, torch.float32, desc=desc, per_expert=split) if kept else (),
    )
    for target, expert, tensor in tensors:
        name = targets[target]
        if expert is None:
            assign_tensor(mtp, name, tensor, device)
        else:
            experts_name, _, param = name.rpartition(".")
            experts = mtp.get_submodule(experts_name)
            assign_tensor(
                (experts.gate_up if param == "gate_up_proj" else experts.down)[expert], "weight", tensor, device
            )
    mtp.rotary_emb = type(mtp.rotary_emb)(config=mtp.config).to(device)
    mtp.to(device).eval().requires_grad_(False)
    meta = [n for n, t in mtp.named_parameters() if t.is_meta]
    if meta:
        raise RuntimeError(f"the MTP layer {prefix} left parameters unloaded: {meta[:3]}")
    return mtp


class MTPDrafter(EagleDrafter):
    """The MTP layer as a tail drafter: features are the last main block's outputs as they are (no
    final norm), its own output is the next step's feature, a token is the argmax of the LM head
    over ``shared_head.norm`` of it."""

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.dtype)

    def _predicted(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def _next_token(self, feature: torch.Tensor) -> int:
        return int(torch.argmax(torch.nn.functional.linear(self.net.shared_norm(feature[0, -1]), self.rows)))


def build_mtp_drafter(
    span, config: PretrainedConfig, checkpoint: Checkpoint, max_drafts: int = DEFAULT_TAIL_DRAFTS
) -> Optional[MTPDrafter]:
    """The tail's MTP drafter, or None when the checkpoint has no MTP layer."""
    if not has_mtp(config, checkpoint):
        return None
    mtp = load_mtp(config, checkpoint, span.dtype, span.device, span.quant)
    ((_, embed_weight),) = list(
        checkpoint.iter_read(["model.embed_tokens.weight"], span.dtype, desc="Loading embeddings for the MTP drafter")
    )
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return MTPDrafter(mtp, span.norm, span.lm_head, embed_weight.to(span.device), None, max_drafts, eos_ids)


def mtp_bytes(config: PretrainedConfig, dtype: torch.dtype, quant: Quant) -> int:
    """Resident bytes of the MTP layer and the embeddings it reads, for the memory plan."""
    from server.quantization import estimate_module_bytes

    with torch.device("meta"):
        mtp = DeepseekV3MTP(config)
    keeps = _keeps_float32(dtype)
    dtype_of = lambda name: torch.float32 if keeps("layer." + name) else dtype  # noqa: E731
    block = estimate_module_bytes(mtp.layer, quant, dtype, dtype_of, (fused_experts.FusedExperts,))
    size = torch.finfo(dtype).bits // 8
    rest = sum(p.numel() for n, p in mtp.named_parameters() if not n.startswith("layer.")) * size
    buffers = sum(b.numel() * b.element_size() for n, b in mtp.named_buffers() if not n.startswith("layer."))  # rotary
    return block + rest + buffers + config.vocab_size * config.hidden_size * size


def _keeps_float32(dtype: torch.dtype) -> Callable[[str], bool]:
    """DeepSeek-V3's float32 rule (its router weight and score correction bias), as its blocks load them."""
    from transformers import DeepseekV3ForCausalLM

    from server.adapters.llama import keeps_float32

    return keeps_float32(DeepseekV3ForCausalLM, dtype)
