"""Several sessions' positions through Llama-family decoder layers in one pass (continuous
batching, server/batching.py).

The sessions' new positions are packed into one row of T positions: the norms, the q/k/v/o
projections and the MLP (most of a block's weights and time) run once over all T, while rotary
embeddings, the cache update and attention run per session, over that session's own cache with
its own mask, through the same transformers functions a layer uses alone. Packing, not padding:
no position is computed that no session asked for, and no cache is copied.

Each session's rows are what the layer gives it alone up to the rounding of rows computed
together (docs/design.md); attention itself is the very same call. Sliding-window layers (Mistral,
Qwen2's upper layers) batch the same way: their caches keep every position and each member's mask
for the layer's window hides what lies outside it (LlamaFamilyAdapter builds the masks).
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from server.adapters.packing import Packed


def decoder_layer(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    packed: Packed,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    window: Optional[int] = None,
) -> torch.Tensor:
    """One LlamaDecoderLayer over the packed row ``hidden`` [1, T, H], as its own forward does it;
    ``window``: the layer's sliding window (None: full attention), which picks each member's mask
    (``packed.masks[j]`` maps a window to that member's mask)."""
    attended = _attention(layer.self_attn, layer.input_layernorm(hidden), packed, cos_sin, window)
    hidden = hidden + attended
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _attention(
    attn: torch.nn.Module,
    hidden: torch.Tensor,
    packed: Packed,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    window: Optional[int],
) -> torch.Tensor:
    """LlamaAttention.forward (and Qwen3's, with its q/k norms) with projections over the packed
    row and the rest per member."""
    shape = (1, hidden.shape[1], -1, attn.head_dim)
    query, key, value = (
        attn.q_proj(hidden).view(shape),
        attn.k_proj(hidden).view(shape),
        attn.v_proj(hidden).view(shape),
    )
    if hasattr(attn, "q_norm"):
        query, key = attn.q_norm(query), attn.k_norm(key)
    # rotary embeddings are elementwise per position: the packed row at once equals each member's own
    query, key = _rotary_of(attn)(query.transpose(1, 2), key.transpose(1, 2), *cos_sin)  # [1, heads, T, head_dim]
    value = value.transpose(1, 2)
    interface: Callable = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
    outputs = []
    for member, (a, b), masks in zip(packed.members, packed.bounds, packed.masks):
        mask = masks[window]
        # copies: a new cache keeps these tensors, which must not hold the whole packed row
        k, v = member.cache.update(key[:, :, a:b].contiguous(), value[:, :, a:b].contiguous(), attn.layer_idx)
        out, _ = interface(attn, query[:, :, a:b], k, v, mask, dropout=0.0, scaling=attn.scaling)
        outputs.append(out.reshape(1, b - a, -1))
    return attn.o_proj(torch.cat(outputs, dim=1))


def _rotary_of(attn: torch.nn.Module) -> Callable:
    """The family's own apply_rotary_pos_emb, from the module that defines its attention."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb
