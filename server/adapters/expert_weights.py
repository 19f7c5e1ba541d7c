"""Which checkpoint tensors make each parameter of a span, for families whose hub checkpoints
name tensors differently from transformers' modules: driven by transformers' own conversion
table (``transformers.conversion_mapping.get_checkpoint_conversion_mapping``), so a family whose
table holds only renamings and expert merges needs nothing here.

Mixture-of-experts checkpoints (Mixtral, Qwen2/3-MoE, DeepSeek-V3, GLM-4-MoE) ship one tensor
per expert and projection (``mlp.experts.7.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.7.w1.weight``), while transformers 5 holds a layer's routed experts
fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]). The table
says how: a ``WeightConverter`` whose source patterns carry ``*`` where the expert number goes,
with ``MergeModulelist(dim=0)`` (stack the experts) and, for several sources, ``Concatenate(dim=1)``
(all gate projections, then all up projections). A ``WeightRenaming`` renames a key first
(Mixtral: ``.block_sparse_moe.`` -> ``.mlp.``). Checkpoints already fused (gpt-oss) or keyed as
the modules are read as they are. Any other operation is refused naming the model type, rather
than loaded wrong.

A weight with a ``.weight_scale_inv`` companion (DeepSeek-V3's FP8 hub checkpoints) is dequantized
as transformers does on a device without FP8 kernels (SCALE_SUFFIX below). gpt-oss's MXFP4 experts
(``experts.gate_up_proj_blocks`` with ``_scales``) are dequantized by transformers' own function
(server/adapters/mxfp4_experts.py).

Only the span's keys are read (server/weights.py ``Checkpoint``); a fused parameter is assembled
from its experts' tensors and handed over whole, so the peak extra memory while loading is one
fused parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Container, Iterable, Iterator, Optional

import torch

from server.adapters import mxfp4_experts
from server.weights import Checkpoint

EXPERTS_PER_READ = 16
# FP8 checkpoints (DeepSeek-V3's hub weights): a weight with a ``.weight_scale_inv`` companion holds FP8 e4m3
# values in [128, 128] blocks, each scaled by one float; read as transformers does on a device without FP8
# kernels (``dequantize=True``: its own Fp8Dequantize routine), into --dtype or then int8/NF4 under --quant
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Merge:
    """One of transformers' expert merges: keys matching ``sources[i]`` (group ``expert``: the
    expert's number; what precedes the match is the layer's prefix) stack, expert by expert, into
    the parameter ``prefix + target``; several sources are then concatenated along ``concat_dim``."""

    sources: tuple[re.Pattern, ...]
    target: str
    concat_dim: Optional[int]


@dataclass
class Source:
    """How one span parameter is built: a plain key, or ``parts[i][e]`` = the key of source ``i``
    and expert ``e`` of a :class:`Merge`."""

    target: str
    key: Optional[str] = None
    merge: Optional[Merge] = None
    found: dict[tuple[int, int], str] = field(default_factory=dict)
    scales: dict[str, str] = field(default_factory=dict)  # weight key -> its FP8 block scales' key
    mxfp4_scales: Optional[str] = None  # ``key`` holds MXFP4 blocks (gpt-oss's experts); their scales' key

    def keys(self) -> list[str]:
        return [self.key] if self.key else list(self.found.values())

    def parts(self) -> list[list[str]]:
        """Keys by source, each in expert order; an expert missing from the checkpoint is an error."""
        assert self.merge is not None
        count = 1 + max(expert for _, expert in self.found)
        missing = [(i, e) for i in range(len(self.merge.sources)) for e in range(count) if (i, e) not in self.found]
        if missing:
            raise KeyError(
                f"checkpoint lacks {len(missing)} expert tensor(s) of {self.target}, e.g. source/expert {missing[0]}"
            )
        return [[self.found[(i, e)] for e in range(count)] for i in range(len(self.merge.sources))]


def _unescape(pattern: str) -> str:
    return pattern.replace("\\.", ".")


def conversions(model_type: str) -> tuple[list, list[Merge]]:
    """(renamings, merges) of ``model_type`` from transformers' table; a converter this module
    does not know how to apply is refused naming the model type."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    renamings, merges = [], []
    for entry in get_checkpoint_conversion_mapping(model_type) or []:
        if not isinstance(entry, WeightConverter):
            renamings.append(entry)
            continue
        ops = list(entry.operations)
        stack_ok = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        concat = ops[1] if len(ops) == 2 and isinstance(ops[1], Concatenate) else None
        if not stack_ok or len(ops) > 2 or (len(ops) == 2 and concat is None) or len(entry.target_patterns) != 1:
            raise ValueError(
                f"model type {model_type!r}: transformers converts {entry.source_patterns} -> "
                f"{entry.target_patterns} with {ops}, which span loading cannot apply yet"
            )
        sources = []
        for pattern in entry.source_patterns:
            left, star, right = _unescape(pattern).partition("*")
            if not star:
                raise ValueError(f"model type {model_type!r}: expert pattern {pattern!r} has no '*'")
            sources.append(re.compile(re.escape(left) + r"(?P<expert>\d+)" + re.escape(right) + "$"))
        if len(sources) > 1 and concat is None:
            raise ValueError(f"model type {model_type!r}: {entry.source_patterns} merge with no Concatenate")
        target = _unescape(entry.target_patterns[0])
        merges.append(Merge(tuple(sources), target, concat.dim if concat else None))
    return renamings, merges


