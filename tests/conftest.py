"""Session-scoped swarms of real server processes on 127.0.0.1, shared by the tests that need them.

Every server is a ``python -m swarm.server`` process joined through a real hivemind DHT; the
fixtures stop them (SIGTERM, then SIGKILL) after the last test that uses them (``until_last_use``)
or, at the latest, when their scope ends.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import pytest
import torch

from protocol.dht import make_dht
from protocol.dht_records import fetch_servers
from protocol.messages import Hop
from protocol.records import ServerInfo
from protocol.routing import RoutePlanner
from swarm import lifeline, warm_start
from swarm.local import LocalSwarm
from tests.checkpoints import build_tiny_llama

lifeline.install_fork_hook()  # the DHT processes (and p2pd) of pytest's clients die with it, even on SIGKILL
# The suite's swarms also run quantized and DeepSeek-V4 servers (4-5 s of imports each on 2 cores):
# the forkserver that every LocalSwarm forks from imports those once too (swarm/warm_start.py).
warm_start.PRELOAD += ["bitsandbytes", "server.adapters.deepseek_v4", "server.int8_weight"]

SERVER_ARGS = ["--torch-threads", "1", "--update-period", "5", "--log-level", "INFO"]

# name -> blocks of the tiny 6-block model; routes in the tests are pinned over these
TINY_SERVERS = {"A": (0, 3), "B": (3, 6), "C": (0, 1), "D": (1, 4), "E": (2, 6)}


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]):
    yield
    last_use.after(item)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = Path(__file__).resolve().parent.parent / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_swarm(request, tiny_llama_path, artifacts_dir):
    swarm = LocalSwarm(
        str(tiny_llama_path),
        spans=list(TINY_SERVERS.values()),
        server_args=SERVER_ARGS,
        log_dir=str(artifacts_dir / "tiny-swarm"),
        names=list(TINY_SERVERS),
    )
    with swarm, last_use.until_last_use(request, swarm.stop):
        yield swarm


@pytest.fixture(scope="session")
def tiny_model(request, tiny_swarm, tiny_llama_path):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=tiny_swarm.initial_peers
    )
    with last_use.until_last_use(request, model.shutdown):
        yield model


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype="float32").eval()


@pytest.fixture(scope="session")
def smol_swarm(request, artifacts_dir):
    with LocalSwarm("smollm2-135m", 3, server_args=SERVER_ARGS, log_dir=str(artifacts_dir / "smol-swarm")) as swarm:
        with last_use.until_last_use(request, swarm.stop):
            yield swarm


@pytest.fixture(scope="session")
def smol_model(request, smol_swarm):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=smol_swarm.initial_peers)
    with last_use.until_last_use(request, model.shutdown):
        yield model


@pytest.fixture(scope="session")
def smol_reference():
    from transformers import AutoModelForCausalLM

    from protocol.models import ensure_smollm2_checkpoint

    return AutoModelForCausalLM.from_pretrained(ensure_smollm2_checkpoint(), dtype="float32").eval()


@contextlib.contextmanager
def single_torch_thread():
    """One torch thread while inside: the machine's cores are shared, and tiny matmuls on two
    threads spin-wait each other (seen 50x slower on a loaded 2-core machine)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def servers_by_name(model, num_blocks: int) -> dict[str, ServerInfo]:
    infos = fetch_servers(model.swarm.dht, model.swarm.model, num_blocks)
    return {info.public_name: info for info in infos}


class PinnedRoute(RoutePlanner):
    """Always returns the same route, named by the servers' public names: lets a test choose
    exactly which split of the model it exercises (the real router is tested on its own)."""

    def __init__(self, model, hops: Sequence[tuple[str, int, int]]):
        by_name = servers_by_name(model, model.config.num_hidden_layers)
        self.route = [Hop(by_name[name].peer_id, start, end) for name, start, end in hops]

    def plan(self, servers, start, end, *, max_length=0, exclude=(), client_rtts=None) -> list[Hop]:
        return list(self.route)


# ---- an in-process swarm with small wire limits (tests/test_hostile_wire.py, tests/test_fuzz.py) ----

LIMITS_MAX_POSITIONS = 16  # positions per Step on the limits swarm: prompts above it are chunked


@pytest.fixture(scope="session")
def limits_swarm(request, tiny_llama_path):
    """Two servers of the tiny model (blocks 0:3 and 3:6) running in this process, so tests reach
    into their handlers (sessions, cache budget, caps) and patch them into hostile peers; both
    servers and the client take at most LIMITS_MAX_POSITIONS positions per Step."""
    from client import _loop
    from server.span_server import ServerConfig, SpanServer
    from swarm import AutoDistributedModelForCausalLM

    bootstrap = make_dht(host="127.0.0.1")
    peers = [str(m) for m in bootstrap.get_visible_maddrs()]

    async def start():
        common = dict(
            model=str(tiny_llama_path),
            initial_peers=peers,
            host="127.0.0.1",
            reachability="public",
            update_period=2.0,
            torch_threads=1,
            max_positions_per_step=LIMITS_MAX_POSITIONS,
        )
        return [await SpanServer.create(ServerConfig(blocks=blocks, **common)) for blocks in [(0, 3), (3, 6)]]

    servers = _loop.run(start(), timeout=240)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=peers, max_positions_per_step=LIMITS_MAX_POSITIONS
    )

    def stop() -> None:
        model.shutdown()
        for server in servers:
            _loop.run(server.shutdown(), timeout=60)
        bootstrap.shutdown()

    with last_use.until_last_use(request, stop):
        yield model, servers, peers


def inprocess_servers(path, spans=((0, 3), (3, 6)), **config):
    """Servers of ``spans`` running in this process (so tests can inspect their sessions and
    caches), joined through a real DHT, with a client model: a generator for module fixtures,
    yielding (model, servers) and stopping everything after. ``config``: more ServerConfig fields."""
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
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=peers)
    yield model, servers
    model.shutdown()
    for server in servers:
        _loop.run(server.shutdown(), timeout=60)
    bootstrap.shutdown()
