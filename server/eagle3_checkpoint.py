"""An EAGLE-3 drafter folder in its published layout: where it is, what it was trained for, its tensors.

The layout is the one EAGLE-3's authors publish (SafeAILab/EAGLE, ``eagle/model/cnets.py``; heads
such as ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``) and that vLLM loads
(``vllm/model_executor/models/llama_eagle3.py``, ``Eagle3LlamaForCausalLM.load_weights``) and SpecForge
trains: a ``config.json`` of a one-layer Llama (``architectures: ["LlamaForCausalLMEagle3"]``,
``hidden_size``, ``draft_vocab_size``, ``vocab_size`` = the target's, optionally ``target_hidden_size``
and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and weights ``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t`` (draft id -> target id offset), ``t2d`` (a mask over the
target vocabulary), maybe ``embed_tokens.weight``; in ``model.safetensors`` or ``pytorch_model.bin``.

A head trained for another model is refused by its fingerprint (the target's hidden size, vocabulary
size and, where the config names it, the target model) in one line naming both models.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import LlamaConfig, PretrainedConfig

EAGLE3_ARCHITECTURES = frozenset({"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"})
NOT_DECODER_FIELDS = frozenset({"architectures", "auto_map", "model_type", "speculators_config"})
TARGET_NAME_KEYS = ("target_model", "target_model_name_or_path", "base_model_name_or_path", "base_model")


@dataclass
class Eagle3Checkpoint:
    """What a drafter folder holds, checked against the model it is to draft for."""

    path: Path
    config: LlamaConfig  # the drafter's own one-layer decoder
    target_hidden: int  # the width of each of the three features fc fuses
    boundaries: tuple[int, int, int]  # the target's low/mid/high features, as vLLM counts aux layer ids
    tensors: dict[str, torch.Tensor]  # fc.*, midlayer.*, norm.*, lm_head.*, maybe embed_tokens.*
    d2t: Optional[torch.Tensor]  # [draft_vocab] long: target id = draft id + d2t[draft id]; None: same vocab


def is_eagle3(spec: str) -> bool:
    """Whether ``--drafter spec`` names an EAGLE-3 folder (or a hub repo id, not a file here)."""
    path = Path(spec)
    if path.is_dir():
        return (path / "config.json").exists() and _is_eagle3_config(_read_config(path))
    return not path.exists() and spec.count("/") == 1 and not spec.endswith(".safetensors")


def resolve(spec: str) -> Path:
    """A local folder as it is; a hub repo id through huggingface_hub (config and weights only)."""
    if Path(spec).is_dir():
        return Path(spec)
    try:
        from huggingface_hub import snapshot_download

        patterns = ["config.json", "*.safetensors", "pytorch_model.bin"]
        return Path(snapshot_download(spec, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - any hub failure is one line at start
        raise ValueError(f"--drafter {spec}: no such folder, and not a hub repo that could be read ({e})") from None


def read_eagle3(
    path: Path, model_config: PretrainedConfig, model_names: tuple[str, ...], values: bool = True
) -> Eagle3Checkpoint:
    """The checked contents of the drafter folder ``path`` for the model of ``model_config`` (named
    ``model_names``: the --model argument, its hub repo, its folder); a ValueError naming what is wrong.
    ``values`` False: the weights as meta tensors of their shapes (for the memory plan)."""
    raw = _flattened(path, _read_config(path))
    if not _is_eagle3_config(raw):
        raise ValueError(f"EAGLE-3 drafter {path}: config.json names no EAGLE-3 architecture or draft_vocab_size")
    check_fingerprint(path, raw, model_config, model_names)
    if int(raw.get("num_hidden_layers", 1)) != 1:
        layers = raw["num_hidden_layers"]
        raise ValueError(f"EAGLE-3 drafter {path}: num_hidden_layers is {layers}, only 1 is supported")
    fields = {k: v for k, v in raw.items() if k not in NOT_DECODER_FIELDS}
    config = LlamaConfig(**fields)
    config.num_hidden_layers = 1
    config._attn_implementation = "sdpa"
    config.draft_vocab_size = int(raw.get("draft_vocab_size") or raw["vocab_size"])
    tensors = _read_tensors(path, values)
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    _check_vocab_maps(path, config.draft_vocab_size, int(raw["vocab_size"]), d2t, t2d)
    return Eagle3Checkpoint(
        path=path,
        config=config,
        target_hidden=int(raw.get("target_hidden_size") or raw["hidden_size"]),
        boundaries=_boundaries(path, raw, model_config.num_hidden_layers),
        tensors=tensors,
        d2t=None if d2t is None else d2t.long(),
    )


def check_fingerprint(
    path: Path, raw: dict[str, Any], model_config: PretrainedConfig, model_names: tuple[str, ...]
) -> None:
    """Refuse a head trained for another model, in one line naming both."""
    hidden = int(raw.get("target_hidden_size") or raw.get("hidden_size", 0))
    vocab = int(raw.get("vocab_size", 0))
    target = target_name(raw)
    names = {_base(n) for n in model_names if n}
    other_name = target is not None and _base(target) not in names
    if (hidden, vocab) != (model_config.hidden_size, model_config.vocab_size) or other_name:
        theirs = f"{target or 'an unnamed model'} (hidden size {hidden}, vocabulary {vocab})"
        ours = f"{model_names[0]} (hidden size {model_config.hidden_size}, vocabulary {model_config.vocab_size})"
        raise ValueError(f"EAGLE-3 drafter {path} was trained for another model: {theirs}, not {ours}")


def target_name(raw: dict[str, Any]) -> Optional[str]:
    """The target model a head's config names, if any (speculators' configs name it as the verifier)."""
    for key in TARGET_NAME_KEYS:
        if isinstance(raw.get(key), str) and raw[key]:
            return raw[key]
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) and name else None


def _base(name: str) -> str:
    return os.path.basename(str(name).rstrip("/")).lower()


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"EAGLE-3 drafter {path}: cannot read config.json ({e})") from None


def _is_eagle3_config(raw: dict[str, Any]) -> bool:
    return (
        bool(EAGLE3_ARCHITECTURES & set(raw.get("architectures") or ()))
        or "draft_vocab_size" in raw
        or raw.get("speculators_model_type") == "eagle3"
    )


def _flattened(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A speculators-format config (``speculators_model_type: eagle3``, the decoder's fields under
    ``transformer_layer_config``, as RedHat's converted heads ship) as one LlamaForCausalLMEagle3-style
    dict, the way vLLM's speculators adapter reads it (``transformers_utils/configs/speculators/algos.py``:
    ``norm_before_residual`` defaults to true there); other configs as they are."""
    if raw.get("speculators_model_type") != "eagle3" or not isinstance(raw.get("transformer_layer_config"), dict):
        return raw
    if raw.get("norm_before_fc"):
        raise ValueError(f"EAGLE-3 drafter {path}: norm_before_fc heads are not supported")
    flat = dict(raw["transformer_layer_config"])
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "speculators_config"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))
    flat["speculators_model_type"] = "eagle3"
    return flat


