"""Several sessions' positions through Llama-family decoder layers in one pass (continuous
batching, server/batching.py).

The sessions' new positions are packed into one row of T positions: the norms and the MLP or
mixture of experts (most of a block's weights and time) run once over all T, each token routed by
its own router logits, so a pass's members share the experts' matmuls and each keeps its own
routing. Attention reads each member's own cache, so it runs per member, in one of two ways:

- packed (``packs_attention``, attentions with ``q_proj/k_proj/v_proj``: Llama, Mistral, Qwen,
  Mixtral, Qwen-MoE, GLM-4-MoE): the q/k/v/o projections run over the packed row, and rotary
  embeddings, the cache update and the attention kernel per member, through the same transformers
  functions the layer uses alone;
- one member at a time (DeepSeek-V3's latent attention, which has no q/k/v to pack, and gpt-oss's
  eager attention with sinks): transformers' own attention module over the member's rows, with its
  own cache, mask and rotary slice, exactly as the layer calls it alone.

Packing, not padding: no position is computed that no session asked for, and no cache is copied.
Each session's rows are what the layer gives it alone up to the rounding of rows computed
together (docs/design.md). Sliding-window layers (Mistral, Qwen2's upper layers, gpt-oss's
alternate layers) batch the same way: their caches keep every position and each member's mask
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
    packs_attention: bool = True,
) -> torch.Tensor:
    """One decoder layer over the packed row ``hidden`` [1, T, H], as its own forward does it;
    ``window``: the layer's sliding window (None: full attention), which picks each member's mask
    (``packed.masks[j]`` maps a window to that member's mask); ``packs_attention``: whether the
    attention's projections run over the packed row (else its module runs member by member)."""
    attention = _attention if packs_attention else _attention_per_member
    attended = attention(layer.self_attn, layer.input_layernorm(hidden), packed, cos_sin, window)
    hidden = hidden + attended
    mixed = layer.mlp(layer.post_attention_layernorm(hidden))  # every member's tokens at once, each routed alone
    if isinstance(mixed, tuple):  # gpt-oss's MLP also returns its router scores
        mixed = mixed[0]
    return hidden + mixed


def _attention_per_member(
    attn: torch.nn.Module,
    hidden: torch.Tensor,
    packed: Packed,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    window: Optional[int],
) -> torch.Tensor:
    """transformers' attention module (its projections, rotary, cache update, kernel and output
    projection) over each member's rows in turn, called as the decoder layer calls it alone."""
    cos, sin = cos_sin
    outputs = []
    for member, (a, b), masks in zip(packed.members, packed.bounds, packed.masks):
        out, _ = attn(
            hidden_states=hidden[:, a:b],
            attention_mask=masks[window],
            position_ids=packed.position_ids[:, a:b],
            cache=member.cache,
            use_cache=True,
            position_embeddings=(cos[:, a:b], sin[:, a:b]),
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1)


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
