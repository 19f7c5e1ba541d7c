"""Per-architecture span adapters, chosen by the config's ``model_type``."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from server.adapters.base import SpanAdapter, SpanCancelled
from server.adapters.llama import LlamaFamilyAdapter
from server.quantization import Quant
from server.weights import Checkpoint

ADAPTERS: dict[str, type[SpanAdapter]] = {
    model_type: LlamaFamilyAdapter for model_type in ("llama", "mistral", "qwen2", "qwen3")
}
try:
    from server.adapters.deepseek_v4 import DeepseekV4Adapter

    ADAPTERS["deepseek_v4"] = DeepseekV4Adapter
except ImportError:  # a transformers without deepseek_v4: that model type stays unsupported
    pass


def adapter_class(config: PretrainedConfig) -> type[SpanAdapter]:
    try:
        return ADAPTERS[config.model_type]
    except KeyError:
        raise ValueError(
            f"model type {config.model_type!r} is not supported yet; supported: {sorted(ADAPTERS)}"
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
