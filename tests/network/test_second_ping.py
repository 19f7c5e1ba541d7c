"""A failure nobody can be blamed for is checked by pinging the route's hops (``SwarmClient.blame``:
failover, a training step's route, a shadow that cannot open). A hop that misses one 3-s ping but
answers a second (``SECOND_PING``) is a loaded machine, not a dead one: a suspect, never excluded;
one silent twice is excluded (docs/reliability.md, "Verdicts and subscriptions")."""

from __future__ import annotations

import asyncio

from client import _swarm
from client.errors import ServerError
from protocol.errors import ErrorCode
from protocol.messages import Hop

ROUTE = [Hop("H", 0, 2), Hop("M", 2, 4), Hop("T", 4, 6)]


def blame_with(monkeypatch, answers: list[dict]) -> tuple[_swarm.SwarmClient, list[str], list]:
    """``blame`` a silent timeout on ROUTE, the pings answered from ``answers`` (one dict a call)."""
    calls = []

    async def ping_many(p2p, peers, timeout):
        calls.append((list(peers), timeout))
        return {p: answers[len(calls) - 1].get(p, 0.01) for p in peers}

    monkeypatch.setattr(_swarm, "ping_many", ping_many)
    swarm = _swarm.SwarmClient(None, None, "m", 6)
    dead = asyncio.run(swarm.blame(ROUTE, ServerError("no verdict in 60 s", "", ErrorCode.DOWNSTREAM_FAILED)))
    return swarm, dead, calls


def test_a_hop_silent_to_one_ping_but_not_two_is_a_suspect_not_excluded(monkeypatch):
    swarm, dead, calls = blame_with(monkeypatch, [{"T": None}, {"T": 0.02}])
    assert dead == [] and not swarm.excluded.current()
    assert calls == [(["H", "M", "T"], 3.0), (["T"], _swarm.SECOND_PING)]
    assert swarm.suspects.current() == {"H", "M", "T"}  # nobody to blame: the route is avoided a while


def test_a_hop_silent_twice_is_excluded(monkeypatch):
    swarm, dead, calls = blame_with(monkeypatch, [{"T": None}, {"T": None}])
    assert dead == ["T"] and swarm.excluded.current() == {"T"}
    assert len(calls) == 2 and not swarm.suspects.current()
