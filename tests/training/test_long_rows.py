"""Rows longer than the route's step limit go in chunks (docs/design.md, "Long rows in chunks").

Three in-process servers of the tiny random Llama (blocks 0:2, 2:4, 4:6) take at most MAX_POSITIONS positions per
step; rows of up to 23 ids after 3 prompts go in 2 to 4 chunks. The loss and the prompts' gradient are compared
with local transformers over the whole row at once (float32): loss within 1e-5 relative, gradients within 1e-4 of
their largest entry. Bad laps (out of order, for a step no hop holds, past the limits) get named errors.
"""

from __future__ import annotations

import pytest
import torch

from client._training import TrainRow, split_row
from protocol import limits
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, Hop, TrainBackward, TrainForward
from tests.kit.swarms import start_inprocess
from tests.training.test_fine_tuning import close_grads, local_loss, raw_exchange

SPANS = [(0, 2), (2, 4), (4, 6)]
MAX_POSITIONS = 8
PRE_SEQ_LEN = 3


@pytest.fixture(scope="module")
def chunk_swarm(tiny_llama_path):
    """Three in-process servers taking at most MAX_POSITIONS positions per Step, and a prompt-tuning
    client; (the swarm, its servers)."""
    swarm = start_inprocess(
        tiny_llama_path,
        SPANS,
        client_options=dict(tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN),
        max_positions_per_step=MAX_POSITIONS,
    )
    yield swarm, swarm.servers
    swarm.stop()


@pytest.fixture(scope="module")
def tuned(chunk_swarm):
    model = chunk_swarm[0].model
    torch.manual_seed(11)
    with torch.no_grad():
        model.prompt_embeddings.weight.copy_(torch.randn(PRE_SEQ_LEN, model.config.hidden_size) * 0.5)
    return model


def test_split_row_fills_each_chunk_to_the_limit():
    row = TrainRow(list(range(20)), list(range(100, 120)))
    chunks = split_row(row, 3, 8)
    assert [(offset, len(ids)) for offset, ids, _ in chunks] == [(0, 5), (8, 8), (16, 7)]
    assert sum((ids for _, ids, _ in chunks), []) == row.token_ids
    assert sum((targets for _, _, targets in chunks), []) == row.targets
    with pytest.raises(ValueError, match="3 prompts leave no room"):
        split_row(row, 3, 3)


def check_against_local(model, reference, servers, input_ids, mask, labels):
    model.zero_grad()
    loss = model(input_ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    ours = model.prompt_embeddings.weight.grad.clone()
    prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
    expected = local_loss(reference, prompts, input_ids, mask, labels)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), (loss.item(), expected.item())
    assert float(ours.abs().max()) > 0
    assert close_grads(ours, prompts.grad), float((ours - prompts.grad).abs().max())
    for server in servers:  # every row's chunks were freed after chunk 0's backward lap
        assert len(server.handler.training.chunks) == 0 and len(server.handler.training.kept) == 0


def test_a_row_past_the_step_limit_gives_the_loss_and_gradients_of_local_transformers(
    tuned, tiny_reference, chunk_swarm
):
    torch.manual_seed(3)
    input_ids = torch.randint(0, tuned.config.vocab_size, (1, 21))  # 3 prompts + 21 ids: chunks of 5, 8, 8
    labels = input_ids.clone()
    labels[0, 9] = -100
    check_against_local(tuned, tiny_reference, chunk_swarm[1], input_ids, torch.ones_like(input_ids), labels)
    assert tuned.last_training_stats.failovers == 0


def test_a_padded_batch_of_long_and_short_rows_equals_local_transformers(tuned, tiny_reference, chunk_swarm):
    torch.manual_seed(4)
    input_ids = torch.randint(0, tuned.config.vocab_size, (3, 23))
    mask = torch.ones_like(input_ids)
    mask[1, :19] = 0  # left padding: 4 ids, one chunk
    mask[2, :9] = 0  # 14 ids: two chunks
    labels = input_ids.masked_fill(mask == 0, -100)
    check_against_local(tuned, tiny_reference, chunk_swarm[1], input_ids, mask, labels)


def lap(route, index, offset, ids, backward_only=False, step_id="chunky", num_chunks=3) -> TrainForward:
    ids = list(ids)
    return TrainForward(
        step_id=step_id,
        route=route,
        hop_index=0,
        num_prompts=PRE_SEQ_LEN,
        token_ids=ids,
        targets=ids,
        chunk_index=index,
        num_chunks=num_chunks,
        chunk_offset=offset,
        backward_only=backward_only,
    )


def test_bad_chunk_laps_get_named_errors_and_the_servers_keep_serving(tuned, chunk_swarm):
    _, servers = chunk_swarm
    route = [Hop(s.handler.peer_id, start, end) for s, (start, end) in zip(servers, SPANS)]
    head, prompts = servers[0].handler.peer_id, [torch.zeros(PRE_SEQ_LEN, tuned.config.hidden_size)]
    # the first lap of a row is kept on every hop and answered with an empty TrainBackward
    reply = raw_exchange(tuned, head, lap(route, 0, 0, range(1, 6)), prompts)
    assert isinstance(reply, TrainBackward) and reply.num_targets == 0, reply
    assert all(len(s.handler.training.chunks) == 1 for s in servers)
    cases = [
        (lap(route, 2, 8, range(8)), [], ErrorCode.BAD_REQUEST, "out of order; expected chunk 1 at offset 8"),
        (lap(route, 1, 9, range(8)), [], ErrorCode.BAD_REQUEST, "out of order"),
        (lap(route, 0, 0, range(5), True), [], ErrorCode.BAD_REQUEST, "out of order; expected the backward lap"),
        (lap(route, 1, 8, range(8), step_id="nobody"), [], ErrorCode.UNKNOWN_SESSION, "'nobody'"),
        (lap(route, 0, 0, range(5), True, "nobody"), [], ErrorCode.UNKNOWN_SESSION, "'nobody'"),
        (lap(route, 1, 8, range(9)), [], ErrorCode.STEP_TOO_LARGE, "exceeds this server's 8 positions"),
        (lap(route, 0, 0, range(5), num_chunks=limits.MAX_TRAIN_CHUNKS + 1), prompts, ErrorCode.BAD_REQUEST, "256"),
        (lap(route, 1, limits.MAX_TRAIN_ROW_POSITIONS, range(8)), [], ErrorCode.STEP_TOO_LARGE, "a training row"),
        (lap(route, 1, 0, range(8)), [], ErrorCode.BAD_REQUEST, "cannot start at offset 0"),
        (lap(route, 2, 8, range(8), True), [], ErrorCode.BAD_REQUEST, "has no backward_only lap"),
    ]
    for message, tensors, code, text in cases:
        reply = raw_exchange(tuned, head, message, tensors)
        assert isinstance(reply, ErrorReply) and reply.code == code and text in reply.message, (text, reply)
    # the row's next lap is still the one it expects, and a whole step runs beside it
    reply = raw_exchange(tuned, head, lap(route, 1, 8, range(8)), [])
    assert isinstance(reply, TrainBackward), reply
    loss = tuned(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
    assert torch.isfinite(loss)
    for server in servers:
        server.handler.training.chunks.forget("chunky")
