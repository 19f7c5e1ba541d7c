"""What the tail drafter is trained to predict, per data shard: the target's features and choices.

Why a cache: the drafter learns from the target's final hidden states (after the final norm, what
the LM head reads: the features the tail hands its drafter) and the target's own next-token choice
at each position. Computing them is one forward pass of the target over the shard's answers, about
as long as the epoch that reads them, so each shard's are computed once and kept beside it
(``features-<chunk>/shard-NNNNN.pt``, written atomically); a resumed training run reads them back.

Each row (prompt + answer) is cut into windows of ``chunk`` positions from its end backwards, so the
answer is covered and the start of the chat template (the same system prompt in every row) is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from server.drafter_data import _atomic_write, load_shard, shard_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Windows:
    """``feats`` [N, chunk, H] float16, ``ids`` [N, chunk], ``labels`` [N, chunk]: the target's argmax
    at each position (its choice for the next id)."""

    feats: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor


def windows_of(rows: list[tuple[list[int], int]], chunk: int) -> list[list[int]]:
    out = []
    for ids, _ in rows:
        out += [ids[s : s + chunk] for s in range(len(ids) - chunk, -1, -chunk)]
    return out


@torch.inference_mode()
def target_windows(model: PreTrainedModel, windows: list[list[int]], batch: int = 8) -> Windows:
    """The target's features and choices over ``windows`` (each a fresh sequence from position 0),
    computed on the model's device and returned on the CPU (they are cached to disk)."""
    feats, labels = [], []
    ids = torch.tensor(windows, dtype=torch.long).reshape(len(windows), -1 if windows else 0)
    for i in range(0, len(windows), batch):
        hidden = model.model(input_ids=ids[i : i + batch].to(model.device)).last_hidden_state  # after the final norm
        feats.append(hidden.half().cpu())
        labels.append(model.lm_head(hidden).argmax(-1).cpu())
    hidden_size = model.config.hidden_size
    if not feats:
        return Windows(torch.zeros(0, ids.shape[1], hidden_size, dtype=torch.half), ids, ids.clone())
    return Windows(torch.cat(feats), ids, torch.cat(labels))


def shard_windows(model: PreTrainedModel, data_dir: Path, shard_file: str, chunk: int, batch: int = 8) -> Windows:
    """The shard's windows with the target's features and choices, from the cache or computed now."""
    cache = data_dir / f"features-{chunk}" / shard_file
    if cache.exists():
        saved = torch.load(cache, weights_only=True)
        return Windows(saved["feats"], saved["ids"], saved["labels"])
    windows = windows_of(shard_rows(load_shard(data_dir / shard_file)), chunk)
    out = target_windows(model, windows, batch)
    cache.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(cache, lambda f: torch.save(dict(feats=out.feats, ids=out.ids, labels=out.labels), f))
    return out
