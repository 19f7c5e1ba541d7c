"""The generic adapter: Llama 2/3, SmolLM2, Mistral, Qwen2/3 and the mixtures of experts
Mixtral, Qwen2/3-MoE, DeepSeek-V3 and GLM-4-MoE: every family whose transformers implementation
is ``model.model.{embed_tokens, layers, norm, rotary_emb}`` plus ``lm_head``, with decoder layers
called as ``layer(hidden, attention_mask, position_ids, cache, position_embeddings)`` that keep
their state in transformers' standard ``DynamicCache`` (docs/families.md).

Checkpoint names are mapped to the modules' by transformers' conversion table, per-expert tensors
fused as transformers fuses them, FP8 and gpt-oss's MXFP4 experts dequantized with transformers'
own functions (server/adapters/expert_weights.py). DeepSeek-V3's latent
attention caches its compressed latent and rotary key in the same cache (one head each), so
rollback and trees work as for the others. A batched pass packs its members' positions into one row
(server/adapters/llama_batch.py): norms and experts run once over all of them; attention without
q/k/v projections to pack (DeepSeek-V3's latent attention, gpt-oss's eager sinks) runs its module
one member at a time (``packs_attention`` False). Routed experts are fused
in ``--dtype``, or split into one int8/NF4 linear per expert and projection under ``--quant``
(server/adapters/fused_experts.py; gpt-oss's biased experts: gpt_oss_experts.py).

Sliding-window layers (Mistral's ``sliding_window``, Qwen2's ``layer_types``): the span's cache
keeps every position of every layer (plain ``DynamicLayer``s, which trim and gather exactly, so
rollback, token trees and batching work as for full attention), and each sliding layer gets a
mask that hides keys at or before ``position - sliding_window`` (transformers' sliding rule). The
cache budget already counts every position (``span_cache_bytes_per_token``).

The layers are the real transformers modules, built on the meta device and filled with only this
span's tensors; nothing here reimplements attention.
"""

from __future__ import annotations

import copy
import itertools
import re
from typing import Callable, Optional

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from protocol import trees
from server.adapters import expert_weights, fused_experts, gpt_oss_experts, llama_batch, packing
from server.adapters.base import BatchMember, Cache, SpanAdapter, add_deep_prompts
from server.quantization import Quant, assign_tensor, checkpoint_names
from server.weights import Checkpoint


