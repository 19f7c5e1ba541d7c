"""Which checkpoint tensors make each parameter of a DeepSeek-V4 span, and how to load them.

The hub checkpoints ship DeepSeek's own tensor names, not transformers' module names:
``layers.7.attn.wq_a.weight`` (+ ``layers.7.attn.wq_a.scale``), ``layers.7.ffn.experts.12.w1.weight``,
``embed.weight``, ``head.weight``, ``hc_head_fn`` ... and ``mtp.{i}.*`` (the multi-token-prediction
modules, mapped by :func:`map_mtp` below). transformers maps them
with its ``deepseek_v4`` conversion table (``transformers.conversion_mapping``); we apply the same
renamings to every key of the span's layers, so the names always agree with the installed
transformers. A checkpoint written by ``save_pretrained`` uses the same names with a ``model.``
prefix; both are accepted. Two of transformers' conversions are structural and done here:

* routed experts: per-expert ``experts.{e}.w1/w3/w2`` become the fused
  ``experts.gate_up_proj`` ([E, 2I, H]: all w1 then all w3 along dim 1) and ``experts.down_proj``
  ([E, H, I]), found by transformers' merges as for every family (server/adapters/expert_weights.py);
  read here expert by expert with their FP4/FP8 scales;
* quantized weights: a weight with a companion ``.scale`` (DeepSeek's name) or
  ``.weight_scale_inv`` is dequantized with transformers' own ``Fp8Dequantize`` routine, which
  reads the block size from the scale grid: FP8 e4m3 linears with [128, 128] blocks, FP4 e2m1
  experts packed two per int8 with [1, 32] blocks, float or ue8m0 scales. This is what
  transformers does when the device has no FP8 kernel (``dequantize=True``); FP8 kernels on
  Hopper-class GPUs are not used yet, so a server holds its span in ``--dtype``, or requantized
  to int8/NF4 with bitsandbytes (``--quant``).

Only the keys of the span are read (``Checkpoint.read``), one plain tensor or a few experts at a
time, so the peak extra memory while loading is one group of experts in float32; a quantized span
(``--quant int8|nf4``) quantizes each expert as it is read and never holds a fused float tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

import torch

from server.adapters.expert_weights import Merge, conversions
from server.weights import Checkpoint

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightRenaming

_LAYER_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
EXPERTS_PER_READ = 16


@dataclass
class TensorSource:
    """How one span parameter is built: ``parts`` are (weight key, scale key or None)."""

    target: str
    kind: str = "plain"  # "plain", "gate_up" (cat(stack(w1), stack(w3)), dim 1) or "down" (stack(w2))
    parts: list[tuple[str, Optional[str]]] = field(default_factory=list)
    experts: dict[tuple[int, int], tuple[str, Optional[str]]] = field(default_factory=dict)  # (source, expert)

    def finish(self) -> None:
        """Order the per-expert parts by transformers' merge: gate_up = w1 of every expert, then w3
        of every expert (its sources 0 and 1); down = w2 of every expert."""
        if self.kind == "plain":
            return
        count = 1 + max(expert for _, expert in self.experts)
        projections = (0, 1) if self.kind == "gate_up" else (0,)
        missing = [(p, e) for p in projections for e in range(count) if (p, e) not in self.experts]
        if missing:
            raise KeyError(f"checkpoint lacks expert tensors {missing[:4]} for {self.target}")
        self.parts = [self.experts[(p, e)] for p in projections for e in range(count)]


def _renamings() -> list[WeightRenaming]:
    return conversions("deepseek_v4")[0]


def transformers_name(key: str, renamings: Iterable[WeightRenaming]) -> str:
    """A checkpoint key -> transformers' parameter name (``model.`` prefix except the LM head)."""
    name = key.removeprefix("model.")
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name if name.startswith("lm_head.") else "model." + name


def _expert_part(name: str, merges: Iterable[Merge]) -> Optional[tuple[str, Merge, int, int]]:
    """(fused target, its merge, source index, expert number) of a per-expert tensor, by
    transformers' conversion table (server/adapters/expert_weights.py), else None."""
    for merge in merges:
        for index, pattern in enumerate(merge.sources):
            match = pattern.search(name)
            if match:
                return name[: match.start()] + merge.target, merge, index, int(match["expert"])
    return None


