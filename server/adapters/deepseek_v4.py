"""DeepSeek-V4 adapter (transformers ``deepseek_v4``: DeepSeek-V4-Flash, DeepSeek-V4-Pro).

What differs from the Llama family, and how each crosses the pipeline:

* Hyper-connections: the residual stream is ``hc_mult`` streams wide, so the activations between
  stages are ``[1, S, hc_mult, hidden]``. The head embeds the ids and copies them into every
  stream (as ``DeepseekV4Model`` does); the tail collapses the streams with ``hc_head``, then
  applies the final norm and the LM head.
* Hash-routed MoE: the first ``mlp_layer_types == "hash_moe"`` layers pick experts by token id
  (``tid2eid[input_ids]``), so every block receives the run's token ids; the protocol sends them
  with the activations on every hop.
* Attention: a sliding window plus, on CSA/HCA layers, compressed entries (one per
  ``compress_rate`` positions) and buffers of the current partial window. transformers' caches
  for these cannot be cropped; the span uses the rewindable layers of
  :mod:`server.adapters.deepseek_v4_cache`, which run the same transformers code and keep
  ``max_rollback`` positions of extra history, so ``trim_cache`` is exact (see there).
* Masks: a span's cache holds only its own layers, so the additive sliding-window mask is built
  here, in the layout transformers uses (the last ``sliding_window - 1`` cached keys, then the new
  ones). It is always a tensor, even for one position, because the CSA layers append their
  indexer's top-k block bias to it (transformers' eager path does the same).
* Weights: real transformers modules built on the meta device and filled with only this span's
  tensors, renamed and dequantized as transformers does (:mod:`server.adapters.deepseek_v4_weights`).
  Parameters transformers keeps in float32 whatever the dtype (``_keep_in_fp32_modules_strict``:
  hyper-connections, norms, sinks, position biases) stay float32 here too.
"""

from __future__ import annotations

import copy
import re
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Experts,
    DeepseekV4PreTrainedModel,
    DeepseekV4RotaryEmbedding,
)

from server.adapters import deepseek_v4_batch, packing
from server.adapters import deepseek_v4_cache as v4cache
from server.adapters.base import BatchMember, Cache, SpanAdapter
from server.adapters.deepseek_v4_quant import QuantizedExperts, quantize_experts_skeleton
from server.adapters.deepseek_v4_weights import iter_experts, iter_plain, map_span
from server.quantization import Quant, assign_tensor
from server.weights import Checkpoint

DEFAULT_MAX_ROLLBACK = 256  # positions a trim may go back: drafts of every run in flight


