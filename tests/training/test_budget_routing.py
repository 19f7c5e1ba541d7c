"""Training's route planner (client/_train_routes.py): around servers whose backward budget is too small, and
past a DHT read that misses a block.

Three in-process servers of the tiny random Llama: a head of blocks 0:3 and two tails of 3:6. One tail's
``--max-backward-mib`` is made too small for even a row's prompts: the step goes through the other tail, with
the loss and prompt gradients of local transformers (loss 1e-5 relative, gradients 1e-4 of their largest entry);
with both tails too small the step is a ValueError naming both and their blocks. A planner whose first DHT read
misses every record of blocks 3..5 (a lapsed record, through the real fetch) reads again and trains; one whose
reads all miss names the blocks.
"""

from __future__ import annotations

import pytest
import torch

from client.errors import RoutingError
from protocol.dht_records import fetch_servers
from tests.kit.swarms import start_inprocess
from tests.kit.waiting import wait_until
from tests.training.test_fine_tuning import close_grads, local_loss

PRE_SEQ_LEN = 4
TINY = 4096  # bytes of backward budget: not even the prompts' first chunk through 3 blocks and the LM head


@pytest.fixture(scope="module")
def two_tails(tiny_llama_path):
    swarm = start_inprocess(
        tiny_llama_path,
        ((0, 3), (3, 6), (3, 6)),
        client_options=dict(tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN),
        max_positions_per_step=64,
    )
    torch.manual_seed(21)
    with torch.no_grad():
        swarm.model.prompt_embeddings.weight.normal_(0, 0.5)
    yield swarm
    swarm.stop()


def announced(model, peer_id: str) -> int:
    infos = fetch_servers(model.swarm.dht, model.swarm.model, 6)
    return next((info.max_backward_bytes for info in infos if info.peer_id == peer_id), -1)


def set_budget(model, server, budget: int) -> None:
    """What ``--max-backward-mib`` sets (0: the default), once the client can read it in the server's record."""
    server.handler.training.max_backward_bytes = budget
    expected = budget or server.handler.training.backward_budget
    wait_until(lambda: announced(model, server.handler.peer_id) == expected, "the budget announced", 30)


def step_against_local(model, reference, ids: torch.Tensor) -> None:
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
    expected = local_loss(reference, prompts, ids, torch.ones_like(ids), ids)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), (loss.item(), expected.item())
    grad = model.prompt_embeddings.weight.grad
    assert float(grad.abs().max()) > 0
    assert close_grads(grad, prompts.grad), float((grad - prompts.grad).abs().max())


def test_a_tail_whose_backward_budget_is_too_small_is_routed_around(two_tails, tiny_reference):
    model, (head, small, roomy) = two_tails.model, two_tails.servers
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    try:
        set_budget(model, small, TINY)
        set_budget(model, roomy, 0)
        before = small.handler.training.stats["train_forwards"]
        for _ in range(2):  # the router would alternate between the two tails: every step avoids the small one
            step_against_local(model, tiny_reference, ids)
            assert [hop.peer_id for hop in model.last_training_stats.route] == [
                head.handler.peer_id,
                roomy.handler.peer_id,
            ]
        assert small.handler.training.stats["train_forwards"] == before  # nothing reached it
        assert small.handler.training.stats["train_refused"] == 0

        set_budget(model, roomy, TINY)  # no route without a tail too small: the error names both
        with pytest.raises(ValueError) as caught:
            model(ids, labels=ids)
        message = str(caught.value)
        assert "has no room in the backward budget of server" in message, message
        assert "no route avoids the servers whose backward budget is too small for it" in message, message
        assert "(no other server takes block(s) 3, 4, 5)" in message, message
        for server in (small, roomy):
            assert f"{server.handler.peer_id} (blocks 3..5)" in message, message
    finally:
        set_budget(model, small, 0)
        set_budget(model, roomy, 0)
    step_against_local(model, tiny_reference, ids)  # either tail again


def test_a_planner_whose_dht_read_misses_a_block_reads_again(two_tails, tiny_reference, monkeypatch):
    """The lapsed record of tests/training/test_long_rows.py's flake (``no server holds blocks 2..3``), made
    deterministic: the client's DHT reads drop every record of blocks 3..5 while ``misses`` lasts."""
    import client._swarm

    model = two_tails.model
    reads, misses = [], [1]

    def lapsing(*args, **kwargs):
        servers = fetch_servers(*args, **kwargs)
        reads.append(len(servers))
        if misses[0] > 0:
            misses[0] -= 1
            return [info for info in servers if info.start_block != 3]
        return servers

    monkeypatch.setattr(client._swarm, "fetch_servers", lapsing)
    monkeypatch.setattr(model.swarm, "route_retry_delay", 0.01)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    step_against_local(model, tiny_reference, ids)
    assert len(reads) == 2 and reads[0] == 3, reads  # the first read missed the tails; the second found them

    misses[0], reads[:] = 1000, []  # every read misses: a RoutingError naming the blocks, after every attempt
    with pytest.raises(RoutingError, match=r"no server holds blocks 3\.\.5 of model") as caught:
        model(ids, labels=ids)
    assert len(reads) == model.swarm.max_route_attempts
    assert caught.value.missing_blocks == [3, 4, 5]
