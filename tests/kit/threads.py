"""Torch's thread count for a test's own compute."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def single_torch_thread():
    """One torch thread while inside: the machine's cores are shared, and tiny matmuls on two
    threads spin-wait each other (seen 50x slower on a loaded 2-core machine)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
