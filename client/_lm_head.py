"""Rows of the model's LM head, read by the client from the checkpoint's safetensors (docs/reliability.md,
"Disputes settled by evidence").

The client holds no weights, but a dispute between two tails over the token at one position is
settled by two rows of the LM head (the two tokens'), which the client reads itself: a few KB out of
a shard, through safetensors' lazy slices, never the whole matrix. Only a checkpoint the client has
as a local folder (an alias such as ``smollm2-135m``, or a path) is read; a hub repo id is not
downloaded for this (a shard is gigabytes), so its disputes are not settled by evidence.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

logger = logging.getLogger(__name__)


class LMHeadRows:
    """Reads rows of ``lm_head.weight`` (``model.embed_tokens.weight`` for tied embeddings)."""

    def __init__(self, source: str, config: Any):
        self.folder = Path(source) if os.path.isdir(source) else None
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.keys = ["lm_head.weight", "model.embed_tokens.weight"] if not tied else ["model.embed_tokens.weight"]
        self.vocab_size = int(getattr(config, "vocab_size", 0))
        self.hidden_size = int(getattr(config, "hidden_size", 0))  # the final hidden state's width

    def rows(self, ids: Sequence[int]) -> Optional[torch.Tensor]:
        """[len(ids), hidden] float32 rows, or None where the checkpoint is not a readable local
        folder (a hub repo, a missing shard, a key under another name)."""
        if self.folder is None or not all(0 <= i < self.vocab_size for i in ids):
            return None
        from safetensors import safe_open

        for key in self.keys:
            shard = self._shard_of(key)
            if shard is None:
                continue
            try:
                with safe_open(str(shard), framework="pt") as f:
                    if key not in f.keys():
                        continue
                    matrix = f.get_slice(key)
                    return torch.stack([matrix[i : i + 1][0] for i in ids]).float()
            except Exception as e:  # an unreadable shard settles nothing; it is no verdict on anyone
                logger.info(f"Could not read {key} from {shard}: {e!r}")
                return None
        return None

    def _shard_of(self, key: str) -> Optional[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                name = json.loads(index.read_text())["weight_map"].get(key)
            except (OSError, ValueError, KeyError):
                return None
            return self.folder / name if name else None
        single = self.folder / "model.safetensors"
        return single if single.exists() else None
