"""Tiny EAGLE-3 heads written in their published layout (server/eagle3_checkpoint.py): a config.json
of a one-layer ``LlamaForCausalLMEagle3`` and ``model.safetensors`` with ``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t`` and ``t2d``; random weights and a made-up draft vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

DRAFT_VOCAB = 300  # ids the tiny heads may propose


def draft_vocab_ids(vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[DRAFT_VOCAB] sorted target ids of the made-up draft vocabulary (the lowest ids and a random rest)."""
    generator = torch.Generator().manual_seed(seed)
    rest = torch.randperm(vocab_size - 100, generator=generator)[: DRAFT_VOCAB - 100] + 100
    return torch.cat([torch.arange(100), rest]).sort().values


def head_config(target: Any, **changes: Any) -> dict[str, Any]:
    """The config.json of a head for ``target`` (a transformers config), as EAGLE-3's authors write it."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB,
        "torch_dtype": "float32",
    }
    config.update(changes)
    return config


def head_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the published names and shapes for ``config``, plus d2t and t2d."""
    torch.manual_seed(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    target_hidden = config.get("target_hidden_size") or hidden
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {
        "fc.weight": (hidden, 3 * target_hidden),
        "midlayer.self_attn.q_proj.weight": (q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, q),
        "midlayer.mlp.gate_proj.weight": (inner, hidden),
        "midlayer.mlp.up_proj.weight": (inner, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inner),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
    }
    tensors = {name: torch.randn(shape) * 0.2 for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
    ids = draft_vocab_ids(config["vocab_size"], seed)[: config["draft_vocab_size"]]
    tensors["d2t"] = ids - torch.arange(len(ids))  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def write_head(
    path: Path,
    target: Any,
    seed: int = 0,
    drop: tuple[str, ...] = (),
    replace: Optional[dict[str, torch.Tensor]] = None,
    speculators: bool = False,
    **config_changes: Any,
) -> Path:
    """A head folder at ``path`` for ``target``; ``drop`` leaves tensors out and ``replace`` swaps some
    (malformed heads), ``config_changes`` edit config.json (heads for other models). ``speculators``:
    in the speculators format instead (the decoder's fields under ``transformer_layer_config``, its
    layer named ``layers.0``, norm_before_residual by default), as vLLM's speculators adapter reads it."""
    from safetensors.torch import save_file

    config = head_config(target, **config_changes)
    tensors = head_tensors(config, seed)
    tensors.update(replace or {})
    for name in drop:
        del tensors[name]
    if speculators:
        tensors = {name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()}
        outer = {k: config.pop(k) for k in ("draft_vocab_size", "target_hidden_size") if k in config}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": config,
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": path.parent.name}},
            **outer,
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
