"""Polling for a condition that another process or thread makes true, with a deadline."""

from __future__ import annotations

import asyncio
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


async def until(predicate: Callable[[], object], timeout: float = 30.0, every: float = 0.02) -> None:
    """``wait_until`` for a coroutine on the loop that must make ``predicate`` true (in-process servers
    share the client's loop, so a blocking wait would stall them): asked every ``every`` seconds."""
    for _ in range(int(timeout / every)):
        if predicate():
            return
        await asyncio.sleep(every)
    raise AssertionError("the condition never held")