def _scale_keys(keys: set[str]) -> dict[str, str]:
    """weight key -> its dequantization scale key, for every quantized weight."""
    scales = {}
    for key in keys:
        if key.endswith(".weight_scale_inv"):
            scales[key.removesuffix("_scale_inv")] = key
        elif key.endswith(".scale") and key.removesuffix(".scale") + ".weight" in keys:
            scales[key.removesuffix(".scale") + ".weight"] = key
    return scales


def map_span(
    weight_map: Iterable[str], targets: set[str], layers: range, head: bool, tail: bool
) -> dict[str, TensorSource]:
    """Find the checkpoint tensors of every parameter in ``targets`` (transformers names)."""
    keys = set(weight_map)
    scales = _scale_keys(keys)
    renamings, merges = conversions("deepseek_v4")
    sources: dict[str, TensorSource] = {}
    for key in keys:
        if key in scales.values():
            continue
        layer = _LAYER_KEY.match(key)
        if (layer is None and not (head or tail)) or (layer is not None and int(layer.group(1)) not in layers):
            continue
        name = transformers_name(key, renamings)
        expert = _expert_part(name, merges)
        if expert:
            target, merge, index, number = expert
            if target in targets:
                kind = "gate_up" if len(merge.sources) == 2 else "down"
                source = sources.setdefault(target, TensorSource(target, kind))
                source.experts[(index, number)] = (key, scales.get(key))
        elif name in targets:
            sources[name] = TensorSource(name, parts=[(key, scales.get(key))])
    for source in sources.values():
        source.finish()
    missing = sorted(targets - set(sources))
    if missing:
        raise KeyError(f"the checkpoint has no tensors for {len(missing)} parameters of this span, e.g. {missing[:3]}")
    return sources


def _dequantize(weight: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    if scale is None:
        return weight
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32)


