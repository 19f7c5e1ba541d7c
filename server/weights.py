"""Read only the tensors a server needs from a checkpoint's safetensors shards.

A volunteer serving blocks 10..19 of a 600B model must not download or read the other blocks:
the shard index tells which files hold which keys, and only those files are fetched (from the
hub, or read from a local folder in Hugging Face layout).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class Checkpoint:
    """Where a model's safetensors live: a local folder or a hub repo id."""

    source: str
    revision: str | None = None
    _weight_map: dict[str, str] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.source)

    def _fetch(self, filename: str) -> str:
        if self.is_local:
            return str(Path(self.source) / filename)
        from huggingface_hub import hf_hub_download

        return hf_hub_download(self.source, filename, revision=self.revision)

    def weight_map(self) -> dict[str, str]:
        """key -> shard file name, from the index (or the single file's own keys)."""
        if not self._weight_map:
            try:
                with open(self._fetch(INDEX_FILE)) as f:
                    self._weight_map = json.load(f)["weight_map"]
            except (FileNotFoundError, OSError, KeyError):
                with safe_open(self._fetch(SINGLE_FILE), framework="pt") as f:
                    self._weight_map = {key: SINGLE_FILE for key in f.keys()}
        return self._weight_map

    def read(
        self, keys: Iterable[str], dtype: torch.dtype, desc: str = "Loading", progress: bool = True
    ) -> dict[str, torch.Tensor]:
        """Read ``keys`` (and nothing else), opening each needed shard once, with a progress bar."""
        return dict(self.iter_read(keys, dtype, desc, progress))

    def iter_read(
        self, keys: Iterable[str], dtype: torch.dtype, desc: str = "Loading", progress: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Like :meth:`read`, one tensor at a time: a caller that quantizes each tensor as it
        arrives never holds more than one of them in float."""
        weight_map = self.weight_map()
        by_file: dict[str, list[str]] = {}
        for key in keys:
            if key not in weight_map:
                raise KeyError(f"checkpoint {self.source} has no tensor {key!r}")
            by_file.setdefault(weight_map[key], []).append(key)
        with tqdm(total=sum(map(len, by_file.values())), desc=desc, unit="tensor", disable=not progress) as bar:
            for filename, file_keys in by_file.items():
                with safe_open(self._fetch(filename), framework="pt") as f:
                    for key in file_keys:
                        tensor = f.get_tensor(key)
                        yield key, tensor.to(dtype) if tensor.is_floating_point() else tensor
                        bar.update(1)
