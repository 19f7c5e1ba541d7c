"""The client's background event loop and the bridge to it.

The public API is synchronous (as in transformers), while everything that talks to peers is
asyncio. One daemon thread per process runs the loop, so the swarm's connections live on one loop
whoever calls: synchronous code waits with :func:`run`, a caller on another event loop (e.g. the
OpenAI gateway's) awaits with :func:`arun` or reads a :class:`Relay`, and :func:`all_or_none` runs
a batch's sessions together so that one failing closes the others.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Generic, Optional, Sequence, TypeVar

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


async def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the client loop and await it from any other event loop; cancelling the
    awaiting task cancels ``coro`` too."""
    future = asyncio.run_coroutine_threadsafe(coro, get_loop())
    try:
        return await asyncio.wrap_future(future)
    finally:
        future.cancel()  # a no-op once done


async def all_or_none(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Run coroutines concurrently; if one fails (or the caller gives up), cancel the others and
    wait for them (each closes its own session) before raising."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Relay(Generic[T]):
    """Items that work on the client loop posts, read on the caller's own event loop.

    Made on the caller's loop; the work calls :meth:`post` from the client loop (e.g. a decoder's
    ``on_tokens``), and :meth:`stream` yields the items as they come. The work always ends by
    running its cleanup (closing its session), and the stream ends only after that, also when the
    reader stops early (``aclose()``, or its task is cancelled): the work is then cancelled."""

    def __init__(self) -> None:
        self._caller = asyncio.get_running_loop()
        self._items: asyncio.Queue[Optional[T]] = asyncio.Queue()
        self._task: Optional[asyncio.Task] = None
        self._cancelled = False
        self._error: Optional[Exception] = None

    def post(self, item: T) -> None:
        """Hand ``item`` to the reader (called on the client loop)."""
        self._caller.call_soon_threadsafe(self._items.put_nowait, item)

    async def stream(
        self, work: Callable[[], Awaitable[Any]], cleanup: Callable[[], Awaitable[None]]
    ) -> AsyncIterator[T]:
        """Start ``work()`` on the client loop and yield what it posts; raise what it raised."""
        asyncio.run_coroutine_threadsafe(self._run(work, cleanup), get_loop())
        ended = False
        try:
            while (item := await self._items.get()) is not None:
                yield item
            ended = True
            if self._error is not None:
                raise self._error
        finally:
            if not ended:
                get_loop().call_soon_threadsafe(self._cancel)
                while await self._items.get() is not None:  # the cleanup has run once None arrives
                    pass

    async def _run(self, work: Callable[[], Awaitable[Any]], cleanup: Callable[[], Awaitable[None]]) -> None:
        """Runs on the client loop; always ends by posting None."""
        self._task = asyncio.current_task()
        try:
            if not self._cancelled:
                await work()
        except Exception as e:
            self._error = e
        finally:
            try:
                await cleanup()
            finally:
                self._caller.call_soon_threadsafe(self._items.put_nowait, None)

    def _cancel(self) -> None:
        """Runs on the client loop, so it cannot race :meth:`_run`'s first line."""
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()