def iter_plain(
    checkpoint: Checkpoint, sources: Iterable[TensorSource], dtype_of: Callable[[str], torch.dtype]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(target, tensor) for each plain parameter, one at a time (quantized ones read in float32
    to be scaled), so a caller that quantizes as it goes holds one float tensor at a time."""
    for source in sources:
        quantized = source.parts[0][1] is not None
        keys = {k for k in source.parts[0] if k}
        tensors = checkpoint.read(keys, torch.float32 if quantized else dtype_of(source.target), progress=False)
        yield source.target, _assemble(source.parts[0], tensors, dtype_of(source.target))


def iter_experts(
    checkpoint: Checkpoint, source: TensorSource, dtype: torch.dtype
) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, weight) of a fused expert parameter, expert by expert: ``gate_up`` gives
    ``cat(w1, w3)`` ([2I, H]), ``down`` gives ``w2`` ([H, I]). Read a few experts at a time to
    bound the memory used while loading."""
    count = len(source.parts) // (2 if source.kind == "gate_up" else 1)
    for begin in range(0, count, EXPERTS_PER_READ):
        experts = range(begin, min(count, begin + EXPERTS_PER_READ))
        if source.kind == "gate_up":
            parts = [[source.parts[e], source.parts[count + e]] for e in experts]
        else:
            parts = [[source.parts[e]] for e in experts]
        tensors = checkpoint.read(
            {k for group in parts for pair in group for k in pair if k}, torch.float32, progress=False
        )
        for expert, group in zip(experts, parts):
            yield expert, torch.cat([_assemble(pair, tensors, dtype) for pair in group], dim=0)


def _assemble(part: tuple[str, Optional[str]], tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    weight_key, scale_key = part
    tensor = _dequantize(tensors[weight_key], tensors[scale_key] if scale_key else None)
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


# ---- the multi-token-prediction module (mtp.{i}.*) --------------------------------------------

_MTP_KEY = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
# DeepSeek's MTPBlock is a Block plus these tensors (key after ``mtp.{i}.`` -> the parameter of
# server.adapters.deepseek_v4_mtp.DeepseekV4MTP). Everything else under ``mtp.{i}.`` is read as the
# block's own tensors, named like ``layers.{n}.*`` (``attn.*``, ``ffn.*``, ``attn_norm``,
# ``hc_attn_fn`` ...) and renamed by transformers' table like a main layer's. These names come from
# DeepSeek-V4's reference inference code; they could not be checked against the hub checkpoints here.
MTP_EXTRAS = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
MTP_BLOCK_PREFIX = "layer."  # the MTP module's decoder layer


def mtp_keys(weight_map: Iterable[str], index: int = 0) -> dict[str, str]:
    """The checkpoint's keys of MTP module ``index``: key -> its name after ``mtp.{index}.``."""
    found = {}
    for key in weight_map:
        match = _MTP_KEY.match(key)
        if match and int(match.group(1)) == index:
            found[key] = match.group(2)
    return found


def mtp_attention_type(weight_map: Iterable[str], index: int = 0) -> str:
    """The attention of the MTP module's block, read off its tensors (transformers' config drops
    the MTP entry of ``compress_ratios``): an indexer makes it CSA, a compressor alone HCA,
    neither a sliding-window-only layer."""
    rests = mtp_keys(weight_map, index).values()
    if any(rest.startswith("attn.indexer.") for rest in rests):
        return "compressed_sparse_attention"
    if any(rest.startswith("attn.compressor.") for rest in rests):
        return "heavily_compressed_attention"
    return "sliding_attention"


def map_mtp(weight_map: Iterable[str], targets: set[str], index: int, layer: int) -> dict[str, TensorSource]:
    """Like :func:`map_span`, for MTP module ``index`` (its block numbered ``layer``, i.e.
    ``num_hidden_layers + index``): ``targets`` are the parameter names of the MTP module
    (``layer.self_attn.q_a_proj.weight``, ``e_proj.weight``, ``hc_head.hc_fn`` ...). A tensor
    under ``mtp.{index}.`` that fits no parameter is an error, so a checkpoint whose names differ
    from what was assumed fails loudly."""
    keys = mtp_keys(weight_map, index)
    scales = _scale_keys(set(keys))
    aliases: dict[str, str] = {}  # the key a main layer numbered `layer` would have -> the MTP key
    extras: dict[str, TensorSource] = {}
    extra_scales = {scales[key] for key, rest in keys.items() if rest in MTP_EXTRAS and key in scales}
    for key, rest in keys.items():
        if rest in MTP_EXTRAS:
            target = MTP_EXTRAS[rest]
            if target in targets:
                extras[target] = TensorSource(target, parts=[(key, scales.get(key))])
        elif key not in extra_scales:
            aliases[f"layers.{layer}.{rest}"] = key
    prefix = f"model.layers.{layer}."
    block_targets = {prefix + t.removeprefix(MTP_BLOCK_PREFIX): t for t in targets if t.startswith(MTP_BLOCK_PREFIX)}
    sources = dict(extras)
    try:
        block = map_span(aliases, set(block_targets), range(layer, layer + 1), head=False, tail=False)
    except KeyError as e:
        raise KeyError(f"MTP module mtp.{index}: {e.args[0]}") from None
    for name, source in block.items():
        source.target = block_targets[name]
        source.parts = [(aliases[w], aliases[s] if s else None) for w, s in source.parts]
        source.experts = {}
        sources[source.target] = source
    missing = sorted(targets - set(sources))
    if missing:
        raise KeyError(
            f"the checkpoint has no tensors for {len(missing)} parameters of MTP module mtp.{index}, e.g. {missing[:3]}"
        )
    used = {k for source in sources.values() for pair in source.parts for k in pair if k}
    unused = sorted(set(keys) - used)
    if unused:
        raise KeyError(f"checkpoint tensors of MTP module mtp.{index} fit no parameter of it: {unused[:4]}")
    return sources


def embedding_source(weight_map: Iterable[str]) -> TensorSource:
    """The token embeddings (``embed.weight`` in DeepSeek's names), for a tail that needs them."""
    name = "model.embed_tokens.weight"
    return map_span(weight_map, {name}, range(0), head=True, tail=False)[name]