class LlamaFamilyAdapter(SpanAdapter):
    def __init__(
        self,
        config: PretrainedConfig,
        checkpoint: Checkpoint,
        start: int,
        end: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        quant: Quant = Quant.NONE,
    ):
        self.config = copy.deepcopy(config)
        # gpt_oss's attention sinks live only in its eager attention, which adds the mask to the scores
        self.additive_masks = config.model_type == "gpt_oss"
        self.config._attn_implementation = "eager" if self.additive_masks else "sdpa"
        self.num_blocks = config.num_hidden_layers
        if not 0 <= start < end <= self.num_blocks:
            raise ValueError(f"blocks {start}:{end} are outside the model's 0:{self.num_blocks}")
        self.start, self.end = start, end
        self.dtype, self.device, self.quant = dtype, torch.device(device), Quant(quant)
        self.hidden_shape = (config.hidden_size,)
        self.vocab_size = config.vocab_size

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, dtype=dtype)
        self.layers = torch.nn.ModuleList(skeleton.model.layers[start:end])
        for local_idx, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = local_idx  # the session cache holds this span only
        self.rotary_emb = type(skeleton.model.rotary_emb)(config=self.config)
        self.embed_tokens = skeleton.model.embed_tokens if self.is_head else None
        self.norm = skeleton.model.norm if self.is_tail else None
        self.lm_head = skeleton.lm_head if self.is_tail else None
        wanted = self._wanted(checkpoint)  # names of the float modules, before quantization splits experts
        self.keeps_float32 = keeps_float32(type(skeleton), dtype)
        self.quantize_skeleton(self.layers, self.quant, dtype)
        self._load(checkpoint, wanted)
        # each layer's sliding window (None: full attention), for its masks
        self.windows = _layer_windows(self.config)[start:end]
        # trees need caches whose entries sit at their positions (new_cache keeps them all)
        # batched passes (llama_batch.py) run norms and experts over all members at once; attention's q/k/v
        # projections too where it has them, else (DeepSeek-V3's latent attention, gpt-oss's eager sinks)
        # transformers' attention module runs member by member
        self.packs_attention = not self.additive_masks and all(
            all(hasattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj")) for layer in self.layers
        )
        self.supports_trees = all(type(layer) is DynamicLayer for layer in self.new_cache().layers)

    def _wanted(self, checkpoint: Checkpoint) -> dict[str, list[tuple[torch.nn.Module, str]]]:
        """transformers' name of every tensor this span holds -> the (module, name) pairs it fills."""
        wanted: dict[str, list[tuple[torch.nn.Module, str]]] = {}
        for local_idx, layer in enumerate(self.layers):
            prefix = f"model.layers.{self.start + local_idx}."
            for name in checkpoint_names(layer):
                wanted.setdefault(prefix + name, []).append((layer, name))
        if self.is_head:
            wanted.setdefault("model.embed_tokens.weight", []).append((self.embed_tokens, "weight"))
        if self.is_tail:
            wanted["model.norm.weight"] = [(self.norm, "weight")]
            tied = "lm_head.weight" not in checkpoint.weight_map()
            wanted.setdefault("model.embed_tokens.weight" if tied else "lm_head.weight", []).append(
                (self.lm_head, "weight")
            )
        return wanted

    def _load(self, checkpoint: Checkpoint, wanted: dict[str, list[tuple[torch.nn.Module, str]]]) -> None:
        """Fill the meta modules with this span's tensors only, one tensor (or one fused expert
        parameter; one expert where the span is quantized) at a time, each quantized as it arrives.
        Checkpoint names are mapped to the modules' by transformers' conversion table
        (server/adapters/expert_weights.py): per-expert tensors become fused expert parameters."""
        sources = expert_weights.map_keys(self.config.model_type, checkpoint.weight_map(), wanted)
        split_kinds = (fused_experts.QuantizedExperts, gpt_oss_experts.QuantizedGptOssExperts)
        split = {  # fused expert parameters whose module a quantized skeleton split into linears
            target
            for target, holders in wanted.items()
            if isinstance(holders[0][0].get_submodule(holders[0][1].rpartition(".")[0]), split_kinds)
        }
        desc = f"Loading blocks {self.start}:{self.end}"
        # what transformers keeps in float32 whatever the dtype (DeepSeek-V3's and GLM-4-MoE's router weight and
        # score correction bias) is read in float32, so routing sees the values transformers' does
        kept = [source for target, source in sources.items() if self.keeps_float32(target)]
        rest = [source for target, source in sources.items() if not self.keeps_float32(target)]
        tensors = itertools.chain(
            expert_weights.iter_tensors(checkpoint, rest, self.dtype, desc=desc, per_expert=split),
            expert_weights.iter_tensors(checkpoint, kept, torch.float32, desc=desc, per_expert=split) if kept else (),
        )
        for target, expert, tensor in tensors:
            for module, name in wanted[target]:
                owner_name, _, param = name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                if isinstance(owner, gpt_oss_experts.QuantizedGptOssExperts):  # split into per-expert linears
                    owner.assign(param, tensor, self.device, expert)
                elif expert is None:
                    assign_tensor(module, name, tensor, self.device)
                else:  # one expert's slice of a fused parameter whose module was split into linears
                    linears = owner.gate_up if param == "gate_up_proj" else owner.down
                    assign_tensor(linears[expert], "weight", tensor, self.device)
        for module in self._modules():
            module.to(self.device).eval().requires_grad_(False)
        meta = [n for m in self._modules() for n, t in m.named_parameters() if t.is_meta]
        if meta:
            raise RuntimeError(f"span {self.start}:{self.end} left parameters unloaded: {meta[:3]}")

    def _modules(self) -> list[torch.nn.Module]:
        return [m for m in (self.layers, self.embed_tokens, self.norm, self.lm_head, self.rotary_emb) if m is not None]

    def new_cache(self) -> Cache:
        span_config = copy.deepcopy(self.config)
        span_config.num_hidden_layers = self.end - self.start
        # every layer keeps every position: sliding layers mask what lies outside their window
        span_config.layer_types = ["full_attention"] * (self.end - self.start)
        span_config.sliding_window = None
        return DynamicCache(config=span_config)

    def cache_length(self, cache: Cache) -> int:
        return max((layer.get_seq_length() for layer in cache.layers if layer.is_initialized), default=0)

    def trim_cache(self, cache: Cache, length: int) -> None:
        for layer in cache.layers:
            excess = layer.get_seq_length() - length if layer.is_initialized else 0
            if excess > 0:
                layer.crop(-excess)  # transformers: a negative count removes that many positions

    @torch.inference_mode()
    def gather_cache(self, cache: Cache, base: int, nodes: list[int]) -> None:
        index = torch.tensor([base + node for node in nodes], dtype=torch.long)
        for layer in cache.layers:
            if layer.is_initialized and nodes:
                index_here = index.to(layer.keys.device)
                layer.keys[:, :, base : base + len(nodes)] = layer.keys.index_select(2, index_here)
                layer.values[:, :, base : base + len(nodes)] = layer.values.index_select(2, index_here)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids.to(self.device))

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        start_pos: int,
        cache: Cache,
        blocks: range,
        check_cancelled: Callable[[], None] = lambda: None,
        tree: list[int] | None = None,
    ) -> torch.Tensor:
        hidden = hidden.to(self.device, self.dtype)
        position_ids, masks = self._positions_and_masks(start_pos, hidden.shape[1], tree)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        taps = self.taps if self.taps is not None and blocks.stop == self.end else None
        wanted = taps.wanted(blocks) if taps is not None else frozenset()
        kept = {blocks.start: hidden} if blocks.start in wanted else {}
        for block in blocks:
            check_cancelled()
            hidden = self.layers[block - self.start](
                hidden,
                attention_mask=masks[self.windows[block - self.start]],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
            if block + 1 in wanted:
                kept[block + 1] = hidden
        if taps is not None:  # the features an EAGLE-3 tail drafter reads (server/feature_taps.py)
            taps.record(cache, start_pos, kept, blocks)
        return hidden

    def _positions_and_masks(
        self, start_pos: int, num_new: int, tree: Optional[list[int]]
    ) -> tuple[torch.Tensor, dict[Optional[int], Optional[torch.Tensor]]]:
        """Position ids [1, S] of a run's new positions, and its mask for each window this span's
        layers use (None: full attention)."""
        if tree:
            position_ids, tree_mask = _tree_positions_and_mask(start_pos, num_new, tree, self.device)
        else:
            position_ids, tree_mask = (
                torch.arange(start_pos, start_pos + num_new, device=self.device).unsqueeze(0),
                None,
            )
        masks = {window: _mask(start_pos, position_ids, window, tree_mask) for window in set(self.windows)}
        if self.additive_masks:
            masks = {w: None if m is None else _additive(m, self.dtype) for w, m in masks.items()}
        return position_ids, masks

    @torch.inference_mode()
    def forward_batch(
        self, members: list[BatchMember], blocks: range, between_blocks: Callable[[], None] = lambda: None
    ) -> list[Optional[torch.Tensor]]:
        """Every member's positions packed into one pass (server/adapters/llama_batch.py): the
        experts see all members' tokens at once, each routed by its own router logits; attention
        is packed or per member (``packs_attention``). A batch of one takes :meth:`forward`."""
        if len(members) < 2:
            return super().forward_batch(members, blocks, between_blocks)
        packed, hidden = packing.pack(
            members,
            self.dtype,
            self.device,
            lambda m: self._positions_and_masks(m.start_pos, m.hidden.shape[1], m.tree),
        )

        taps = self.taps if self.taps is not None and blocks.stop == self.end else None
        wanted = taps.wanted(blocks) if taps is not None else frozenset()
        kept = {blocks.start: (packed, hidden)} if blocks.start in wanted else {}  # boundary -> packed rows

        def block(
            number: int, hidden: torch.Tensor, packed: packing.Packed, cos_sin: tuple[torch.Tensor, torch.Tensor]
        ) -> torch.Tensor:
            local = number - self.start
            hidden = llama_batch.decoder_layer(
                self.layers[local], hidden, packed, cos_sin, self.windows[local], self.packs_attention
            )
            if number + 1 in wanted:
                kept[number + 1] = (packed, hidden)
            return hidden

        rotary = lambda packed, hidden: self.rotary_emb(hidden, position_ids=packed.position_ids)  # noqa: E731
        outputs = packing.run_blocks(packed, hidden, blocks, between_blocks, rotary, block)
        if taps is not None:  # each member's features for an EAGLE-3 tail drafter (server/feature_taps.py)
            for member, output in zip(members, outputs):
                if output is not None:
                    rows = {j: packing.member_rows(p, h, member) for j, (p, h) in kept.items()}
                    taps.record(member.cache, member.start_pos, rows, blocks)
        return outputs

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden.to(self.device, self.dtype)))[0].float()

    @torch.inference_mode()
    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden.to(self.device, self.dtype))[0].float()

    stacked_linears = (fused_experts.FusedExperts, gpt_oss_experts.GptOssStackedExperts)

    @staticmethod
    def quantize_skeleton(layers: torch.nn.Module, quant: Quant, dtype: torch.dtype) -> None:
        fused_experts.quantize_skeleton(layers, quant, dtype)

    def backward_refusal(self) -> str:
        if self.quant != Quant.NONE:
            return f"a {self.quant.value} span does not support backward (training); serve it unquantized"
        return ""

    def train_span(
        self, hidden: torch.Tensor, blocks: range, deep: Optional[torch.Tensor] = None, cache=None
    ) -> torch.Tensor:
        """Blocks over a whole row at once, no cache: the training lap's forward and its recompute.
        ``deep`` ``[len(blocks), P, hidden]``: added to the first P positions at each block's input.
        ``cache`` (server/train_chunks.py TrainCache): a chunk of a long row, after ``cache.offset`` positions
        whose keys and values it holds."""
        hidden = hidden.to(self.device, self.dtype)
        offset = cache.offset if cache is not None else 0
        position_ids, masks = self._positions_and_masks(offset, hidden.shape[1], None)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for i, block in enumerate(blocks):
            if deep is not None:
                hidden = add_deep_prompts(hidden, deep[i])
            hidden = self.layers[block - self.start](
                hidden,
                attention_mask=masks[self.windows[block - self.start]],
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
            )
        return hidden

    def train_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden.to(self.device, self.dtype)))[0].float()

    def train_final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden.to(self.device, self.dtype))

    def cache_bytes_per_token(self) -> int:
        return self.span_cache_bytes_per_token(self.config, self.start, self.end, self.dtype)

    @staticmethod
    def span_cache_bytes_per_token(config: PretrainedConfig, start: int, end: int, dtype: torch.dtype) -> int:
        if getattr(config, "kv_lora_rank", None):  # latent attention (DeepSeek-V3) caches the compressed latent
            return (config.kv_lora_rank + config.qk_rope_head_dim) * (end - start) * torch.finfo(dtype).bits // 8
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * kv_heads * head_dim * (end - start) * torch.finfo(dtype).bits // 8


