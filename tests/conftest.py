"""Session-scoped swarms of real server processes on 127.0.0.1, shared by the tests that need them.

Every server is a ``python -m swarm.server`` process joined through a real hivemind DHT; the
fixtures stop them (SIGTERM, then SIGKILL) when the session ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

from swarm import lifeline
from swarm.dht_records import fetch_servers
from swarm.local import LocalSwarm
from swarm.records import ServerInfo
from swarm.routing import RoutePlanner, RouteHop
from tests.checkpoints import build_tiny_llama

lifeline.install_fork_hook()  # the DHT processes (and p2pd) of pytest's clients die with it, even on SIGKILL

SERVER_ARGS = ["--torch-threads", "1", "--update-period", "5", "--log-level", "INFO"]

# name -> blocks of the tiny 6-block model; routes in the tests are pinned over these
TINY_SERVERS = {"A": (0, 3), "B": (3, 6), "C": (0, 1), "D": (1, 4), "E": (2, 6)}


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = Path(__file__).resolve().parent.parent / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_swarm(tiny_llama_path, artifacts_dir):
    swarm = LocalSwarm(str(tiny_llama_path), spans=list(TINY_SERVERS.values()), server_args=SERVER_ARGS,
                       log_dir=str(artifacts_dir / "tiny-swarm"), names=list(TINY_SERVERS))  # fmt: skip
    with swarm:
        yield swarm


@pytest.fixture(scope="session")
def tiny_model(tiny_swarm, tiny_llama_path):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=tiny_swarm.initial_peers)
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype="float32").eval()


@pytest.fixture(scope="session")
def smol_swarm(artifacts_dir):
    with LocalSwarm("smollm2-135m", 3, server_args=SERVER_ARGS, log_dir=str(artifacts_dir / "smol-swarm")) as swarm:
        yield swarm


@pytest.fixture(scope="session")
def smol_model(smol_swarm):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=smol_swarm.initial_peers)
    yield model
    model.shutdown()


@pytest.fixture(scope="session")
def smol_reference():
    from transformers import AutoModelForCausalLM

    from swarm.models import ensure_smollm2_checkpoint

    return AutoModelForCausalLM.from_pretrained(ensure_smollm2_checkpoint(), dtype="float32").eval()


def servers_by_name(model, num_blocks: int) -> dict[str, ServerInfo]:
    infos = fetch_servers(model.swarm.dht, model.swarm.model, num_blocks)
    return {info.public_name: info for info in infos}


class PinnedRoute(RoutePlanner):
    """Always returns the same route, named by the servers' public names: lets a test choose
    exactly which split of the model it exercises (the real router is tested on its own)."""

    def __init__(self, model, hops: Sequence[tuple[str, int, int]]):
        by_name = servers_by_name(model, model.config.num_hidden_layers)
        self.route = [RouteHop(by_name[name].peer_id, start, end) for name, start, end in hops]

    def plan(self, servers, start, end, *, max_length=0, exclude=(), client_rtts=None) -> list[RouteHop]:
        return list(self.route)
