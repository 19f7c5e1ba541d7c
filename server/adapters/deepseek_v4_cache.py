"""DeepSeek-V4 cache layers that can be trimmed to any recent position, exactly.

transformers' V4 caches (``DeepseekV4HCACache``, ``DeepseekV4CSACache`` and the plain
``DynamicSlidingWindowLayer``) only move forward: the sliding window keeps the last
``sliding_window - 1`` keys, and each compressor keeps a buffer of the current partial window,
the compressed entries emitted so far and (CSA) the previous window's overlap slice. None of it
can be cropped once a draft is rejected. These subclasses run the very same transformers code
(the attention and compressors call the same methods) and remember a little more, so that
``trim(length)`` leaves every layer exactly as if positions >= length had never been computed:

* sliding window: the last ``sliding_window - 1 + max_rollback`` keys (K = V in V4), of which
  an update shows the attention only the last ``sliding_window - 1`` (what transformers shows);
* each compressor (``"compressor"``, and ``"indexer"`` on CSA layers): the raw per-position
  ``(kv, gate)`` projections of the last ``max_rollback + compress_rate`` positions, and (CSA)
  the overlap slice of every window that a trim could make the last complete one again.

A compressed entry depends only on the positions of its own window (and the previous window's
overlap slice), so trimming to ``length`` keeps ``length // rate`` entries, rebuilds the partial
window buffer from the raw projections of positions ``[n * rate, length)``, and restores the
overlap slice of window ``n - 1``. A rollback deeper than ``max_rollback`` positions is refused
with a clear error before anything is changed.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

from protocol.errors import ErrorCode, ProtocolError


class RollbackTooDeep(ProtocolError):
    """A trim asked for state this server no longer keeps (more than max_rollback back)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.BAD_REQUEST, message)


class _SlidingHistory:
    """Sliding-window K(=V) cache that keeps ``max_rollback`` extra positions for trims."""

    _layer_type = None  # never register these classes in transformers' layer-type mapping
    sliding_window: int
    cumulative_length: int
    max_rollback: int
    history: Optional[torch.Tensor]  # [B, 1, T, head_dim], the last T positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.history = key_states[:, :, :0]
        held = self.history.shape[-2]
        visible = min(self.sliding_window - 1, held)  # what transformers' own layer would hold
        full = torch.cat([self.history[:, :, held - visible :], key_states], dim=-2)
        history = torch.cat([self.history, key_states], dim=-2)
        keep = self.sliding_window - 1 + self.max_rollback
        self.history = history[:, :, max(0, history.shape[-2] - keep) :]
        self.keys = self.values = self.history
        self.cumulative_length += key_states.shape[-2]
        return full, full

    def check_trim(self, length: int) -> None:
        drop = self.cumulative_length - length
        if drop <= 0 or not self.is_initialized:
            return
        left = self.history.shape[-2] - drop
        if left < min(self.sliding_window - 1, length):
            raise RollbackTooDeep(
                f"cannot roll back from {self.cumulative_length} to {length} positions: this server keeps "
                f"{self.max_rollback} positions of rollback history beyond the sliding window"
            )

    def trim(self, length: int) -> None:
        drop = self.cumulative_length - length
        if drop <= 0 or not self.is_initialized:
            return
        self.history = self.history[:, :, : self.history.shape[-2] - drop]
        self.keys = self.values = self.history
        self.cumulative_length = length


