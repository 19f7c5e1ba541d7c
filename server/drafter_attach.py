"""The tail's drafter on a span: which one ``--drafter`` names, whether it fits, and its memory.

A tail span may carry a drafter (server/tail_drafter.py, or DeepSeek-V4's own MTP module) that
proposes ids from the final hidden states the tail already has. The memory plan keeps room for it
(:func:`drafter_bytes`), and a span loaded where the plan leaves no room serves without one
(:func:`attach_drafter_if_it_fits`): coverage first, drafting is only speed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
from transformers import PretrainedConfig

from server.adapters import SpanAdapter
from server.memory import MemoryPlan
from server.quantization import Quant
from server.server_config import ServerConfig
from server.weights import Checkpoint

if TYPE_CHECKING:
    from server.eagle3_checkpoint import Eagle3Checkpoint

logger = logging.getLogger(__name__)


def attach_drafter(
    span: SpanAdapter, config: ServerConfig, model_config: PretrainedConfig, checkpoint: Checkpoint
) -> None:
    """``--drafter``: give a tail span its tail drafter (server/tail_drafter.py). ``auto`` picks the
    drafter committed for this model (matched by config fingerprint) and drafts nothing without one;
    ``none`` never drafts; a path loads that drafter file, and a file that does not fit is an error; a
    folder (or hub repo id) of an EAGLE-3 head in its published layout loads that head (server/eagle3_drafter.py).
    A DeepSeek-V4 tail drafts with its checkpoint's own MTP module instead (server/adapters/deepseek_v4_mtp.py),
    a DeepSeek-V3 tail under ``auto`` with its MTP layer where the checkpoint has one (deepseek_v3_mtp.py)."""
    from server.tail_drafter import build_tail_drafter

    span.drafter, span.taps = None, None
    if config.drafter == "none" or not span.is_tail:
        return
    if model_config.model_type == "deepseek_v4":
        from server.adapters.deepseek_v4_mtp import build_mtp_drafter

        span.drafter = build_mtp_drafter(
            span, model_config, checkpoint, config.drafter, max_drafts=config.drafter_tokens
        )
        return
    if model_config.model_type == "deepseek_v3" and config.drafter == "auto":
        from server.adapters.deepseek_v3_mtp import build_mtp_drafter

        span.drafter = build_mtp_drafter(span, model_config, checkpoint, max_drafts=config.drafter_tokens)
        if span.drafter is not None:
            logger.info(f"Tail drafter: the checkpoint's MTP layer (up to {config.drafter_tokens} ids per run)")
            return
    eagle3 = eagle3_checkpoint(config, model_config)
    if eagle3 is not None:
        from server.eagle3_drafter import build_eagle3_drafter

        span.drafter = build_eagle3_drafter(span, eagle3, checkpoint, _eos_ids(model_config), config.drafter_tokens)
        logger.info(
            f"Tail drafter: EAGLE-3 head {eagle3.path} (features at layer boundaries {list(eagle3.boundaries)}, "
            f"from this span's {span.start}:{span.end}; up to {config.drafter_tokens} ids per run)"
        )
        return
    path = drafter_file(config, model_config)
    if path is None:
        logger.info("Tail drafter: none (no committed drafter for this model)")
        return
    span.drafter = build_tail_drafter(span, model_config, checkpoint, path, max_drafts=config.drafter_tokens)
    logger.info(f"Tail drafter: {path} (up to {config.drafter_tokens} ids per run)")


def eagle3_checkpoint(
    config: ServerConfig, model_config: PretrainedConfig, values: bool = True
) -> Optional["Eagle3Checkpoint"]:
    """The EAGLE-3 head ``--drafter`` names (a folder in the published layout, or a hub repo id), read
    and checked against this model (server/eagle3_checkpoint.py); None when it names something else.
    ``values`` False: its weights' shapes only (the memory plan)."""
    from protocol.models import ALIASES
    from server.eagle3_checkpoint import is_eagle3, read_eagle3, resolve

    if config.drafter in ("auto", "none") or not is_eagle3(config.drafter):
        return None
    drafter_file(config, model_config)  # Llama-family models only: refused with the same line
    names = (config.model, ALIASES.get(config.model) or "", getattr(model_config, "_name_or_path", "") or "")
    return read_eagle3(resolve(config.drafter), model_config, names, values)


def _eos_ids(model_config: PretrainedConfig) -> tuple[int, ...]:
    eos = model_config.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def drafter_file(config: ServerConfig, model_config: PretrainedConfig) -> Optional[str]:
    """The drafter file ``--drafter`` names for a Llama-family tail (auto: the committed one, if any)."""
    from server.adapters import adapter_class
    from server.adapters.llama import LlamaFamilyAdapter
    from server.tail_drafter import committed_drafter

    llama = issubclass(adapter_class(model_config), LlamaFamilyAdapter)
    if config.drafter == "auto":
        path = committed_drafter(model_config) if llama else None
        return None if path is None else str(path)
    if not llama:
        raise ValueError(f"--drafter {config.drafter}: tail drafters exist only for Llama-family models so far")
    return config.drafter


def attach_drafter_if_it_fits(
    span: SpanAdapter,
    config: ServerConfig,
    model_config: PretrainedConfig,
    checkpoint: Checkpoint,
    plan: Optional[MemoryPlan],
) -> None:
    """:func:`attach_drafter`, unless the memory plan leaves a tail of this length no room for the
    drafter: then the span serves without one (coverage first, drafting is only speed)."""
    if span.is_tail and plan is not None and config.drafter != "none" and not plan.fits(span.start, span.end):
        span.drafter, span.taps = None, None
        logger.info(f"Tail drafter: none (blocks {span.start}:{span.end} leave no memory for it, by the memory plan)")
        return
    attach_drafter(span, config, model_config, checkpoint)


def drafter_bytes(
    config: ServerConfig,
    model_config: PretrainedConfig,
    checkpoint: Optional[Checkpoint],
    dtype: torch.dtype,
    quant: Quant,
) -> int:
    """Memory the drafter of ``attach_drafter`` takes on a tail beyond its blocks (0: none), so that
    the memory plan can keep room for it (MemoryPlan.tail_blocks). A file that cannot be read counts
    0 here: loading it later says what is wrong. Without a ``checkpoint`` (``--plan-only`` before
    any weights are reachable) the config alone decides."""
    if config.drafter == "none":
        return 0
    if model_config.model_type == "deepseek_v4":
        from server.adapters.deepseek_v4_mtp import mtp_bytes

        return mtp_bytes(model_config, checkpoint, dtype, quant) if config.drafter == "auto" else 0
    if model_config.model_type == "deepseek_v3" and config.drafter == "auto":
        from server.adapters.deepseek_v3_mtp import has_mtp, mtp_bytes

        if has_mtp(model_config, checkpoint):
            return mtp_bytes(model_config, dtype, quant)
    from safetensors import SafetensorError

    from server.tail_drafter import drafter_file_bytes

    tied = (
        bool(getattr(model_config, "tie_word_embeddings", False))
        if checkpoint is None
        else "lm_head.weight" not in checkpoint.weight_map()
    )
    eagle3 = eagle3_checkpoint(config, model_config, values=False)  # a head for another model is refused at start
    if eagle3 is not None:
        from server.eagle3_drafter import eagle3_bytes

        return eagle3_bytes(eagle3, dtype, tied)
    path = drafter_file(config, model_config)
    if path is None:
        return 0
    try:
        return drafter_file_bytes(path, model_config, dtype, tied=tied)
    except (OSError, SafetensorError):  # missing or no safetensors file: attach_drafter names it
        return 0
