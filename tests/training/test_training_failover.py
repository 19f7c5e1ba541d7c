"""A server lost during a training step's backward (docs/fine_tuning.md, "Failover"): CLI servers on
127.0.0.1, head 0:2 and tail 4:6 for the module, two servers of the middle blocks 2:4 per test. The middle
server the step's route uses is SIGKILLed, or frozen with SIGSTOP, once its backward recompute has begun
(tests/kit/faults.py slow_training: it touches a marker file, then waits). SIGKILL: the head, whose stream to
it breaks, sends its kept output to the other middle (a spare the row names) and the tail answers that resend
from its reply, so only the replacement computes again (each server's record counts its training forwards).
SIGSTOP: the client's timeout comes first and it runs the whole step again on the other middle. Either way
the step completes with the loss and prompt gradients of local transformers
(1e-5 relative of the loss, 1e-4 of the gradient's largest entry, as tests/training/test_fine_tuning.py).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from swarm.local import LocalSwarm, kill_group
from tests.kit.faulty_server import faulty
from tests.kit.swarms import SERVER_ARGS, servers_by_name
from tests.kit.waiting import wait_until
from tests.training.test_fine_tuning import close_grads, local_loss

PRE_SEQ_LEN = 4
TRAIN_DELAY_MS = 1500  # each middle server waits this long before a backward recompute: the fault lands then
REQUEST_TIMEOUT = 12.0  # the client's wait for a step's answer: SIGKILL's resend must complete within it
# the SIGSTOP case's wait: a frozen hop is found after this; a whole step on the other middle (its
# TRAIN_DELAY_MS included) still fits in it
FROZEN_TIMEOUT = 6.0


@pytest.fixture(scope="module")
def edge_swarm(tiny_llama_path, artifacts_dir):
    """Head and tail servers for the module and a prompt-tuned client; middles come per test."""
    with LocalSwarm(
        str(tiny_llama_path),
        spans=[(0, 2), (4, 6)],
        server_args=SERVER_ARGS,
        names=["head", "tail"],
        log_dir=str(artifacts_dir / "training-failover"),
    ) as swarm:
        from swarm import AutoDistributedModelForCausalLM

        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path),
            initial_peers=swarm.initial_peers,
            tuning_mode="ptune",
            pre_seq_len=PRE_SEQ_LEN,
            request_timeout=REQUEST_TIMEOUT,
        )
        yield swarm, model
        model.shutdown()


@pytest.fixture
def middles(edge_swarm, tmp_path):
    """Two slow-training servers of blocks 2:4, online before the test; name -> (process, marker path)."""
    swarm, model = edge_swarm
    started = {}
    for i in range(2):
        name = f"mid-{tmp_path.name}-{i}"
        marker = tmp_path / f"{name}.backward"
        launcher = faulty("--train-delay-ms", str(TRAIN_DELAY_MS), "--train-marker", str(marker))
        started[name] = (swarm.start_server(2, 4, name=name, launcher=launcher), marker)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        infos = servers_by_name(model, 6)
        if all(name in infos and infos[name].state == "online" for name in started):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the middle servers did not come online: {sorted(servers_by_name(model, 6))}")
    model.swarm.excluded = type(model.swarm.excluded)()  # forget exclusions from an earlier test
    yield started
    for process, _ in started.values():
        kill_group(process)  # SIGKILL: also ends a frozen one, its DHT process and libp2p daemon


def forwards(model) -> dict[str, int]:
    """Each server's training forwards, as its record announces them (server/train_replay.py)."""
    return {name: info.train_forwards for name, info in servers_by_name(model, 6).items()}


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_middle_server_lost_mid_backward_is_replaced_and_the_step_is_exact(
    edge_swarm, middles, tiny_reference, fault
):
    _, model = edge_swarm
    torch.manual_seed(11)
    with torch.no_grad():
        model.prompt_embeddings.weight.normal_(0.0, 0.02)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 9))
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0  # left padding on the second row
    labels = input_ids.clone()

    outcome: dict = {}
    before = forwards(model)

    def step() -> None:
        try:
            model.zero_grad()
            loss = model(input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            outcome["loss"], outcome["grad"] = loss.detach(), model.prompt_embeddings.weight.grad.clone()
        except BaseException as e:  # handed to the test's thread
            outcome["error"] = e

    # the client reads its timeout as each request goes out: the frozen case waits FROZEN_TIMEOUT
    model.swarm.request_timeout = FROZEN_TIMEOUT if fault == signal.SIGSTOP else REQUEST_TIMEOUT
    worker = threading.Thread(target=step, daemon=True)
    worker.start()
    deadline, victim = time.monotonic() + 120, None
    while victim is None and time.monotonic() < deadline and worker.is_alive():
        victim = next((name for name, (_, marker) in middles.items() if marker.exists()), None)
        time.sleep(0.02)
    assert victim is not None, f"no middle server began a backward: {outcome}"
    middles[victim][0].send_signal(fault)  # its backward is waiting TRAIN_DELAY_MS: the step is in flight
    worker.join(timeout=240)
    model.swarm.request_timeout = REQUEST_TIMEOUT
    assert not worker.is_alive(), "the training step did not complete"
    assert "error" not in outcome, outcome.get("error")

    stats = model.last_training_stats
    names = {info.peer_id: name for name, info in servers_by_name(model, 6).items()}
    middle = next(names.get(hop.peer_id) for hop in stats.route if hop.start == 2)
    if fault == signal.SIGKILL:  # the head sent its output again to the other middle: nothing else computed again
        assert stats.failovers == 0 and middle == victim, (stats, middle, victim)
        spare = next(name for name in middles if name != victim)
        rows = input_ids.shape[0]
        wanted = {"head": before["head"] + rows, "tail": before["tail"] + rows, spare: rows}
        wait_until(lambda: forwards(model) == {**forwards(model), **wanted}, f"train_forwards {wanted}")
    else:  # a frozen middle holds the head's stream past the client's timeout: the whole step runs again
        assert stats.failovers >= 1, stats
        assert middle != victim and middle in middles, (middle, victim)

    prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
    expected = local_loss(tiny_reference, prompts, input_ids, mask, labels)
    expected.backward()
    assert abs(outcome["loss"].item() - expected.item()) <= 1e-5 * abs(expected.item())
    assert close_grads(outcome["grad"], prompts.grad), (outcome["grad"] - prompts.grad).abs().max()