def keeps_float32(model_class: type, dtype: torch.dtype) -> Callable[[str], bool]:
    """transformers' rule for ``model_class``: parameter names matching its ``_keep_in_fp32_modules_strict``
    stay float32 in bfloat16/float16 (and ``_keep_in_fp32_modules`` in float16); the rest take ``dtype``."""
    patterns: list[str] = []
    if dtype in (torch.float16, torch.bfloat16):
        patterns += getattr(model_class, "_keep_in_fp32_modules_strict", None) or []
    if dtype == torch.float16:
        patterns += getattr(model_class, "_keep_in_fp32_modules", None) or []
    if not patterns:
        return lambda name: False
    keep = re.compile("|".join(p.replace("*", ".*") for p in patterns))
    return lambda name: keep.search(name) is not None


def _layer_windows(config: PretrainedConfig) -> list[Optional[int]]:
    """Each layer's sliding window (None: full attention), as transformers' own models read the
    config: ``layer_types`` where the config has them (Qwen2: the layers above
    ``max_window_layers``), else every layer sliding when ``sliding_window`` is set (Mistral)."""
    window = getattr(config, "sliding_window", None)
    types = (
        getattr(config, "layer_types", None)
        or ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
    )
    return [window if kind == "sliding_attention" and window else None for kind in types]


