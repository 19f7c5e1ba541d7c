"""One block of the model recomputed by the client, from the checkpoint's safetensors: the last step of a
dispute's bisection over a span's blocks (client/_bisection.py; docs/reliability.md, "Bisection over the
span's blocks").

Why the client and why one block: a dispute whose two tails disagree on the hidden state is narrowed to
the first block whose outputs differ while its inputs agree; that one block's computation the client can
check itself. It builds transformers' own decoder layer for the block on the meta device (the class the
family's ``PreTrainedModel`` names in ``_no_split_modules``: client/_replay_layers.py), then reads only
that block's tensors (``model.layers.{k}.*``; a mixture of experts' per-expert tensors fused as the layer
holds them) from the checkpoint, in float32: one block's weights,
read only on a dispute and dropped after it (SmolLM2-135M: 14 MB; a 70B Llama: 3.4 GB). It runs the
layer over the whole prefix (positions 0..t-1, the family's rotary embedding, a causal mask, and the
block's sliding window where it has one, as transformers' models read ``layer_types`` / ``sliding_window``;
no cache). The boundary after the last block is the final norm (``model.norm.weight``, the layer's own
RMS norm class), replayed the same way.

Only what the client can rebuild is replayed: the families the servers' generic adapter serves (Llama,
Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4-MoE, gpt-oss:
client/_replay_layers.py ``FAMILIES``; DeepSeek-V4 is refused by name), a checkpoint it has as a local
folder, servers of float32, bfloat16 or float16 without quantization (mixtures of experts: float32 only,
their routing being discontinuous); anything else
settles nothing (:meth:`BlockReplay.refusal`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from client import _replay_layers as layers

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")  # servers' dtypes a float32 replay stands for (unquantized)


class BlockReplay:
    def __init__(self, source: str, config: Any):
        self.folder = Path(source) if isinstance(source, (str, Path)) and os.path.isdir(source) else None
        self.config = config
        self.num_blocks = int(getattr(config, "num_hidden_layers", 0))

    def refusal(self, records=()) -> Optional[str]:
        """Why the client cannot replay this model's blocks for servers with ``records`` (None: it can)."""
        if self.folder is None:
            return "the client cannot read the checkpoint (not a local folder)"
        for r in records:
            if r is None or r.dtype not in DTYPES or (r.quantization or "none") != "none":
                return "a tail's precision or quantization is not one the client replays"
        return layers.refusal(getattr(self.config, "model_type", None), [r.dtype for r in records])

    def tensors(self, prefix: str) -> Optional[dict[str, torch.Tensor]]:
        """Every checkpoint tensor under ``prefix`` (prefix cut), float32; None where unreadable."""
        from safetensors import safe_open

        index = self.folder / "model.safetensors.index.json"
        try:
            if index.exists():
                names = json.loads(index.read_text())["weight_map"]
                shards = sorted({name for key, name in names.items() if key.startswith(prefix)})
            else:
                shards = ["model.safetensors"]
            found = {}
            for shard in shards:
                with safe_open(str(self.folder / shard), framework="pt") as f:
                    for key in f.keys():
                        if key.startswith(prefix):
                            found[key[len(prefix) :]] = f.get_tensor(key).float()
            return found or None
        except (OSError, ValueError, KeyError) as e:  # an unreadable shard settles nothing
            logger.info(f"Could not read {prefix}* from {self.folder}: {e!r}")
            return None

    @torch.inference_mode()
    def replay(self, block: int, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """The output [t, hidden] float32 of block ``block`` (``num_blocks``: the final norm) over
        ``inputs`` [t, hidden], the state entering it at positions 0..t-1; None where the tensors could
        not be read or do not fit the layer."""
        config = copy.deepcopy(self.config)
        # gpt-oss's attention sinks live only in its eager attention (as on the servers)
        config._attn_implementation = "eager" if config.model_type == "gpt_oss" else "sdpa"
        x = inputs.float()[None]
        last = min(block, self.num_blocks - 1)  # the final norm: the layers' own RMS norm class
        with torch.device("meta"):
            module = layers.layer_class(config)(config, layer_idx=last)
            if block == self.num_blocks:
                module = type(module.post_attention_layernorm)(config.hidden_size, eps=config.rms_norm_eps)
        weights = self.tensors("model.norm." if block == self.num_blocks else f"model.layers.{block}.")
        if weights is None:
            return None
        try:
            weights = layers.fused(config, weights, set(module.state_dict()))
            module.load_state_dict(weights, strict=True, assign=True)
        except (RuntimeError, KeyError) as e:  # names or shapes the layer does not have: settles nothing
            logger.info(f"Block {block}'s tensors do not fit the layer: {e!r}")
            return None
        module = module.float().eval()
        if block == self.num_blocks:
            return module(x)[0]
        t = x.shape[1]
        positions = torch.arange(t)[None]
        mask = layers.mask(t, layers.window(config, block))
        embeddings = layers.rotary(config)(x, positions)
        out = module(x, attention_mask=mask, position_ids=positions, position_embeddings=embeddings)
        return (out[0] if isinstance(out, tuple) else out)[0]
