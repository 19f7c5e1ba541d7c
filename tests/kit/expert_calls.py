"""Counting calls of each decoder layer's MLP (the experts, in a mixture of experts) of a span:
how a test tells a batched pass that computes its members' experts together (one call per block
for all of them) from one that runs its members one after another (one call per block each)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


@contextlib.contextmanager
def mlp_calls(span) -> Iterator[list[list[int]]]:
    """Within the block: for each layer of ``span``, the number of rows of every call of its
    ``mlp`` (appended as calls happen, from whatever thread computes); the hooks leave on exit."""
    calls: list[list[int]] = [[] for _ in span.layers]
    lock = threading.Lock()

    def hook(index: int):
        def record(module, args) -> None:
            rows = args[0].shape[:-1].numel()
            with lock:
                calls[index].append(rows)

        return record

    handles = [layer.mlp.register_forward_pre_hook(hook(i)) for i, layer in enumerate(span.layers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
