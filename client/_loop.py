"""The client's background event loop: the public API is synchronous (as in transformers),
while everything that talks to peers is asyncio. One daemon thread per process runs the loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Optional, TypeVar

T = TypeVar("T")

_loop: Optional[asyncio.AbstractEventLoop] = None
_lock = threading.Lock()


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="specswarm-client", daemon=True).start()
        return _loop


def run(coro: Awaitable[T], timeout: Optional[float] = None) -> T:
    """Run ``coro`` on the client loop and wait for it from synchronous code."""
    future = asyncio.run_coroutine_threadsafe(coro, get_loop())
    try:
        return future.result(timeout)
    except BaseException:
        future.cancel()
        raise
