"""``python -m swarm.server --model NAME --plan-only``: the memory plan, before anything loads.

A volunteer asks what a machine would serve before downloading hundreds of gigabytes: the plan
needs only the model's config (from the hub, a local folder, or, offline, the published config
the package ships for the large aliases: protocol/configs/) and a free-memory figure (the
device's, or ``--assume-free-memory``, which also plans for a machine this is not). No weights
are read and no DHT is joined.
"""

from __future__ import annotations

import logging

import torch

from protocol.models import resolve_model, shipped_config_dir
from server.drafter_attach import drafter_bytes
from server.lora import plan_adapters
from server.memory import MemoryPlan, plan_blocks
from server.model_source import load_model_config
from server.placement import check_requested_blocks
from server.quantization import Quant, default_quant
from server.server_config import ServerConfig
from server.span_server import resolve_dtype
from server.weights import Checkpoint

logger = logging.getLogger(__name__)


def make_plan(config: ServerConfig) -> tuple[MemoryPlan, str]:
    """The plan ``SpanServer.create`` would make (and the device it is for), from configs only."""
    device = _plan_device(config)
    dtype = resolve_dtype(config.dtype, device)
    model_config, source = _config(config.model)
    if config.quant == "auto":
        quant = default_quant(model_config).quant  # what the device would run is checked when serving
    else:
        try:
            quant = Quant(config.quant)
        except ValueError:
            raise ValueError(f"--quant must be one of auto, none, int8, nf4, got {config.quant!r}") from None
    checkpoint = Checkpoint(source) if source is not None and _weight_map_readable(source) else None
    drafter = drafter_bytes(config, model_config, checkpoint, dtype, quant)
    plan = plan_blocks(
        model_config,
        dtype,
        device,
        model_config.num_hidden_layers,
        free_bytes=config.assume_free_memory,
        quant=quant,
        drafter_bytes=drafter,
        cache_tokens=config.cache_tokens,
        adapter_bytes=plan_adapters(config.adapters, config.model, model_config.num_hidden_layers, dtype)[1],
        training=config.train_plan(),
    )
    return plan, device


def plan_text(config: ServerConfig) -> str:
    """The plan as printed: one line of what fits, then whether the blocks asked for fit."""
    plan, device = make_plan(config)
    where = f"{device} ({'assumed' if config.assume_free_memory is not None else 'measured'} free memory)"
    lines = [plan.describe(where)]
    check_requested_blocks(config, plan, device)  # raises, naming the shortfall, when they do not fit
    if config.blocks is not None:
        lines.append(f"--blocks {config.blocks[0]}:{config.blocks[1]} fit")
    elif config.num_blocks is not None:
        lines.append(f"--num-blocks {config.num_blocks} fit")
    return "\n".join(lines)


def _plan_device(config: ServerConfig) -> str:
    """``--device`` for a plan: a CUDA device need not exist here when its free memory is assumed."""
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device.startswith("cuda") and not torch.cuda.is_available() and config.assume_free_memory is None:
        raise ValueError(
            f"--device {config.device}: CUDA is not available here; pass --assume-free-memory "
            "to plan for that device's free memory"
        )
    return config.device


def _config(name: str):
    """The model's config and where its weights would come from (None: only the shipped config is reachable)."""
    shipped = shipped_config_dir(name)
    try:
        source = resolve_model(name).source
        return load_model_config(source), source
    except (ValueError, RuntimeError, OSError) as e:
        if shipped is None:
            raise
        logger.info(f"{e}; planning with the published config shipped with specswarm ({shipped})")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(shipped), None


def _weight_map_readable(source: str) -> bool:
    """Whether the checkpoint's tensor names can be read without downloading weights (a local
    folder, or an index already in the hub cache)."""
    import os

    if os.path.isdir(source):
        return True
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(source, "model.safetensors.index.json"), str)
