"""A LoRA adapter for one call (docs/fine_tuning.md, "LoRA adapters"): ``generate(..., active_adapter=...)``,
``forward(..., active_adapter=...)``, ``agenerate_stream(..., active_adapter=...)`` and
``inference_session(active_adapter=...)`` override the model's adapter (``from_pretrained(active_adapter=)``)
for what that call sends; ``""`` asks for the base model.

Why a context variable and not an argument threaded through every layer: what applies the adapter is read
in many places (routing, every session opened, failover replays, spot-checks and verdict audits, training
rows), all as ``SwarmClient.active_adapter``. The client runs a call's coroutines on its loop with
``run_coroutine_threadsafe``, which copies the caller's context into the task, and every task that task
starts copies it again, so setting the variable around the call reaches all of them, and calls running at
once (``agenerate_stream`` on one model) each see their own.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional, TypeVar

CALL_ADAPTER: ContextVar[Optional[str]] = ContextVar("specswarm_call_adapter", default=None)
MAX_ADAPTER_NAME = 256  # characters: what a record may announce (protocol/records.py names)

F = TypeVar("F", bound=Callable[..., Any])


def checked_adapter(adapter: Optional[str]) -> Optional[str]:
    """``active_adapter`` as given to a call, checked: None (the model's), "" (none) or a name."""
    if adapter is not None and (not isinstance(adapter, str) or len(adapter) > MAX_ADAPTER_NAME):
        raise ValueError(f"active_adapter must be an adapter's name (a str of at most {MAX_ADAPTER_NAME} characters)")
    return adapter


def current(default: str) -> str:
    """The adapter of the call running now, else ``default`` (the model's)."""
    adapter = CALL_ADAPTER.get()
    return default if adapter is None else adapter


@contextlib.contextmanager
def call_adapter(adapter: Optional[str]) -> Iterator[None]:
    """While the block runs (in this thread's context), the calls it makes use ``adapter`` (None: no change)."""
    if checked_adapter(adapter) is None:
        yield
        return
    token = CALL_ADAPTER.set(adapter)
    try:
        yield
    finally:
        CALL_ADAPTER.reset(token)


def per_call_adapter(method: F) -> F:
    """A synchronous model method that takes ``active_adapter=`` (removed before the method sees it). Inside
    an inference session opened with another adapter it is a ValueError: the servers' caches of that session
    were computed with the session's adapter."""

    @functools.wraps(method)
    def wrapper(self, *args: Any, active_adapter: Optional[str] = None, **kwargs: Any) -> Any:
        session = getattr(self, "_session", None)
        opened = getattr(session, "adapter", None)
        if active_adapter is not None and session is not None and checked_adapter(active_adapter) != opened:
            raise ValueError(
                f"active_adapter={active_adapter!r} inside an inference session opened with "
                f"active_adapter={opened!r}: open another session for another adapter"
            )
        with call_adapter(active_adapter):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


async def with_adapter(adapter: Optional[str], work: Callable[[], Any]) -> Any:
    """``await work()`` in this task with ``adapter`` for the call (for work started in another context)."""
    with call_adapter(adapter):
        return await work()
