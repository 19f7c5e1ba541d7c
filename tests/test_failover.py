"""Failover on a real local swarm with two servers for the middle blocks: the server in use is
killed, frozen, cut off from the network, or shut down mid-generation, and the output equals the
run without a failure, with the failover recorded in the stats."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from swarm.local import LocalSwarm
from tests.conftest import SERVER_ARGS, servers_by_name
from tests.test_exactness import PROMPT

NEW_TOKENS = 40
FAULT_AT = 10  # tokens into the generation


@pytest.fixture(scope="module")
def failover_swarm(tiny_llama_path, artifacts_dir):
    args = SERVER_ARGS + ["--drain-seconds", "1", "--debug-block-delay-ms", "5"]
    with LocalSwarm(str(tiny_llama_path), spans=[(0, 2), (2, 4), (2, 4), (4, 6)], server_args=args,
                    names=["head", "mid-0", "mid-1", "tail"], log_dir=str(artifacts_dir / "failover-swarm")) as swarm:  # fmt: skip
        from swarm import AutoDistributedModelForCausalLM

        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers, request_timeout=8.0
        )
        swarm.spare_index = 2
        yield swarm, model
        for process in swarm.servers:  # a frozen server would block the clean stop
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
        model.shutdown()


def middle_in_use(swarm, model) -> psutil.Process:
    peer_id = model.last_generation_stats.route[1][0]
    names = {info.peer_id: name for name, info in servers_by_name(model, 6).items()}
    name = names[peer_id]
    index = swarm.names.index(name) if name in swarm.names else int(name.split("-")[-1])
    return swarm.servers[index]


def ensure_two_middles(swarm, model) -> None:
    """Replace a middle server a previous test took down, so both middles are online."""
    alive = [name for name, info in servers_by_name(model, 6).items() if name.startswith("mid") and info.state == "online"]
    live_processes = [p for p, n in zip(swarm.servers, swarm.names) if n.startswith("mid") and p.poll() is None]
    if len(live_processes) < 2 or len(alive) < 2:
        swarm.spare_index += 1
        name = f"mid-{swarm.spare_index}"
        swarm.names.append(name)
        swarm.start_server(2, 4, name=name)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            online = [n for n, i in servers_by_name(model, 6).items() if n == name and i.state == "online"]
            if online:
                break
            time.sleep(0.5)
    model.swarm.excluded = type(model.swarm.excluded)()  # forget exclusions from earlier tests


class FaultAfter:
    """A transformers-style streamer that injects a fault into the middle server in use."""

    def __init__(self, swarm, model, fault):
        self.swarm, self.model, self.fault = swarm, model, fault
        self.seen, self.victim = -1, None

    def put(self, tokens):
        self.seen += 1 if self.seen < 0 else len(tokens.view(-1))
        if self.victim is None and self.seen >= FAULT_AT:
            self.victim = middle_in_use(self.swarm, self.model)
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
def test_generation_survives_a_middle_server_failure(failover_swarm, fault, sampling):
    swarm, model = failover_swarm
    ensure_two_middles(swarm, model)
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=21) if sampling else {}
    expected = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, speculation=None, **kwargs)
    streamer = FaultAfter(swarm, model, fault)
    output = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, speculation=None, streamer=streamer, **kwargs)
    stats = model.last_generation_stats
    assert streamer.victim is not None
    assert output.tolist() == expected.tolist()
    assert stats.new_tokens == NEW_TOKENS
    if fault is not terminate:  # a draining server may finish the session within its grace
        assert stats.failovers >= 1, stats
        assert middle_in_use(swarm, model).pid != streamer.victim.pid  # moved to the other middle server
    if fault is freeze:
        os.kill(streamer.victim.pid, signal.SIGCONT)
        streamer.victim.send_signal(signal.SIGKILL)