class DeepseekV4Adapter(SpanAdapter):
    # Token trees stay off (docs/protocol.md, "Token trees"; docs/deepseek_v4.md): the compressed and
    # buffered entries of CSA/HCA layers fold consecutive positions together, and the rewindable caches
    # roll back exactly only along a chain. Servers refuse a tree run for this family (bad_request).
    supports_trees = False

    def __init__(
        self,
        config: PretrainedConfig,
        checkpoint: Checkpoint,
        start: int,
        end: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_rollback: int = DEFAULT_MAX_ROLLBACK,
        quant: Quant = Quant.NONE,
    ):
        self.num_blocks = config.num_hidden_layers
        if not 0 <= start < end <= self.num_blocks:
            raise ValueError(f"blocks {start}:{end} are outside the model's 0:{self.num_blocks}")
        self.start, self.end = start, end
        self.dtype, self.device, self.quant = dtype, torch.device(device), Quant(quant)
        self.max_rollback = max_rollback
        self.hidden_shape = (config.hc_mult, config.hidden_size)
        self.vocab_size = config.vocab_size

        config = copy.deepcopy(config)
        config._attn_implementation = "eager"  # V4 ships eager only (attention sinks, compressed keys)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.config = skeleton.config
        self.layers = torch.nn.ModuleList(skeleton.model.layers[start:end])
        for local_idx, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = local_idx  # the session cache holds this span only
        self.embed_tokens = skeleton.model.embed_tokens if self.is_head else None
        self.hc_head = skeleton.model.hc_head if self.is_tail else None
        self.norm = skeleton.model.norm if self.is_tail else None
        self.lm_head = skeleton.lm_head if self.is_tail else None
        self._load(checkpoint)

    # ---- loading ----------------------------------------------------------------------------

    def _owned(self) -> dict[str, torch.nn.Module]:
        """transformers name prefix -> the module of this span that holds those parameters."""
        owned: dict[str, torch.nn.Module] = {
            f"model.layers.{self.start + i}.": layer for i, layer in enumerate(self.layers)
        }
        if self.is_head:
            owned["model.embed_tokens."] = self.embed_tokens
        if self.is_tail:
            owned.update({"model.hc_head.": self.hc_head, "model.norm.": self.norm, "lm_head.": self.lm_head})
        return owned

    def _load(self, checkpoint: Checkpoint) -> None:
        """Read the span's tensors one at a time into the meta modules. A quantized span swaps
        its linears and experts for bitsandbytes modules first; each weight is then quantized
        as it arrives, so no block is ever held in float."""
        owned = self._owned()
        targets = owned_targets(owned)
        sources = map_span(
            checkpoint.weight_map(), set(targets), range(self.start, self.end), self.is_head, self.is_tail
        )
        self.quantize_skeleton(self.layers, self.quant, self.dtype)
        load_owned(
            checkpoint,
            owned,
            targets,
            sources,
            self.dtype_plan(self.dtype),
            self.device,
            desc=f"Loading blocks {self.start}:{self.end}",
        )
        self.rotary_emb = DeepseekV4RotaryEmbedding(self.config)
        finish_loading(self._modules(), self.config, self.device, "DeepSeek-V4 span")

    def _modules(self) -> list[torch.nn.Module]:
        candidates = (self.layers, self.embed_tokens, self.hc_head, self.norm, self.lm_head, self.rotary_emb)
        return [m for m in candidates if m is not None]

    stacked_linears = (DeepseekV4Experts,)

    @staticmethod
    def quantize_skeleton(layers: torch.nn.Module, quant: Quant, dtype: torch.dtype) -> None:
        quantize_experts_skeleton(layers, quant, dtype)

    @staticmethod
    def dtype_plan(dtype: torch.dtype) -> Callable[[str], torch.dtype]:
        return _dtype_plan(dtype)

    # ---- cache ------------------------------------------------------------------------------

    def new_cache(self) -> Cache:
        return v4cache.new_span_cache(self.config, self.config.layer_types[self.start : self.end], self.max_rollback)

    def cache_length(self, cache: Cache) -> int:
        return v4cache.cache_length(cache)

    def trim_cache(self, cache: Cache, length: int) -> None:
        v4cache.trim_cache(cache, length)

    def cache_bytes_per_token(self) -> int:
        return self.span_cache_bytes_per_token(self.config, self.start, self.end, self.dtype)

    @staticmethod
    def span_cache_bytes_per_token(config: PretrainedConfig, start: int, end: int, dtype: torch.dtype) -> int:
        """Compressed entries grow with the context: head_dim (+ index_head_dim on CSA) per
        ``compress_rate`` positions. The sliding window and rollback history are a fixed
        per-session cost, not counted per token."""
        elements = 0.0
        for layer_type in config.layer_types[start:end]:
            if layer_type == "compressed_sparse_attention":
                elements += (config.head_dim + config.index_head_dim) / config.compress_rates[layer_type]
            elif layer_type == "heavily_compressed_attention":
                elements += config.head_dim / config.compress_rates[layer_type]
        return max(1, int(elements * torch.finfo(dtype).bits // 8))

    # ---- compute ----------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(token_ids.to(self.device))  # [1, S, hidden]
        return embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        start_pos: int,
        cache: Cache,
        blocks: range,
        check_cancelled: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        hidden = hidden.to(self.device, self.dtype)  # [1, S, hc_mult, hidden]
        token_ids = token_ids.to(self.device)
        num_new = hidden.shape[1]
        position_ids = torch.arange(start_pos, start_pos + num_new, device=self.device).unsqueeze(0)
        mask = sliding_window_mask(start_pos, num_new, self.config.sliding_window, self.dtype, self.device)
        position_embeddings = {
            kind: self.rotary_emb(hidden, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")
        }
        for block in blocks:
            check_cancelled()
            hidden = self.layers[block - self.start](
                hidden,
                input_ids=token_ids,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                attention_mask=mask,
                cache=cache,
            )
        return hidden

    @torch.inference_mode()
    def forward_batch(
        self, members: list[BatchMember], blocks: range, between_blocks: Callable[[], None] = lambda: None
    ) -> list[Optional[torch.Tensor]]:
        """Every member's positions packed into one pass (server/adapters/deepseek_v4_batch.py says
        what runs once for the batch and what per member); a batch of one takes :meth:`forward`."""
        if len(members) < 2:
            return super().forward_batch(members, blocks, between_blocks)
        window = self.config.sliding_window

        def positions_and_mask(member: BatchMember) -> tuple[torch.Tensor, torch.Tensor]:
            num_new = member.hidden.shape[1]
            position_ids = torch.arange(member.start_pos, member.start_pos + num_new, device=self.device).unsqueeze(0)
            return position_ids, sliding_window_mask(member.start_pos, num_new, window, self.dtype, self.device)

        def prepare(packed: packing.Packed, hidden: torch.Tensor) -> tuple[torch.Tensor, dict]:
            rotary = {
                kind: self.rotary_emb(hidden, position_ids=packed.position_ids, layer_type=kind)
                for kind in ("main", "compress")
            }
            return packed.token_ids(self.device), rotary

        def block(number: int, hidden: torch.Tensor, packed: packing.Packed, prepared: tuple) -> torch.Tensor:
            token_ids, rotary = prepared
            return deepseek_v4_batch.decoder_layer(self.layers[number - self.start], hidden, token_ids, packed, rotary)

        packed, hidden = packing.pack(members, self.dtype, self.device, positions_and_mask)
        return packing.run_blocks(packed, hidden, blocks, between_blocks, prepare, block)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.device, self.dtype)
        return self.lm_head(self.norm(self.hc_head(hidden)))[0].float()

    @torch.inference_mode()
    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.hc_head(hidden.to(self.device, self.dtype)))[0].float()


def owned_targets(owned: dict[str, torch.nn.Module]) -> dict[str, tuple[str, str]]:
    """transformers name -> (prefix, name inside its module) of every tensor the modules hold."""
    return {prefix + name: (prefix, name) for prefix, module in owned.items() for name in module.state_dict()}


def load_owned(
    checkpoint: Checkpoint,
    owned: dict[str, torch.nn.Module],
    targets: dict[str, tuple[str, str]],
    sources: dict,
    dtype_of: Callable[[str], torch.dtype],
    device: torch.device,
    desc: str,
) -> None:
    """Read each module's tensors one at a time into its meta parameters (quantized as they
    arrive where the skeleton was quantized), routed experts a few at a time."""
    for prefix, module in tqdm(owned.items(), desc=desc, unit="module"):
        mine = [sources[t] for t, (p, _) in targets.items() if p == prefix]
        for target, tensor in iter_plain(checkpoint, [s for s in mine if s.kind == "plain"], dtype_of):
            assign_tensor(module, targets[target][1], tensor, device)
        for source in (s for s in mine if s.kind != "plain"):
            name = targets[source.target][1]  # e.g. "mlp.experts.gate_up_proj"
            experts_name, _, param = name.rpartition(".")
            experts = module.get_submodule(experts_name)
            pieces = iter_experts(checkpoint, source, dtype_of(source.target))
            if isinstance(experts, QuantizedExperts):
                linears = experts.gate_up if param == "gate_up_proj" else experts.down
                for expert, tensor in pieces:
                    assign_tensor(linears[expert], "weight", tensor, device)
            else:
                assign_tensor(module, name, torch.stack([tensor for _, tensor in pieces]), device)


def finish_loading(modules: list[torch.nn.Module], config: PretrainedConfig, device: torch.device, what: str) -> None:
    """Rotary tables rebuilt, modules on the device in eval mode; nothing may be left on meta."""
    for module in modules:
        _rebuild_rotary(module, config)
        module.to(device).eval().requires_grad_(False)
    meta = [n for m in modules for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"{what} left tensors unloaded: {meta[:3]}")


def sliding_window_mask(
    start_pos: int, num_new: int, window: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[1, 1, S, visible + S] additive mask over the keys a rewindable layer returns: the last
    ``min(window - 1, start_pos)`` cached positions, then the new ones. Query q sees key k when
    q - window < k <= q (transformers' sliding-window rule)."""
    visible = min(window - 1, start_pos)
    query = torch.arange(start_pos, start_pos + num_new, device=device).unsqueeze(1)
    key = torch.arange(start_pos - visible, start_pos + num_new, device=device).unsqueeze(0)
    allowed = (key <= query) & (key > query - window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _dtype_plan(dtype: torch.dtype) -> Callable[[str], torch.dtype]:
    """transformers' rule: names matching ``_keep_in_fp32_modules_strict`` stay float32 in bf16/fp16
    (and ``_keep_in_fp32_modules`` in fp16); the rest take ``dtype``."""
    patterns: list[str] = []
    if dtype in (torch.float16, torch.bfloat16):
        patterns += DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict or []
    if dtype == torch.float16:
        patterns += DeepseekV4PreTrainedModel._keep_in_fp32_modules or []
    if not patterns:
        return lambda name: dtype
    keep = re.compile("|".join(p.replace("*", ".*") for p in patterns))
    return lambda name: torch.float32 if keep.search(name) else dtype


def _rebuild_rotary(root: torch.nn.Module, config: PretrainedConfig) -> None:
    """Rotary tables are non-persistent buffers, left on the meta device by the skeleton."""
    for module in list(root.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, DeepseekV4RotaryEmbedding):
                setattr(module, child_name, DeepseekV4RotaryEmbedding(config))