def renamed(key: str, renamings: Iterable) -> str:
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def map_keys(model_type: str, checkpoint_keys: Iterable[str], targets: Iterable[str]) -> dict[str, Source]:
    """target (transformers' parameter name, ``model.layers.N...``) -> its :class:`Source`; a
    target the checkpoint cannot make is an error naming a few of them."""
    wanted = set(targets)
    renamings, merges = conversions(model_type)
    keys = list(checkpoint_keys)
    scales = {key.removesuffix(SCALE_SUFFIX): key for key in keys if key.endswith(SCALE_SUFFIX)}
    sources: dict[str, Source] = {}
    for key in keys:
        if key.endswith(SCALE_SUFFIX):
            continue
        name = renamed(key, renamings)
        if name in wanted:
            sources[name] = Source(name, key=key, scales={key: scales[key]} if key in scales else {})
            continue
        packed = mxfp4_experts.packed_target(name, wanted)
        if packed:
            sources[packed] = Source(packed, key=key, mxfp4_scales=mxfp4_experts.scales_key(key, keys))
            continue
        for merge in merges:
            for i, pattern in enumerate(merge.sources):
                match = pattern.search(name)
                target = match and name[: match.start()] + merge.target
                if target in wanted:
                    source = sources.setdefault(target, Source(target, merge=merge))
                    source.found[(i, int(match["expert"]))] = key
                    if key in scales:
                        source.scales[key] = scales[key]
    missing = sorted(wanted - set(sources))
    if missing:
        raise KeyError(
            f"the {model_type} checkpoint has no tensors for {len(missing)} parameters of this span, e.g. {missing[:3]}"
        )
    return sources


def iter_tensors(
    checkpoint: Checkpoint,
    sources: Iterable[Source],
    dtype: torch.dtype,
    desc: str = "Loading",
    per_expert: Container[str] = (),
) -> Iterator[tuple[str, Optional[int], torch.Tensor]]:
    """(target, expert, tensor) for every source: plain keys streamed one at a time (expert None),
    each fused parameter assembled from its experts' tensors as transformers' merge does it, or,
    for targets in ``per_expert`` (a quantized span's experts), one expert's slice at a time. FP8
    weights are dequantized with their scales."""
    sources = list(sources)
    plain = {s.key: s.target for s in sources if s.key and not s.scales and not s.mxfp4_scales}
    for key, tensor in checkpoint.iter_read(list(plain), dtype, desc=desc):
        yield plain[key], None, tensor
    for source in sources:
        if source.key and source.mxfp4_scales and source.target in per_expert:
            for expert, tensor in mxfp4_experts.iter_dequantized(checkpoint, source.key, source.mxfp4_scales, dtype):
                yield source.target, expert, tensor
        elif source.key and source.mxfp4_scales:
            yield source.target, None, mxfp4_experts.dequantize(checkpoint, source.key, source.mxfp4_scales, dtype)
        if source.key and source.scales:
            yield source.target, None, _read(checkpoint, [source.key], source.scales, dtype)[source.key]
        if source.merge is None:
            continue
        if source.target in per_expert:
            for expert, tensor in iter_experts(checkpoint, source, dtype):
                yield source.target, expert, tensor
            continue
        parts = source.parts()
        tensors = _read(checkpoint, [k for keys in parts for k in keys], source.scales, dtype)
        stacked = [torch.stack([tensors.pop(k) for k in keys]) for keys in parts]
        dim = source.merge.concat_dim
        yield source.target, None, stacked[0] if dim is None else torch.cat(stacked, dim=dim)


def iter_experts(checkpoint: Checkpoint, source: Source, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its slice of the fused parameter), a few experts read at a time, so a quantized
    span never holds a layer's experts in float."""
    assert source.merge is not None
    parts = source.parts()
    dim = (source.merge.concat_dim or 1) - 1  # the stacked tensors' dim without the expert axis
    count = len(parts[0])
    for begin in range(0, count, EXPERTS_PER_READ):
        experts = range(begin, min(count, begin + EXPERTS_PER_READ))
        tensors = _read(checkpoint, [keys[e] for keys in parts for e in experts], source.scales, dtype)
        for e in experts:
            yield e, torch.cat([tensors.pop(keys[e]) for keys in parts], dim=dim)


def _read(
    checkpoint: Checkpoint, keys: list[str], scales: dict[str, str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``keys`` in ``dtype``; those with FP8 scales read in float32 and dequantized first."""
    scaled = [k for k in keys if k in scales]
    tensors = checkpoint.read([k for k in keys if k not in scales], dtype, progress=False)
    if scaled:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        raw = checkpoint.read(scaled + [scales[k] for k in scaled], torch.float32, progress=False)
        for key in scaled:
            tensors[key] = Fp8Dequantize(None)._dequantize_one(raw[key], raw[scales[key]], torch.float32).to(dtype)
    return tensors
