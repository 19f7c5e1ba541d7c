"""DeepSeek-V4's multi-token-prediction (MTP) module as the tail's drafter.

A V4 checkpoint ships ``num_nextn_predict_layers`` MTP modules (``mtp.{i}.*``) next to the main
layers. transformers 5.24 ignores those tensors and builds no MTP module, so this file builds
module 0 from transformers' own V4 parts, as DeepSeek's reference ``MTPBlock(Block)`` composes
them::

    e = enorm(embed(token_{t+1}))                # the embeddings shared with the main model
    x = e_proj(e).unsqueeze(2) + h_proj(hnorm(h_t))   # h_t: the last main block's output, hc_mult streams
    x = block(x)                                 # one full V4 decoder layer: attention (+ its compressed
                                                 # cache), MoE, hyper-connections
    logits = lm_head(norm(hc_head(x)))           # the shared LM head after the MTP's own hc head and norm

Like EAGLE, the entry at position t pairs the main model's hidden state at t with the embedding of
token t + 1 and predicts token t + 2; drafting further feeds the block's own output at t + 1 back
as the hidden state (with the embedding of the token just drafted), one position at a time.

The block is ``DeepseekV4DecoderLayer`` numbered ``num_hidden_layers`` (so its MoE uses the
learned top-k router: hash routing is for the first ``mlp_layer_types == "hash_moe"`` layers),
with the attention kind its tensors show (``mtp_attention_type``). Its cache is the span's
rewindable V4 cache (:mod:`server.adapters.deepseek_v4_cache`), one layer, so rollbacks trim it
exactly as they trim the main blocks'. The session bookkeeping (trim to the run's ``start_pos``,
redo the entry before it, start over after a gap) is :class:`server.tail_drafter.TailDrafter`'s.
Positions in the MTP cache count from the session's ``base`` (0 unless the drafter had to start
over after a gap), so a fresh start computes as if the text began there.

Weights are read with the span's own scheme (:func:`deepseek_v4_weights.map_mtp`: DeepSeek's
names, FP8/FP4 dequantized by transformers' routine) and, on a quantized server, the block is
quantized as the span's blocks are (``--quant int8|nf4``: bitsandbytes linears, per-expert
linears for the routed experts). ``e_proj``/``h_proj``, the norms and the hc head stay in
``--dtype`` (float32 where transformers keeps those modules in float32).
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
)

from server.adapters import deepseek_v4_cache as v4cache
from server.adapters.deepseek_v4 import (
    DeepseekV4Adapter,
    finish_loading,
    load_owned,
    owned_targets,
    sliding_window_mask,
)
from server.adapters.deepseek_v4_weights import embedding_source, iter_plain, map_mtp, mtp_attention_type, mtp_keys
from server.quantization import Quant
from server.tail_drafter import DEFAULT_TAIL_DRAFTS, MAX_TAIL_DRAFTS, DrafterSession, TailDrafter
from server.weights import Checkpoint

logger = logging.getLogger(__name__)

MTP_INDEX = 0  # the module served; V4 ships one (num_nextn_predict_layers = 1)


def mtp_config(config: PretrainedConfig, attention_type: str) -> PretrainedConfig:
    """The model's config with the MTP block appended as layer ``num_hidden_layers``: its
    attention kind, and the learned-router MoE (``moe``, not ``hash_moe``)."""
    cfg = copy.deepcopy(config)
    cfg._attn_implementation = "eager"  # V4 ships eager only
    if getattr(cfg, "_experts_implementation", None) is None:  # the experts kernel the span's blocks use
        probe = copy.deepcopy(cfg)
        probe.num_hidden_layers, probe.layer_types, probe.mlp_layer_types = 1, cfg.layer_types[:1], ["moe"]
        with torch.device("meta"):
            cfg._experts_implementation = AutoModelForCausalLM.from_config(probe).config._experts_implementation
    cfg.layer_types = list(config.layer_types) + [attention_type]
    cfg.mlp_layer_types = list(config.mlp_layer_types) + ["moe"]
    cfg.num_hidden_layers = config.num_hidden_layers + 1
    return cfg


class DeepseekV4MTP(torch.nn.Module):
    """One MTP module: transformers' decoder layer, RMSNorms and hyper-connection head, plus
    DeepSeek's two projections. Parameter names are what ``map_mtp`` maps the checkpoint to."""

    def __init__(self, config: PretrainedConfig, attention_type: str):
        super().__init__()
        self.config = mtp_config(config, attention_type)
        self.attention_type = attention_type
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.e_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.h_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.enorm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.hnorm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.norm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.hc_head = DeepseekV4HyperHead(self.config)
        self.layer = DeepseekV4DecoderLayer(self.config, layer_idx=config.num_hidden_layers)
        self.layer.self_attn.layer_idx = 0  # the drafter's cache holds this one layer
        self.rotary_emb = DeepseekV4RotaryEmbedding(self.config)

    def new_cache(self, max_rollback: int):
        return v4cache.new_span_cache(self.config, [self.attention_type], max_rollback)

    def forward(
        self,
        hidden: torch.Tensor,  # [1, S, hc_mult, H]: main-model (or MTP) block outputs at positions t
        embeds: torch.Tensor,  # [1, S, H]: embeddings of the tokens at t + 1
        token_ids: torch.Tensor,  # [1, S]: those tokens (the block's MoE takes them; unused by its learned router)
        position_ids: torch.Tensor,  # [1, S], counted in the cache's own positions
        mask: torch.Tensor,
        cache: Optional[v4cache.Cache],
    ) -> torch.Tensor:
        x = self.e_proj(self.enorm(embeds)).unsqueeze(2) + self.h_proj(self.hnorm(hidden))
        position_embeddings = {
            kind: self.rotary_emb(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")
        }
        return self.layer(
            x,
            input_ids=token_ids,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            attention_mask=mask,
            cache=cache,
        )  # [1, S, hc_mult, H]

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """What the shared LM head reads: the MTP's own hc head and norm over its output streams."""
        return self.norm(self.hc_head(x))


def has_mtp(config: PretrainedConfig, checkpoint: Checkpoint) -> bool:
    declared = getattr(config, "num_nextn_predict_layers", 0) or 0
    return declared >= 1 and bool(mtp_keys(checkpoint.weight_map(), MTP_INDEX))


def load_mtp(
    config: PretrainedConfig,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: str | torch.device,
    quant: Quant = Quant.NONE,
) -> DeepseekV4MTP:
    """MTP module 0 of the checkpoint, its block quantized like the span's blocks (``quant``)."""
    weight_map = checkpoint.weight_map()
    attention_type = mtp_attention_type(weight_map, MTP_INDEX)
    with torch.device("meta"):
        mtp = DeepseekV4MTP(config, attention_type)
    owned = {"": mtp}
    targets = owned_targets(owned)
    sources = map_mtp(weight_map, set(targets), MTP_INDEX, config.num_hidden_layers)
    DeepseekV4Adapter.quantize_skeleton(mtp.layer, Quant(quant), dtype)
    device = torch.device(device)
    load_owned(
        checkpoint,
        owned,
        targets,
        sources,
        DeepseekV4Adapter.dtype_plan(dtype),
        device,
        desc=f"Loading MTP module mtp.{MTP_INDEX}",
    )
    finish_loading([mtp], mtp.config, device, f"DeepSeek-V4 MTP module mtp.{MTP_INDEX}")
    return mtp


def mtp_bytes(
    config: PretrainedConfig, checkpoint: Checkpoint | None, dtype: torch.dtype, quant: Quant = Quant.NONE
) -> int:
    """Resident bytes of MTP module 0 as :func:`load_mtp` would load it (0 without one), from a
    meta-device copy: the memory plan keeps room for it on a server whose span ends at the tail.
    Without a ``checkpoint`` (a plan made before any weights are reachable) the config's
    ``num_nextn_predict_layers`` says whether there is one, counted with the largest attention (CSA)."""
    from server.quantization import estimate_module_bytes

    if checkpoint is None:
        if not (getattr(config, "num_nextn_predict_layers", 0) or 0) >= 1:
            return 0
        attention_type = "compressed_sparse_attention"
    elif not has_mtp(config, checkpoint):
        return 0
    else:
        attention_type = mtp_attention_type(checkpoint.weight_map(), MTP_INDEX)
    with torch.device("meta"):
        mtp = DeepseekV4MTP(config, attention_type)
    dtype_of = DeepseekV4Adapter.dtype_plan(dtype)
    block = estimate_module_bytes(mtp.layer, Quant(quant), dtype, dtype_of, DeepseekV4Adapter.stacked_linears)
    rest = sum(
        t.numel() * torch.finfo(dtype_of(name)).bits // 8
        for name, t in mtp.named_parameters()
        if not name.startswith("layer.")
    )  # e_proj, h_proj, norms, hc head: never quantized
    buffers = sum(t.numel() * t.element_size() for name, t in mtp.named_buffers() if not name.startswith("layer."))
    return block + rest + buffers


class MTPDrafter(TailDrafter):
    """The MTP module as a :class:`TailDrafter`: features are the last main block's output
    streams as they are (no final norm), the drafter's output streams are the next step's feature,
    and a token is the argmax of the shared LM head over ``norm(hc_head(x))``."""

    def __init__(
        self,
        mtp: DeepseekV4MTP,
        lm_head: torch.nn.Module,
        embed_weight: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        max_rollback: int,
        max_drafts: int = DEFAULT_TAIL_DRAFTS,
        eos_token_ids: tuple[int, ...] = (),
    ):
        super().__init__(max_drafts, eos_token_ids)
        self.mtp, self.lm_head, self.embed_weight = mtp, lm_head, embed_weight
        self.dtype, self.device = dtype, torch.device(device)
        # a run trims the drafter one position further back than the span (the entry before start_pos
        # is redone), and drafting leaves up to MAX_TAIL_DRAFTS entries to trim on top
        self.max_rollback = max_rollback + MAX_TAIL_DRAFTS + 1

    def new_session(self) -> DrafterSession:
        return DrafterSession(self.mtp.new_cache(self.max_rollback))

    def _trim(self, state: DrafterSession, position: int) -> None:
        keep = position - state.base
        if keep > 0 and len(state.tokens) > keep:
            try:
                v4cache.trim_cache(state.cache, keep)
            except v4cache.RollbackTooDeep:
                keep = 0
            else:
                del state.tokens[keep:]
                return
        if keep <= 0:
            state.cache, state.base, state.tokens = self.mtp.new_cache(self.max_rollback), position, []

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.device, self.dtype)

    def _predicted(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def _step(self, state: DrafterSession, features: torch.Tensor, tokens: list[int], first: int) -> torch.Tensor:
        offset = first - state.base  # positions in the drafter's cache count from the session's base
        num = features.shape[1]
        ids = torch.tensor([tokens])
        embeds = self.embed_weight[ids.to(self.embed_weight.device)].to(self.device, self.dtype)
        positions = torch.arange(offset, offset + num, device=self.device).unsqueeze(0)
        mask = sliding_window_mask(offset, num, self.mtp.config.sliding_window, self.dtype, self.device)
        out = self.mtp(features, embeds, ids.to(self.device), positions, mask, state.cache)
        state.tokens.extend(tokens)
        return out

    def _next_token(self, feature: torch.Tensor) -> int:
        return int(torch.argmax(self.lm_head(self.mtp.final_hidden(feature[:, -1:]))[0, -1]))


def build_mtp_drafter(
    span: DeepseekV4Adapter,
    config: PretrainedConfig,
    checkpoint: Checkpoint,
    choice: str = "auto",
    max_drafts: int = DEFAULT_TAIL_DRAFTS,
) -> Optional[MTPDrafter]:
    """``--drafter`` on a DeepSeek-V4 server: ``auto`` drafts with the checkpoint's MTP module
    when it has one (tensors ``mtp.0.*`` and ``num_nextn_predict_layers >= 1``) and with nothing
    otherwise; ``none`` never drafts; a drafter file is refused (V4 has its own drafter)."""
    if choice == "none" or not span.is_tail:
        return None
    if choice != "auto":
        raise ValueError(
            f"--drafter {choice}: a DeepSeek-V4 tail drafts with its checkpoint's own MTP module "
            "(--drafter auto) or not at all (--drafter none); it takes no drafter file"
        )
    if not has_mtp(config, checkpoint):
        logger.info("Tail drafter: none (the checkpoint has no MTP module, mtp.0.*)")
        return None
    try:
        mtp = load_mtp(span.config, checkpoint, span.dtype, span.device, span.quant)
        if span.embed_tokens is not None:  # this server is also the head: one copy of the embeddings
            embed_weight = span.embed_tokens.weight
        else:  # kept in host memory: a draft step looks up one row
            source = embedding_source(checkpoint.weight_map())
            ((_, embed_weight),) = list(iter_plain(checkpoint, [source], lambda name: span.dtype))
    except (KeyError, ValueError, RuntimeError) as e:  # names not as assumed, or no memory for it
        logger.warning(f"Tail drafter: none (the checkpoint's MTP module mtp.0 could not be loaded: {e})")
        return None
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    logger.info(
        f"Tail drafter: the checkpoint's MTP module mtp.0 ({mtp.attention_type} block, "
        f"{span.quant.value} weights; up to {max_drafts} ids per run)"
    )
    return MTPDrafter(mtp, span.lm_head, embed_weight, span.dtype, span.device, span.max_rollback, max_drafts, eos_ids)
