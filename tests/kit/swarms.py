"""Swarms for tests: the tiny model's server layout, servers running in the test's own process,
and the servers a client sees by public name.

The session-scoped fixtures that start real server processes live in tests/conftest.py and are
built from these.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from protocol.dht import make_dht
from protocol.dht_records import fetch_servers
from protocol.records import ServerInfo

SERVER_ARGS = ["--torch-threads", "1", "--update-period", "5", "--log-level", "INFO"]
# the session's SmolLM2 swarm announces every 2 s (records live 6 s), as the in-process swarms do: tests that
# watch its records change (a session held, then released) see each change within 2 s, not 5
SMOL_SERVER_ARGS = ["--torch-threads", "1", "--update-period", "2", "--log-level", "INFO"]

# name -> blocks of the tiny 6-block model; routes in the tests are pinned over these
TINY_SERVERS = {"A": (0, 3), "B": (3, 6), "C": (0, 1), "D": (1, 4), "E": (2, 6)}

LIMITS_MAX_POSITIONS = 16  # positions per Step on the limits swarm: prompts above it are chunked


def servers_by_name(model, num_blocks: int) -> dict[str, ServerInfo]:
    """The records ``model``'s client reads from the DHT, by the servers' public names. A name a stopped
    server held earlier in the module (its record not yet expired) yields to an online server's."""
    infos = fetch_servers(model.swarm.dht, model.swarm.model, num_blocks)
    by_name: dict[str, ServerInfo] = {}
    for info in infos:
        if info.public_name not in by_name or getattr(info, "state", None) == "online":
            by_name[info.public_name] = info
    return by_name


@dataclass
class InProcessSwarm:
    """Servers running in the test's process (so a test reaches into their handlers, sessions and
    caches), a bootstrap DHT they joined, and a client model connected to them."""

    model: Any
    servers: list
    peers: list[str]
    stop: Callable[[], None]  # the client, then every server, then the bootstrap


def start_inprocess(
    path, spans=((0, 3), (3, 6)), client_options: Optional[dict] = None, **config: Any
) -> InProcessSwarm:
    """Servers of ``spans`` of the checkpoint at ``path`` on 127.0.0.1, joined through a real DHT.
    ``config``: more ServerConfig fields for every server; ``client_options``: more keywords for
    the client's ``from_pretrained``."""
    from client import _loop
    from server.span_server import ServerConfig, SpanServer
    from swarm import AutoDistributedModelForCausalLM

    bootstrap = make_dht(host="127.0.0.1")
    peers = [str(m) for m in bootstrap.get_visible_maddrs()]

    async def start():
        common = dict(
            model=str(path),
            initial_peers=peers,
            host="127.0.0.1",
            reachability="public",
            update_period=2.0,
            torch_threads=1,
            **config,
        )
        return [await SpanServer.create(ServerConfig(blocks=blocks, **common)) for blocks in spans]

    servers = _loop.run(start(), timeout=240)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=peers, **(client_options or {}))

    def stop() -> None:
        model.shutdown()
        for server in servers:
            _loop.run(server.shutdown(), timeout=60)
        bootstrap.shutdown()

    return InProcessSwarm(model, servers, peers, stop)


def inprocess_servers(path, spans=((0, 3), (3, 6)), **config: Any) -> Iterator[tuple[Any, list]]:
    """A generator for module fixtures (``yield from``): yields (model, servers) of
    ``start_inprocess`` and stops everything after."""
    swarm = start_inprocess(path, spans, **config)
    yield swarm.model, swarm.servers
    swarm.stop()


def wait_until_no_sessions(servers, timeout: float = 20.0) -> None:
    """Waits until no in-process server holds a session, then checks every cache token came back."""
    from client import _loop

    async def wait():
        for _ in range(int(timeout / 0.05)):
            if all(not s.handler.sessions for s in servers):
                return True
            await asyncio.sleep(0.05)
        return False

    assert _loop.run(wait(), timeout=timeout + 10), [list(s.handler.sessions) for s in servers]
    for s in servers:
        assert s.handler.budget.free_tokens == s.handler.budget.total_tokens


def tail_drafter_swarm(request, model_path, drafter_path, log_dir) -> Iterator:
    """A client over two servers of the tiny model (0:3, 3:6) whose tail drafts with the head at
    ``drafter_path`` (``--drafter``: the committed EAGLE layout or a published EAGLE-3 one); for a
    session fixture to ``yield from``, stopped after the fixture's last use."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.local import LocalSwarm
    from tests.kit.last_use import last_use

    args = [*SERVER_ARGS, "--drafter", str(drafter_path), "--drafter-tokens", "4"]
    with LocalSwarm(str(model_path), spans=[(0, 3), (3, 6)], server_args=args, log_dir=str(log_dir)) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(str(model_path), initial_peers=swarm.initial_peers)
        with last_use.until_last_use(request, lambda: (model.shutdown(), swarm.stop())):
            yield model
