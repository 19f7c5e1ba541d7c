"""Polling for a condition that another process or thread makes true, with a deadline."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, timeout: float = 120.0, every: float = 0.5) -> T:
    """The first truthy value of ``condition()``, asked every ``every`` seconds; an AssertionError
    naming ``what`` once ``timeout`` seconds pass without one. The condition is asked at least
    once, and once more after the deadline, so a slow machine's last chance is not lost to sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for: {what}")
        time.sleep(every)
