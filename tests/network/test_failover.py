"""Failover on a real local swarm with two servers for the middle blocks: the server in use is
killed, frozen, cut off from the network, or shut down mid-generation, and the output equals the
run without a failure, with the failover recorded in the stats."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil
import pytest
import torch

from client._swarm import SUSPECT_SECONDS
from swarm.local import LocalSwarm, kill_group
from tests.kit.faulty_server import faulty
from tests.kit.reference import PROMPT
from tests.kit.swarms import SERVER_ARGS, servers_by_name

NEW_TOKENS = 40

FAULT_AT = 10  # tokens into the generation
REQUEST_TIMEOUT = 8.0  # the client's wait for a lap's answer
FROZEN_TIMEOUT = 4.0  # the SIGSTOP case's: a frozen middle is found after this (a healthy lap takes well under 1 s)


@pytest.fixture(scope="module")
def failover_swarm(tiny_llama_path, artifacts_dir):
    """Head and tail servers for the whole module; the middle servers come from ``middles``."""
    with LocalSwarm(
        str(tiny_llama_path),
        spans=[(0, 2), (4, 6)],
        server_args=SERVER_ARGS_FAILOVER,
        names=["head", "tail"],
        log_dir=str(artifacts_dir / "failover-swarm"),
        launcher=faulty("--block-delay-ms", "5"),
    ) as swarm:
        from swarm import AutoDistributedModelForCausalLM

        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers, request_timeout=REQUEST_TIMEOUT
        )
        yield swarm, model
        model.shutdown()


SERVER_ARGS_FAILOVER = SERVER_ARGS + ["--drain-seconds", "1"]  # and slow blocks (5 ms each): faulty(...) above
_counter = iter(range(1000))


class Middles:
    """The two servers of blocks 2:4 a test fails over between. A test spends one (its fault's
    victim); the other serves on into the next test, so each test starts one server, not two."""

    def __init__(self):
        self.processes: dict[str, subprocess.Popen] = {}
        self.spent: set[int] = set()  # pids of the victims of faults

    def replace_spent(self) -> None:
        for name, process in list(self.processes.items()):
            if process.pid in self.spent or process.poll() is not None:
                kill_group(process)  # also reaps the DHT process and libp2p daemon of a SIGKILLed server
                del self.processes[name]


@pytest.fixture(scope="module")
def middle_servers(failover_swarm):
    pool = Middles()
    yield pool
    for process in pool.processes.values():
        kill_group(process)


@pytest.fixture
def middles(failover_swarm, middle_servers):
    """Two servers for blocks 2:4, online before the test starts; its victim is gone after it."""
    swarm, model = failover_swarm
    while len(middle_servers.processes) < 2:
        name = f"mid-{next(_counter)}"
        middle_servers.processes[name] = swarm.start_server(2, 4, name=name)
    names = list(middle_servers.processes)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        infos = servers_by_name(model, 6)
        if all(name in infos and infos[name].state == "online" for name in names):
            break
        time.sleep(0.5)
    model.swarm.excluded = type(model.swarm.excluded)()  # forget exclusions from earlier tests
    model.swarm.suspects = type(model.swarm.suspects)(base_seconds=SUSPECT_SECONDS)  # and their suspects
    yield middle_servers
    middle_servers.replace_spent()


def middle_in_use(model, middles: Middles) -> subprocess.Popen:
    """The process of the first middle-block server of the current route."""
    names = {info.peer_id: name for name, info in servers_by_name(model, 6).items()}
    peer_id = next(hop[0] for hop in model.last_generation_stats.route if hop[1] >= 2 and hop[2] <= 4)
    return middles.processes[names[peer_id]]


class FaultAfter:
    """A transformers-style streamer that injects a fault into the middle server in use."""

    def __init__(self, model, middles: Middles, fault):
        self.model, self.middles, self.fault = model, middles, fault
        self.seen, self.victim = -1, None

    def put(self, tokens):
        self.seen += 1 if self.seen < 0 else len(tokens.view(-1))
        if self.victim is None and self.seen >= FAULT_AT:
            self.victim = middle_in_use(self.model, self.middles)
            self.middles.spent.add(self.victim.pid)
            self.fault(self.victim)

    def end(self):
        pass


def kill(process):
    process.send_signal(signal.SIGKILL)


def freeze(process):
    process.send_signal(signal.SIGSTOP)


def cut_off(process):
    """Kill the server's libp2p daemon: the Python process lives on, but every connection drops."""
    for child in psutil.Process(process.pid).children(recursive=True):
        if "p2pd" in child.name():
            child.kill()


def terminate(process):
    process.send_signal(signal.SIGTERM)


# Every fault greedy; seeded sampling once, with SIGKILL: a tail samples position t from a generator
# keyed by (seed, t) alone (protocol/sampling.py), so after any failover the replacement draws what
# the victim would have, and how the fault was noticed (reset, timeout, drain) is the greedy cases'.
# Sampled runs of the other three faults re-checked that path at a server start (~20 s) each.
@pytest.mark.parametrize(
    "fault, sampling",
    [(kill, False), (freeze, False), (cut_off, False), (terminate, False), (kill, True)],
    ids=["SIGKILL-greedy", "SIGSTOP-greedy", "disconnect-greedy", "SIGTERM-greedy", "SIGKILL-sampled"],
)
def test_generation_survives_a_middle_server_failure(failover_swarm, middles, fault, sampling):
    swarm, model = failover_swarm
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=21) if sampling else {}
    expected = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, speculation=None, **kwargs)
    streamer = FaultAfter(model, middles, fault)
    # the client reads its timeout as each session opens: only the faulted generation of the frozen case waits less
    model.swarm.request_timeout = FROZEN_TIMEOUT if fault is freeze else REQUEST_TIMEOUT
    try:
        output = model.generate(
            torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, speculation=None, streamer=streamer, **kwargs
        )
    finally:
        model.swarm.request_timeout = REQUEST_TIMEOUT
    stats = model.last_generation_stats
    assert streamer.victim is not None
    assert output.tolist() == expected.tolist()
    assert stats.new_tokens == NEW_TOKENS
    if fault is not terminate:  # a draining server may finish the session within its grace
        assert stats.failovers >= 1, stats
        assert middle_in_use(model, middles).pid != streamer.victim.pid  # moved to the other middle server
