"""Where the drafter pipeline runs (``--device`` of server.drafter_data, drafter_train, drafter_eval).

Why its own module: the data, training and evaluation stages must agree on one rule. ``auto`` takes a
GPU when torch sees one (a million tokens of the model's own answers take ~10 h on two CPU cores and
minutes on one GPU); ``cuda`` without a GPU is an error, not a silent CPU run. On a GPU, TF32 is
turned off: the tail runs float32, so the answers, features and choices the drafter learns from must
be float32's too, not those of a 10-bit-mantissa matmul.
"""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")
DATA_BATCH = {"cpu": 16, "cuda": 192}  # prompts per shard: a GPU decodes a batch-192 step about as fast as one row
TRAIN_BATCH = {"cpu": 4, "cuda": 64}  # windows per optimizer step
FEATURE_BATCH = {"cpu": 8, "cuda": 128}  # windows per target forward when caching features


def pick_device(name: str) -> torch.device:
    """``auto``: cuda when available, else cpu; ``cuda`` without a GPU: a ValueError saying so."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}: expected one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device (use --device cpu or auto)")
    if name == "cuda":
        exact_float32()
    return torch.device(name)


def exact_float32() -> None:
    """Float32 matmuls and convolutions in full precision (TF32 off), as on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def default_for(table: dict[str, int], device: torch.device) -> int:
    return table["cuda" if device.type == "cuda" else "cpu"]
