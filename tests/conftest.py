"""Session-scoped swarms of real server processes on 127.0.0.1, shared by the tests that need them.

Every server is a ``python -m swarm.server`` process joined through a real hivemind DHT; the
fixtures stop them (SIGTERM, then SIGKILL) after the last test that uses them (``until_last_use``)
or, at the latest, when their scope ends. The helpers they are built from live in tests/kit/.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest

from swarm import lifeline, warm_start
from swarm.local import LocalSwarm
from tests.kit.checkpoints import build_tiny_llama
from tests.kit.last_use import last_use
from tests.kit.shards import ENV as SHARD_ENV
from tests.kit.shards import FileSeconds, keep_own_shard
from tests.kit.swarms import LIMITS_MAX_POSITIONS, SERVER_ARGS, SMOL_SERVER_ARGS, TINY_SERVERS, start_inprocess

lifeline.install_fork_hook()  # the DHT processes (and p2pd) of pytest's clients die with it, even on SIGKILL
# The suite's swarms also run quantized and DeepSeek-V4 servers (4-5 s of imports each on 2 cores):
# the forkserver that every LocalSwarm forks from imports those once too (swarm/warm_start.py).
warm_start.PRELOAD += ["bitsandbytes", "server.adapters.deepseek_v4", "server.int8_weight"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]):
    yield
    last_use.after(item)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep_own_shard(config, items)  # `make test` runs the suite as two pytest processes (tests/kit/shards.py)


file_seconds = FileSeconds()  # each run leaves its per-file seconds: the shards' next weights


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file_seconds.add(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    file_seconds.write(artifacts_path())


def artifacts_path() -> Path:
    path = Path(__file__).resolve().parent.parent / "test-artifacts"
    shard = os.environ.get(SHARD_ENV)
    if shard:  # two shards run at once: each writes its swarms' logs under its own folder
        path = path / f"shard-{shard.replace('/', '-of-')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    return artifacts_path()


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
    with LocalSwarm(
        "smollm2-135m", 3, server_args=SMOL_SERVER_ARGS, log_dir=str(artifacts_dir / "smol-swarm")
    ) as swarm:
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


# ---- an in-process swarm with small wire limits (tests of hostile wire input and fuzzing) ----


@pytest.fixture(scope="session")
def limits_swarm(request, tiny_llama_path):
    """Two servers of the tiny model (blocks 0:3 and 3:6) running in this process, so tests reach
    into their handlers (sessions, cache budget, caps) and patch them into hostile peers; both
    servers and the client take at most LIMITS_MAX_POSITIONS positions per Step."""
    limits = dict(max_positions_per_step=LIMITS_MAX_POSITIONS)
    swarm = start_inprocess(tiny_llama_path, ((0, 3), (3, 6)), client_options=limits, **limits)
    with last_use.until_last_use(request, swarm.stop):
        yield swarm.model, swarm.servers, swarm.peers
