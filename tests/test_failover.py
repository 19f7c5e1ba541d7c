"""Failover on a real local swarm with two servers for the middle blocks: the server in use is
killed, frozen, cut off from the network, or shut down mid-generation, and the output equals the
run without a failure, with the failover recorded in the stats."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
import torch

from swarm.local import LocalSwarm, kill_group
from tests.conftest import SERVER_ARGS, servers_by_name
from tests.faulty_server import faulty
from tests.test_exactness import PROMPT

NEW_TOKENS = 40

FAULT_AT = 10  # tokens into the generation


@pytest.fixture(scope="module")
def failover_swarm(tiny_llama_path, artifacts_dir):
    """Head and tail servers for the whole module; each test brings its own two middle servers."""
    with LocalSwarm(str(tiny_llama_path), spans=[(0, 2), (4, 6)], server_args=SERVER_ARGS_FAILOVER,
                    names=["head", "tail"], log_dir=str(artifacts_dir / "failover-swarm"),
                    launcher=faulty("--block-delay-ms", "5")) as swarm:  # fmt: skip
        from swarm import AutoDistributedModelForCausalLM

        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers, request_timeout=8.0
        )
        yield swarm, model
        model.shutdown()


SERVER_ARGS_FAILOVER = SERVER_ARGS + ["--drain-seconds", "1"]  # and slow blocks (5 ms each): faulty(...) above
_counter = iter(range(1000))


@pytest.fixture
def middles(failover_swarm):
    """Two fresh servers for blocks 2:4, online before the test starts and gone after it."""
    swarm, model = failover_swarm
    names = [f"mid-{next(_counter)}" for _ in range(2)]
    processes = {name: swarm.start_server(2, 4, name=name) for name in names}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        infos = servers_by_name(model, 6)
        if all(name in infos and infos[name].state == "online" for name in names):  # noqa: PLR2004
            break
        time.sleep(0.5)
    model.swarm.excluded = type(model.swarm.excluded)()  # forget exclusions from earlier tests
    yield processes
    for process in processes.values():
        kill_group(process)  # also reaps the DHT process and libp2p daemon of a SIGKILLed server


def middle_in_use(model, processes) -> "subprocess.Popen":
    """The process of the first middle-block server of the current route."""
    names = {info.peer_id: name for name, info in servers_by_name(model, 6).items()}
    peer_id = next(hop[0] for hop in model.last_generation_stats.route if hop[1] >= 2 and hop[2] <= 4)
    return processes[names[peer_id]]


class FaultAfter:
    """A transformers-style streamer that injects a fault into the middle server in use."""

    def __init__(self, model, processes, fault):
        self.model, self.processes, self.fault = model, processes, fault
        self.seen, self.victim = -1, None

    def put(self, tokens):
        self.seen += 1 if self.seen < 0 else len(tokens.view(-1))
        if self.victim is None and self.seen >= FAULT_AT:
            self.victim = middle_in_use(self.model, self.processes)
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


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("fault", [kill, freeze, cut_off, terminate], ids=["SIGKILL", "SIGSTOP", "disconnect", "SIGTERM"])
def test_generation_survives_a_middle_server_failure(failover_swarm, middles, fault, sampling):
    swarm, model = failover_swarm
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=21) if sampling else {}
    expected = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, speculation=None, **kwargs)
    streamer = FaultAfter(model, middles, fault)
    output = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, speculation=None, streamer=streamer, **kwargs)
    stats = model.last_generation_stats
    assert streamer.victim is not None
    assert output.tolist() == expected.tolist()
    assert stats.new_tokens == NEW_TOKENS
    if fault is not terminate:  # a draining server may finish the session within its grace
        assert stats.failovers >= 1, stats
        assert middle_in_use(model, middles).pid != streamer.victim.pid  # moved to the other middle server