class _CompressorHistory(_SlidingHistory):
    """Adds per-compressor raw projections (and CSA overlap slices) to the sliding history."""

    compress_rate: int
    buffer_kv: dict
    buffer_gate: dict
    compressed_kv: dict
    entry_count: dict

    def _init_history(self, max_rollback: int) -> None:
        self.max_rollback = max_rollback
        self.history = None
        names = list(self.compressed_kv)
        self._raw: dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]] = dict.fromkeys(names)
        self._raw_end: dict[str, int] = dict.fromkeys(names, 0)  # positions seen by this compressor
        self._first_window: dict[str, int] = dict.fromkeys(names, 0)
        self._overlaps: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {name: {} for name in names}

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        old = self._raw[name]
        kv_all = kv if old is None else torch.cat([old[0], kv], dim=1)  # [B, T, D]
        gate_all = gate if old is None else torch.cat([old[1], gate], dim=1)
        keep = self.max_rollback + self.compress_rate
        self._raw[name] = (kv_all[:, -keep:], gate_all[:, -keep:])
        self._raw_end[name] += kv.shape[1]
        self._first_window[name] = self.entry_count[name]  # index of the first window this call may close
        return super().store_compression_weights(name, kv, gate)

    def _oldest_needed_window(self, name: str) -> int:
        """The earliest window whose overlap slice a trim of up to max_rollback may restore."""
        return max(0, (self._raw_end[name] - self.max_rollback) // self.compress_rate - 1)

    def check_trim(self, length: int) -> None:
        super().check_trim(length)
        for name, raw in self._raw.items():
            if raw is None or length >= self._raw_end[name]:
                continue
            windows = length // self.compress_rate
            raw_start = self._raw_end[name] - raw[0].shape[1]
            lost_overlap = self._needs_overlap and windows and windows - 1 not in self._overlaps[name]
            if windows * self.compress_rate < raw_start or lost_overlap:
                raise RollbackTooDeep(
                    f"cannot roll back the {name} of a compressed-attention layer from {self._raw_end[name]} to "
                    f"{length} positions: this server keeps {self.max_rollback} positions of rollback history"
                )

    def trim(self, length: int) -> None:
        super().trim(length)
        for name, raw in self._raw.items():
            if raw is None or length >= self._raw_end[name]:
                continue
            windows = length // self.compress_rate
            raw_start = self._raw_end[name] - raw[0].shape[1]
            kv, gate = raw[0][:, : length - raw_start], raw[1][:, : length - raw_start]
            self._raw[name], self._raw_end[name] = (kv, gate), length
            begin = windows * self.compress_rate - raw_start
            self.buffer_kv[name], self.buffer_gate[name] = kv[:, begin:], gate[:, begin:]
            if self.compressed_kv[name] is not None:
                self.compressed_kv[name] = self.compressed_kv[name][:, :windows]
            self.entry_count[name] = windows
            self._trim_overlap(name, windows)

    _needs_overlap = False

    def _trim_overlap(self, name: str, windows: int) -> None:
        pass


class RewindableSlidingLayer(_SlidingHistory, DynamicSlidingWindowLayer):
    """``sliding_attention`` layers."""

    def __init__(self, sliding_window: int, max_rollback: int):
        super().__init__(sliding_window=sliding_window)
        self.max_rollback = max_rollback
        self.history = None


class RewindableHCALayer(_CompressorHistory, DeepseekV4HCACache):
    """``heavily_compressed_attention`` layers: sliding window + one non-overlapping compressor."""

    def __init__(self, config: PretrainedConfig, max_rollback: int):
        super().__init__(config)
        self._init_history(max_rollback)


class RewindableCSALayer(_CompressorHistory, DeepseekV4CSACache):
    """``compressed_sparse_attention`` layers: sliding window + overlapping compressor + indexer."""

    _needs_overlap = True

    def __init__(self, config: PretrainedConfig, max_rollback: int):
        super().__init__(config)
        self._init_history(max_rollback)

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        # chunk_*: [B, n_windows, rate, 2 * head_dim]; window i of this call is window first + i overall
        first, oldest = self._first_window[name], self._oldest_needed_window(name)
        for i in range(max(0, oldest - first), chunk_kv.shape[1]):
            self._overlaps[name][first + i] = (
                chunk_kv[:, i, :, :head_dim].clone(),
                chunk_gate[:, i, :, :head_dim].clone(),
            )
        for window in [w for w in self._overlaps[name] if w < oldest]:
            del self._overlaps[name][window]
        return super().update_overlap_state(name, chunk_kv, chunk_gate, head_dim)

    def _trim_overlap(self, name: str, windows: int) -> None:
        for window in [w for w in self._overlaps[name] if w >= windows]:
            del self._overlaps[name][window]
        self.overlap_kv[name], self.overlap_gate[name] = self._overlaps[name][windows - 1] if windows else (None, None)


LAYER_CLASSES = {
    "heavily_compressed_attention": RewindableHCALayer,
    "compressed_sparse_attention": RewindableCSALayer,
}


def new_span_cache(config: PretrainedConfig, layer_types: list[str], max_rollback: int) -> Cache:
    """A transformers ``Cache`` holding one rewindable layer per block of the span, in order."""
    layers = []
    for layer_type in layer_types:
        if layer_type == "sliding_attention":
            layers.append(RewindableSlidingLayer(config.sliding_window, max_rollback))
        else:
            layers.append(LAYER_CLASSES[layer_type](config, max_rollback))
    return Cache(layers=layers)


def cache_length(cache: Cache) -> int:
    return max((layer.cumulative_length for layer in cache.layers), default=0)


def trim_cache(cache: Cache, length: int) -> None:
    """Check every layer first, so a refused trim changes nothing."""
    for layer in cache.layers:
        layer.check_trim(length)
    for layer in cache.layers:
        layer.trim(length)
