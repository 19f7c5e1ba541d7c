"""What the client's replay of one block (client/_block_replay.py) needs per family, found from the config
alone: transformers' own decoder layer class, its rotary embedding, its final-norm class, each layer's
sliding window, and the checkpoint's per-expert tensors fused as the layer holds them.

Why generic and why a fixed list: the layer class is the one the family's ``PreTrainedModel`` names in
``_no_split_modules`` (transformers' own unit of a decoder layer), so no family's layer is written here;
but a replay that computes something else than the servers do could let a liar fit it and the honest
tail not, so only the families the servers serve through the generic adapter (server/adapters/llama.py,
whose layers take ``(hidden, attention_mask, position_ids, position_embeddings)``) and whose replay a
test compares with transformers (tests/hostile/test_bisection.py) are replayed. DeepSeek-V4's layer is
its own code (hyper-connection streams, hash-routed experts fed token ids, compressed caches): refused
by name, as is any other family.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Optional

import torch

from protocol.models import GENERIC_FAMILIES

# every family the servers' generic adapter serves (protocol/models.py), each replay checked against
# transformers by a test
FAMILIES = GENERIC_FAMILIES
# mixtures of experts: their routers pick the top-k experts, a discontinuous choice that a 16-bit server and the
# client's float32 replay may make differently at a near tie (then the honest side would not fit and a liar
# sending the float32 replay would): replayed only for float32 tails, whose rounding differs from the replay's
# by about 1e-7 (tests/hostile/test_bisection_families.py measures 3.8e-6 at most over a whole block)
ROUTED = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
REFUSED = {
    "deepseek_v4": "DeepSeek-V4's decoder layer is its own code (hyper-connection streams, hash-routed experts "
    "fed token ids, compressed caches), which the client does not rebuild",
}
# Mixtral's hub names for its experts' projections and block (transformers' conversion table renames them)
MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
EXPERT = re.compile(r"^(.*experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def refusal(model_type: Optional[str], dtypes=()) -> Optional[str]:
    """Why the client replays no block of ``model_type`` for tails of ``dtypes`` (None: it does)."""
    if model_type in REFUSED:
        return REFUSED[model_type]
    if model_type not in FAMILIES:
        return f"the client rebuilds no {model_type!r} block (only {FAMILIES})"
    if model_type in ROUTED and any(dtype != "float32" for dtype in dtypes):
        return "a mixture of experts' routing may differ between a 16-bit tail and a float32 replay"
    return None


def modeling(config: Any):
    """transformers' modeling module of ``config.model_type``."""
    return importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")


def layer_class(config: Any) -> type:
    """The decoder layer class the family's ``PreTrainedModel`` names in ``_no_split_modules``."""
    module = modeling(config)
    bases = [v for v in vars(module).values() if isinstance(v, type) and v.__name__.endswith("PreTrainedModel")]
    names = {n for base in bases for n in (getattr(base, "_no_split_modules", None) or ())}
    layers = [getattr(module, n) for n in names if n.endswith("DecoderLayer") and hasattr(module, n)]
    if len(layers) != 1:
        raise ValueError(f"{config.model_type}: no single decoder layer class in {sorted(names)}")
    return layers[0]


def rotary(config: Any) -> torch.nn.Module:
    """The family's rotary embedding (its only ``*RotaryEmbedding`` class), built on the CPU for ``config``."""
    module = modeling(config)
    found = [v for n, v in vars(module).items() if n.endswith("RotaryEmbedding") and isinstance(v, type)]
    if len(found) != 1:
        raise ValueError(f"{config.model_type}: {len(found)} rotary embedding classes")
    return found[0](config=config)


def window(config: Any, block: int) -> Optional[int]:
    """Block ``block``'s sliding window (None: full attention), read as transformers' models (and the
    servers: server/adapters/llama.py ``_layer_windows``) read the config: ``layer_types`` where it has
    them, else every layer sliding when ``sliding_window`` is set."""
    size = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if size else "full_attention"] * (block + 1)
    return size if types[block] == "sliding_attention" and size else None


def mask(t: int, size: Optional[int]) -> torch.Tensor:
    """[1, 1, t, t] additive float mask: causal, and with a window ``size`` only keys at positions >
    query - size (transformers' sliding rule)."""
    query, key = torch.arange(t)[:, None], torch.arange(t)[None]
    allowed = (key <= query) & ((query - key < size) if size else True)
    return torch.zeros(t, t).masked_fill(~allowed, float("-inf"))[None, None]


def fused(config: Any, tensors: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """The block's checkpoint tensors under the layer's names: hub checkpoints of mixtures of experts keep
    one tensor per expert and projection, transformers' layers a fused ``experts.gate_up_proj`` [E, 2I, H]
    (every expert's gate rows, then its up rows) and ``experts.down_proj`` [E, H, I], as its conversion table
    merges them (server/adapters/expert_weights.py does the same for the servers)."""
    if config.model_type == "mixtral":
        renamed = {}
        for key, value in tensors.items():
            for old, new in MIXTRAL_NAMES.items():
                key = key.replace(old, new)
            renamed[key] = value
        tensors = renamed
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in tensors.items():
        found = EXPERT.match(key)
        if found and f"{found[1]}.gate_up_proj" in wanted:
            experts.setdefault(found[1], {}).setdefault(found[3], {})[int(found[2])] = value
        else:
            out[key] = value
    for prefix, parts in experts.items():
        count = len(parts.get("gate_proj", {}))
        names = ("gate_proj", "up_proj", "down_proj")
        stack = {name: [parts.get(name, {}).get(e) for e in range(count)] for name in names}
        if any(x is None for xs in stack.values() for x in xs):
            raise KeyError(f"{prefix}: an expert's projection is missing from the checkpoint")
        out[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack(stack["gate_proj"]), torch.stack(stack["up_proj"])], 1)
        out[f"{prefix}.down_proj"] = torch.stack(stack["down_proj"])
    return out
