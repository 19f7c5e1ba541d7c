"""Small pieces every command-line entry point shares: logging and signal-driven shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys


def setup_logging(level: str = "INFO") -> None:
    """Logs go to stderr so stdout stays machine-readable (addresses, results)."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, so the caller can shut down in an orderly way."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def parse_blocks(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--blocks takes START:END (end exclusive), got {text!r}") from None
    return start, end


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
}


def parse_size(text: str) -> int:
    """``22GiB``, ``24GB``, ``512MiB``, ``1.5G`` (binary), or bytes -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 22GiB, 24GB or 512MiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