def _mask(
    start_pos: int, position_ids: torch.Tensor, window: Optional[int], tree_mask: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """[1, 1, S, start_pos + S] boolean mask (True = attend) of new positions over a cache that holds
    every earlier position: causal (or a tree's ``tree_mask``), and with a sliding ``window`` only
    keys at positions > query - window. None where every query sees every key (one position with
    nothing outside its window), which sdpa computes fastest.

    Built here rather than by transformers' mask helpers because a span's cache holds only its
    own layers, whose lengths those helpers would read from the wrong layer index.
    """
    device, num_new = position_ids.device, position_ids.shape[1]
    query = position_ids[0].unsqueeze(1)  # [S, 1]
    key = torch.cat([torch.arange(start_pos, device=device), position_ids[0]]).unsqueeze(0)  # [1, start_pos + S]
    allowed = tree_mask[0, 0] if tree_mask is not None else key <= query
    if window is not None:
        allowed = allowed & (key > query - window)
    if num_new == 1 and bool(allowed.all()):
        return None
    return allowed[None, None]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention adds it to the scores: 0 where allowed, the dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def _causal_mask(start_pos: int, num_new: int, device: torch.device) -> torch.Tensor | None:
    """[1, 1, S, start_pos + S] causal boolean mask of a chain (None for one position); the tail
    drafter and its trainer use it too."""
    return _mask(start_pos, torch.arange(start_pos, start_pos + num_new, device=device).unsqueeze(0), None, None)


def _tree_positions_and_mask(
    start_pos: int, num_new: int, parents: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [1, S] (a draft at start_pos + committed - 1 + its depth) and the [1, 1, S,
    start_pos + S] boolean mask of a run whose last ``len(parents)`` ids are a tree of drafts: every
    position sees the cache; committed ids see each other causally; a draft sees the committed ids,
    its ancestors and itself (protocol/trees.py)."""
    committed = num_new - len(parents)
    position_ids = torch.tensor(trees.offsets(committed, parents), device=device).add_(start_pos).unsqueeze(0)
    own = trees.visibility(committed, parents).to(device)
    mask = torch.cat([torch.ones(num_new, start_pos, dtype=torch.bool, device=device), own], dim=1)
    return position_ids, mask[None, None]
