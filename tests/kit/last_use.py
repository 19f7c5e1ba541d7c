"""Stopping a shared swarm right after the last test that uses it (tests/conftest.py's hook calls
``last_use.after`` once per test)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import pytest


class LastUse:
    """Stops a shared swarm right after the last test (in run order) that uses it, instead of at
    the end of its scope. An idle server still announces itself and keeps its DHT and libp2p
    daemon alive (about 4% of a core each); the 20 or so that would otherwise idle until the session
    or module ends made the tests beside them run up to twice as slow on 2 cores. "Uses" means
    names it, directly or through another fixture (``item.fixturenames``): a test must not reach a
    swarm through ``request.getfixturevalue``, which this cannot see."""

    def __init__(self) -> None:
        self._closers: list[tuple[str, Callable[[], None]]] = []  # in set-up order, closed in reverse
        self._last_user: Optional[dict[str, str]] = None  # fixture name -> node id of its last test

    @contextlib.contextmanager
    def until_last_use(self, request: pytest.FixtureRequest, close: Callable[[], None]) -> Iterator[None]:
        """Inside a yield fixture: ``close`` runs after the fixture's last test, or when it ends."""
        done = []

        def once() -> None:
            if not done:
                done.append(True)
                close()

        entry = (request.fixturename, once)
        self._closers.append(entry)
        try:
            yield
        finally:
            self._closers.remove(entry)
            once()

    def after(self, item: pytest.Item) -> None:
        if self._last_user is None:
            self._last_user = {}
            for each in item.session.items:
                for name in getattr(each, "fixturenames", ()):
                    self._last_user[name] = each.nodeid
        for name, close in reversed(list(self._closers)):
            if self._last_user.get(name) == item.nodeid:
                close()


last_use = LastUse()
