"""Per-architecture span adapters, chosen by the config's ``model_type``."""

from __future__ import annotations

import importlib

import torch
from transformers import PretrainedConfig

from protocol.models import GENERIC_FAMILIES
from server.adapters.base import SpanAdapter, SpanCancelled
from server.quantization import Quant
from server.weights import Checkpoint

# model_type -> "module:class"; imported on first use, because importing transformers' DeepSeek-V4
# modeling code costs a Llama server 2-4 s of CPU at start on these machines
ADAPTERS: dict[str, str] = {
    # families whose layers take transformers' standard cache: the generic adapter (docs/families.md)
    **{model_type: "server.adapters.llama:LlamaFamilyAdapter" for model_type in GENERIC_FAMILIES},
    "deepseek_v4": "server.adapters.deepseek_v4:DeepseekV4Adapter",
}


def adapter_class(config: PretrainedConfig) -> type[SpanAdapter]:
    if config.model_type not in ADAPTERS:
        raise ValueError(f"model type {config.model_type!r} is not supported yet; supported: {sorted(ADAPTERS)}")
    module, _, name = ADAPTERS[config.model_type].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:  # e.g. a transformers without deepseek_v4
        raise ValueError(
            f"model type {config.model_type!r} needs {module}, which cannot be imported here: {e}"
        ) from None


def load_span(
    config: PretrainedConfig,
    checkpoint: Checkpoint,
    start: int,
    end: int,
    dtype: torch.dtype,
    device: str,
    quant: Quant = Quant.NONE,
) -> SpanAdapter:
    return adapter_class(config)(config, checkpoint, start, end, dtype=dtype, device=device, quant=Quant(quant))


__all__ = ["ADAPTERS", "SpanAdapter", "SpanCancelled", "adapter_class", "load_span"]
