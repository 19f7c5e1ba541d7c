"""Fault injection for tests: a server that lies about its activations (``--debug-corrupt``).

``corrupt_outputs(span, mode)`` wraps the span's ``forward`` so that what it returns, the
activations a middle server sends on and the final hidden states a tail feeds its LM head (and its
tail drafter), is wrong: ``noise`` adds Gaussian noise of ``NOISE_SCALE`` times the activations'
standard deviation, drawn afresh for every run; ``offset`` adds ``OFFSET`` to every value, the same
on every run. Everything else (ids, caches' shapes, verdict format) stays honest, so only a
comparison of outputs (client/_spot_checks.py, docs/reliability.md "Spot-checks") can catch it.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

CORRUPTIONS = ("noise", "offset")
NOISE_SCALE = 0.05  # x the std of the activations of the run
OFFSET = 0.5  # added to every value (the tiny test model's activations have a std of 4-9 between blocks)


def corrupt(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "noise":
        return hidden + torch.randn_like(hidden) * (NOISE_SCALE * hidden.float().std().item())
    if mode == "offset":
        return hidden + OFFSET
    raise ValueError(f"--debug-corrupt must be one of {CORRUPTIONS}, got {mode!r}")


def corrupt_outputs(span, mode: str) -> None:
    """Make ``span.forward`` return corrupted activations from now on (in place)."""
    if mode not in CORRUPTIONS:
        raise ValueError(f"--debug-corrupt must be one of {CORRUPTIONS}, got {mode!r}")
    forward = span.forward

    @functools.wraps(forward)
    def lying_forward(*args, **kwargs):
        return corrupt(forward(*args, **kwargs), mode)

    span.forward = lying_forward
    logger.warning(f"Fault injection: this server corrupts its outputs ({mode})")
