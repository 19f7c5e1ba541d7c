"""Route planners that pin a test's routes by the servers' public names, so a test chooses exactly
which split of the model it exercises (the real router is tested on its own)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Sequence

from protocol.messages import Hop
from protocol.route_errors import NoRouteError
from protocol.routing import RoutePlanner
from tests.kit.swarms import servers_by_name

# Routes over the tiny swarm's servers (tests.kit.swarms.TINY_SERVERS): name, first block, end block
ROUTES = {
    "two servers": [("A", 0, 3), ("B", 3, 6)],
    "three servers, uneven": [("C", 0, 1), ("D", 1, 4), ("B", 4, 6)],
    "overlapping spans": [("A", 0, 3), ("E", 3, 6)],
    "overlap, sub-ranges": [("C", 0, 1), ("D", 1, 2), ("E", 2, 6)],
}


class PinnedRoute(RoutePlanner):
    """Always returns the same route, named by the servers' public names."""

    def __init__(self, model, hops: Sequence[tuple[str, int, int]]):
        by_name = servers_by_name(model, model.config.num_hidden_layers)
        self.route = [Hop(by_name[name].peer_id, start, end) for name, start, end in hops]

    def plan(self, servers, start, end, *, max_length=0, exclude=(), client_rtts=None) -> list[Hop]:
        return list(self.route)


@contextlib.contextmanager
def pinned(model, hops: Sequence[tuple[str, int, int]]) -> Iterator[None]:
    """Inside: ``model`` routes every session over ``hops``; its own router again after."""
    saved = model.swarm.router
    model.swarm.router = PinnedRoute(model, hops)
    try:
        yield
    finally:
        model.swarm.router = saved


class PreferredRoutes(RoutePlanner):
    """The first of the given routes (servers by public name) that avoids every excluded peer:
    failover is then to a route the test chose."""

    def __init__(self, *routes: Sequence[tuple[str, int, int]]):
        self.routes = routes

    def plan(self, servers, start, end, *, max_length=0, exclude=(), client_rtts=None) -> list[Hop]:
        by_name = {s.public_name: s.peer_id for s in servers if getattr(s, "state", "online") != "online"}
        by_name.update({s.public_name: s.peer_id for s in servers if getattr(s, "state", "online") == "online"})
        for route in self.routes:
            hops = [Hop(by_name[name], a, b) for name, a, b in route]
            if not any(hop.peer_id in exclude for hop in hops):
                return hops
        raise NoRouteError("every preferred route holds an excluded server", [])


@contextlib.contextmanager
def routed_client(swarm, path, *routes, hidden=(), **kwargs):
    """A client of ``swarm`` routed by ``routes`` (servers by name, first preferred) that never sees the
    servers in ``hidden`` (excluded by peer id); it waits until every named server is online, and names
    the peer ids in ``model.peers``. Exclusions last an hour: a test decides who comes back."""
    from client._swarm import ExclusionList
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers, **kwargs)
    try:
        blocks = model.config.num_hidden_layers
        names = {name for r in routes for name, _, _ in r} | set(hidden)
        deadline = time.monotonic() + 120
        while not all(getattr(servers_by_name(model, blocks).get(n), "state", None) == "online" for n in names):
            assert time.monotonic() < deadline, f"not all of {sorted(names)} came online"
            time.sleep(0.5)
        model.swarm.router = PreferredRoutes(*routes)
        model.peers = {name: info.peer_id for name, info in servers_by_name(model, blocks).items()}
        model.swarm.excluded = ExclusionList(base_seconds=3600)
        for name in hidden:
            model.swarm.excluded.add(model.peers[name])
        yield model
    finally:
        model.shutdown()