def _read_tensors(path: Path, values: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weights, names without a leading ``model.``. ``values`` False:
    safetensors weights as meta tensors of their shapes (the memory plan needs no more), the
    vocabulary maps read whole (they are checked)."""
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    try:
        if files:
            from safetensors import safe_open

            for file in files:
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():
                        wanted = values or name.endswith(("d2t", "t2d"))
                        shape = None if wanted else f.get_slice(name).get_shape()
                        tensors[name] = f.get_tensor(name) if wanted else torch.empty(shape, device="meta")
        elif (path / "pytorch_model.bin").exists():
            tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise ValueError("no model.safetensors or pytorch_model.bin")
    except Exception as e:  # noqa: BLE001 - an unreadable file is one line at start
        raise ValueError(f"EAGLE-3 drafter {path}: cannot read its weights ({e})") from None
    # speculators' heads name the decoder layer ``layers.0``, EAGLE's ``midlayer`` (vLLM maps both)
    return {name.removeprefix("model.").replace("layers.0.", "midlayer.", 1): t for name, t in tensors.items()}


def _check_vocab_maps(
    path: Path, draft_vocab: int, vocab: int, d2t: Optional[torch.Tensor], t2d: Optional[torch.Tensor]
) -> None:
    """d2t must map every draft id into the target vocabulary, and agree with t2d where both are given."""
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(
                f"EAGLE-3 drafter {path}: no d2t, which a draft vocabulary of {draft_vocab} ids "
                f"(the target's has {vocab}) needs to map its ids to the target's"
            )
        return
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        shape = f"{list(d2t.shape)} ({d2t.dtype})"
        raise ValueError(f"EAGLE-3 drafter {path}: d2t has shape {shape}, needs [{draft_vocab}] integers")
    targets = torch.arange(draft_vocab) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise ValueError(f"EAGLE-3 drafter {path}: d2t maps draft ids outside the target vocabulary of {vocab}")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise ValueError(f"EAGLE-3 drafter {path}: t2d has shape {list(t2d.shape)}, needs [{vocab}]")
        if not bool(t2d.bool()[targets].all()) or int(t2d.bool().sum()) != draft_vocab:
            raise ValueError(f"EAGLE-3 drafter {path}: t2d does not mark exactly the target ids d2t maps to")


def _boundaries(path: Path, raw: dict[str, Any], num_layers: int) -> tuple[int, int, int]:
    """The low/mid/high features' layer boundaries: the config's ``eagle_aux_hidden_state_layer_ids``
    (top level or in ``eagle_config``), else vLLM's default for EAGLE-3 (2, L // 2, L - 3)."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids is None:
        ids = (min(2, num_layers), num_layers // 2, max(num_layers - 3, 0))
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i <= num_layers for i in ids):
        raise ValueError(f"EAGLE-3 drafter {path}: aux hidden state layers {list(ids)} do not fit {num_layers} layers")
    return ids  # type: ignore[return-value]
