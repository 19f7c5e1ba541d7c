"""Several sessions' positions through DeepSeek-V4 decoder layers in one pass (continuous batching,
server/batching.py; the packing is server/adapters/packing.py).

What runs once over the packed row of all members' positions (every weight read once per pass):
the hyper-connections of both sub-blocks (stream norm, the ``fn`` projection, Sinkhorn, collapse,
expand and the ``comb`` mixing: all per position), the norms, the attention's q/kv projections
and norms, rotary embeddings (elementwise per position), the inverse rotary of the outputs, the
grouped output projections, and the whole MoE (routers, hash routing by each position's own
token id, routed and shared experts).

What runs per member, over its own slice of the row and its own cache, and why:
* the sliding-window cache update and the attention (with its sinks), as for the Llama family:
  each member attends to its own keys with its own mask;
* on CSA/HCA layers, the compressor and (CSA) the lightning indexer, whole, projections included:
  transformers' compressor modules take the cache and interleave their projections with the
  cache's per-member state (the partial-window buffer, the overlap slice of the previous window,
  the emitted entries and where the next window begins), so one call serves one cache. Their
  weights are a small part of a layer (two ``hidden -> head_dim`` projections, plus the indexer's
  ``q_lora_rank -> index_heads * index_head_dim`` query and its ``hidden -> index_heads`` weights
  on CSA layers), next to the attention projections and the experts read once for the batch.

Each member's rows are what the layer gives it alone up to the rounding of rows computed together
(docs/design.md); the per-member parts are the very same transformers calls.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb, eager_attention_forward

from server.adapters.packing import Packed


def decoder_layer(
    layer: torch.nn.Module, hidden: torch.Tensor, token_ids: torch.Tensor, packed: Packed, position_embeddings: dict
) -> torch.Tensor:
    """One DeepseekV4DecoderLayer over the packed row ``hidden`` [1, T, hc_mult, D] (``token_ids``
    [1, T] for the hash-routed MoE), as its own forward does it."""
    dtype = hidden.dtype
    post, comb, collapsed = layer.attn_hc(hidden)
    attended = _attention(layer.self_attn, layer.input_layernorm(collapsed), packed, position_embeddings)
    hidden = post.to(dtype).unsqueeze(-1) * attended.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), hidden
    )
    post, comb, collapsed = layer.ffn_hc(hidden)
    mlp_output = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=token_ids)
    return post.to(dtype).unsqueeze(-1) * mlp_output.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), hidden
    )


def _attention(attn: torch.nn.Module, hidden: torch.Tensor, packed: Packed, position_embeddings: dict) -> torch.Tensor:
    """DeepseekV4Attention.forward with the projections over the packed row and the cache update,
    compressor and attention per member."""
    num = hidden.shape[1]
    shape = (1, num, -1, attn.head_dim)
    cos, sin = position_embeddings[attn.rope_layer_type]
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    q = attn.q_b_norm(attn.q_b_proj(q_residual).view(shape).transpose(1, 2))
    q = apply_rotary_pos_emb(q, cos, sin)
    kv = apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(hidden)).view(shape).transpose(1, 2), cos, sin)
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, eager_attention_forward
    )
    outputs = []
    for member, (a, b), mask in zip(packed.members, packed.bounds, packed.masks):
        # a copy: the cache keeps this tensor, which must not hold the whole packed row
        own = kv[:, :, a:b].contiguous()
        keys = member.cache.update(own, own, attn.layer_idx)[0]
        if attn.compressor is not None:
            position_ids = packed.position_ids[:, a:b]
            compressed, block_bias = attn.compressor(
                hidden[:, a:b], q_residual[:, a:b], position_ids, member.cache, attn.layer_idx
            )
            keys = torch.cat([keys, compressed], dim=2)
            if keys.shape[2] > mask.shape[-1]:
                extra = block_bias.to(mask.dtype) if block_bias is not None else None
                mask = (
                    torch.cat([mask, extra], dim=-1)
                    if extra is not None
                    else F.pad(mask, (0, keys.shape[2] - mask.shape[-1]))
                )
        out, _ = interface(
            attn,
            q[:, :, a:b],
            keys,
            keys,
            mask,
            dropout=0.0,
            scaling=attn.scaling,
            sliding_window=attn.sliding_window,
            s_aux=attn.sinks,
        )
        outputs.append(out)  # [1, S, heads, head_dim]
    attended = torch.cat(outputs, dim=1)
    # K = V: undo the rope on the outputs' rope slice (elementwise per position, so over the packed row)
    attended = apply_rotary_pos_emb(attended.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn.o_a_proj(attended.reshape(1, num, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped)
