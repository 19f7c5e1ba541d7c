"""Rows of the model's LM head, read by the client from the checkpoint's safetensors (docs/reliability.md,
"Disputes settled by evidence").

The client holds no weights, but a dispute between two tails over the token at one position is
settled by two rows of the LM head (the two tokens'), which the client reads itself: a few KB out of
a shard, through safetensors' lazy slices, never the whole matrix. A log-prob needs the log-sum-exp
over the whole vocabulary: :meth:`LMHeadRows.stream` reads the head in chunks of ``CHUNK_ROWS`` rows
(bounded memory: 8k rows of SmolLM2's 576 are 19 MB in float32) and accumulates it. Only a
checkpoint the client has as a local folder (an alias such as ``smollm2-135m``, or a path) is read; a hub repo id is not
downloaded for this (a shard is gigabytes), so its disputes are not settled by evidence.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK_ROWS = 8192  # rows of the head read at a time by :meth:`LMHeadRows.stream`
# config fields that put something between h . W and the logits (a cap, a scale): where one is set,
# the rows alone do not give the logits, and the client settles nothing by them
NOT_PLAIN = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class HeadSums:
    """What streaming the whole head over final hidden states ``h`` [n, hidden] gives: ``lse`` [n], the
    log-sum-exp of h . W over the vocabulary (float64 accumulation); ``l1_max``, the largest L1 norm of
    a row; ``size_max`` [n], the largest |h| . |W[u]| (the rounding of the largest logit scales with it)."""

    lse: torch.Tensor
    l1_max: float
    size_max: torch.Tensor


class LMHeadRows:
    """Reads rows of ``lm_head.weight`` (``model.embed_tokens.weight`` for tied embeddings)."""

    def __init__(self, source: str, config: Any):
        self.folder = Path(source) if os.path.isdir(source) else None
        self.config = config  # a dispute's bisection rebuilds one block from it (client/_block_replay.py)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.keys = ["lm_head.weight", "model.embed_tokens.weight"] if not tied else ["model.embed_tokens.weight"]
        self.vocab_size = int(getattr(config, "vocab_size", 0))
        self.hidden_size = int(getattr(config, "hidden_size", 0))  # the final hidden state's width
        # whether the logits are h . W and nothing else (no cap or scale after the head)
        self.plain = not any(getattr(config, name, None) not in (None, 1, 1.0) for name in NOT_PLAIN)

    def rows(self, ids: Sequence[int]) -> Optional[torch.Tensor]:
        """[len(ids), hidden] float32 rows, or None where the checkpoint is not a readable local
        folder (a hub repo, a missing shard, a key under another name)."""
        if not all(0 <= i < self.vocab_size for i in ids):
            return None
        return self._read_head(lambda matrix: torch.stack([matrix[i : i + 1][0] for i in ids]).float(), "read")

    def stream(self, h: torch.Tensor, chunk: int = CHUNK_ROWS) -> Optional[HeadSums]:
        """:class:`HeadSums` of ``h`` [n, hidden], reading the head ``chunk`` rows at a time (never the
        whole matrix at once); None where the checkpoint is not a readable local folder."""
        h = h.float().reshape(-1, self.hidden_size)

        def sums(matrix) -> HeadSums:
            lse = torch.full((len(h),), float("-inf"), dtype=torch.float64)
            size_max, l1_max = torch.zeros(len(h)), 0.0
            for start in range(0, self.vocab_size, chunk):
                rows = matrix[start : min(start + chunk, self.vocab_size)].float()
                lse = torch.logaddexp(lse, torch.logsumexp((h @ rows.T).double(), dim=-1))
                size_max = torch.maximum(size_max, (h.abs() @ rows.abs().T).max(dim=-1).values)
                l1_max = max(l1_max, float(rows.abs().sum(dim=-1).max()))
            return HeadSums(lse, l1_max, size_max)

        return self._read_head(sums, "stream")

    def products(
        self, h: torch.Tensor, chunk: int = CHUNK_ROWS
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every logit of ``h`` [n, hidden] (a sampled token's dispute under top-k, top-p, penalties:
        client/_processed_evidence.py), read ``chunk`` rows at a time: (h . W [n, vocab], each row's L1
        norm [vocab], max over h of |h| . |W[v]| [vocab]); None where the checkpoint cannot be read."""
        h = h.float().reshape(-1, self.hidden_size)

        def read(matrix):
            logits, l1, size = [], [], []
            for start in range(0, self.vocab_size, chunk):
                rows = matrix[start : min(start + chunk, self.vocab_size)].float()
                logits.append(h @ rows.T)
                l1.append(rows.abs().sum(dim=-1))
                size.append((h.abs() @ rows.abs().T).amax(dim=0))
            return torch.cat(logits, dim=-1), torch.cat(l1), torch.cat(size)

        return self._read_head(read, "read every row of")

    def _read_head(self, read: Callable[[Any], T], what: str) -> Optional[T]:
        """``read`` over the lazy slice of the head in the first local shard that holds it; None where
        none does or it cannot be read (an unreadable shard settles nothing; it is no verdict on anyone)."""
        if self.folder is None:
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
                    return read(f.get_slice(key))
            except Exception as e:
                logger.info(f"Could not {what} {key} from {shard}: {e!r}")
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
