"""Small pieces every command-line entry point shares: logging and signal-driven shutdown."""

from __future__ import annotations

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
