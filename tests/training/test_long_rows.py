"""Rows longer than the route's step limit go in chunks (docs/design.md, "Long rows in chunks").

Three in-process servers of the tiny random Llama (blocks 0:2, 2:4, 4:6) take at most MAX_POSITIONS positions per
step; rows of up to 23 ids after 3 prompts go in 2 to 5 chunks, the later ones smaller as the row's earlier
keys/values grow (each chunk's backward holds no more than a row of MAX_POSITIONS: protocol/train_memory.py).
The loss and the prompts' gradient are compared with local transformers over the whole row at once (float32):
loss within 1e-5 relative, gradients within 1e-4 of their largest entry. So are deep-prompt-tuned rows (the
per-block prompts enter with chunk 0) and classification rows (the score weights go with the last chunk, whose
last position the tail scores): 3-chunk rows and padded batches. Bad laps (out of order, for a step no hop
holds, past the limits or the backward budget, changing the row's kind) get named errors.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from client._train_routes import TrainRow, split_row
from client.errors import GenerationError
from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, Hop, TrainBackward, TrainDrop, TrainForward
from protocol.train_memory import HopBudget, backward_bytes
from tests.kit.swarms import start_inprocess
from tests.kit.waiting import wait_until
from tests.training.test_classification import local_logits
from tests.training.test_deep_ptune import deep_hooks
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


def test_later_chunks_shrink_so_each_backward_fits_what_a_step_holds(tiny_llama_path):
    """With the model's config a chunk after more earlier positions is smaller: each one's backward (its
    attention reads every earlier key/value) stays within a row of the step limit's, the servers' default
    budget; a row that no chunk size can finish is refused by name before anything is sent."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_path)
    row = TrainRow(list(range(23)), list(range(23)))
    chunks = split_row(row, PRE_SEQ_LEN, MAX_POSITIONS, config)
    assert [(offset, len(ids)) for offset, ids, _ in chunks] == [(0, 5), (8, 6), (14, 5), (19, 5), (24, 2)]
    assert sum((ids for _, ids, _ in chunks), []) == row.token_ids
    budget = backward_bytes(config, torch.float32, MAX_POSITIONS, 6, True)
    for offset, ids, _ in chunks:
        positions = len(ids) + (PRE_SEQ_LEN if offset == 0 else 0)
        assert backward_bytes(config, torch.float32, positions, 6, True, offset) <= budget
    block = backward_bytes(config, torch.float32, MAX_POSITIONS, 1, False)
    for offset, ids, _ in chunks[1:-1]:  # as large as fits (the first: the step's; the last: what is left)
        assert backward_bytes(config, torch.float32, len(ids) + 1, 1, False, offset) > block
    with pytest.raises(ValueError, match="its chunk after 60 positions has no room in the backward of a step"):
        split_row(TrainRow(list(range(80)), list(range(80))), PRE_SEQ_LEN, MAX_POSITIONS, config)


def test_chunks_fit_the_smallest_backward_budget_the_route_announces(tiny_llama_path):
    """With the route's announced budgets (``ServerInfo.max_backward_bytes``) every chunk, the first one included,
    is as large as the smallest budget allows after its offset: a row a step holds goes in chunks through a tail of
    a small ``--max-backward-mib``, each within every hop's check (server/training.py) and no smaller than it must
    be. A classification row's tail computes no logits, so its chunks are sized without them (here: one chunk);
    a budget too small for the prompts is refused by name, naming the server."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_path)
    f32, limit, prompts = torch.float32, 64, 4
    row = TrainRow(list(range(40)), list(range(40)))
    middle = HopBudget(backward_bytes(config, f32, limit, 3, False), 3, False, f32, "head")  # the default
    default_tail = HopBudget(backward_bytes(config, f32, limit, 3, True), 3, True, f32, "tail")
    assert split_row(row, prompts, limit, config, [middle, default_tail]) == [(0, row.token_ids, row.targets)]
    small_tail = HopBudget(8 << 20, 3, True, f32, "tail")  # --max-backward-mib 8: the logits of ~13 positions
    chunks = split_row(row, prompts, limit, config, [middle, small_tail])
    assert [(offset, len(ids)) for offset, ids, _ in chunks] == [(0, 9), (13, 13), (26, 13), (39, 5)]
    assert sum((ids for _, ids, _ in chunks), []) == row.token_ids
    for index, (offset, ids, _) in enumerate(chunks):
        positions = len(ids) + (prompts if index == 0 else 0)
        for hop in (middle, small_tail):
            assert backward_bytes(config, hop.dtype, positions, hop.blocks, hop.tail, offset) <= hop.budget
        if index < len(chunks) - 1:  # as large as the tail takes
            assert backward_bytes(config, f32, positions + 1, 3, True, offset) > small_tail.budget
    # classification: the tail's estimate leaves the LM head's logits out, as the tail's check does
    assert len(split_row(row, prompts, limit, config, [middle, small_tail], logits=False)) == 1
    with pytest.raises(
        ValueError,
        match=r"its first chunk \(4 prompts\) has no room in the backward budget of server "
        r"tail \(1.0 MiB through 3 blocks",
    ):
        split_row(row, prompts, limit, config, [middle, HopBudget(1 << 20, 3, True, f32, "tail")])


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
    input_ids = torch.randint(0, tuned.config.vocab_size, (1, 21))  # 3 prompts + 21 ids: chunks of 5, 6, 5, 5
    labels = input_ids.clone()
    labels[0, 9] = -100
    check_against_local(tuned, tiny_reference, chunk_swarm[1], input_ids, torch.ones_like(input_ids), labels)
    assert tuned.last_training_stats.failovers == 0
    for server, (start, end) in zip(chunk_swarm[1], SPANS):  # the whole row's backward is past every budget
        training = server.handler.training
        whole = backward_bytes(tuned.config, torch.float32, 24, end - start, end == 6)
        assert whole > 2 * training.backward_budget, (whole, training.backward_budget)


def test_a_row_in_chunks_survives_its_upstream_servers_record_lapsing_between_laps(
    tuned, tiny_reference, chunk_swarm, monkeypatch
):
    """Whom a hop counts a row against (a forwarding server, or its sender as a client) comes from the DHT records
    it reads, which lapse for a moment under load: the hop matches a row's later laps by their sender, not by that
    reading, so a record missing when chunk 0 came (here: each hop after the head reads none for chunk 0's laps)
    changes nothing. Compared on the owner, chunk 1 found no row ("no training step ... is held here for chunk 1",
    as this module once failed on a loaded machine)."""
    import server.training

    real = server.training.cap_owner
    owners = []

    def lapsed_at_chunk_0(message, upstream_peer, known_servers):
        owner = real(message, upstream_peer, {} if message.chunk_index == 0 else known_servers)
        owners.append((message.chunk_index, owner))
        return owner

    monkeypatch.setattr(server.training, "cap_owner", lapsed_at_chunk_0)
    torch.manual_seed(5)
    input_ids = torch.randint(0, tuned.config.vocab_size, (1, 14))  # 3 prompts + 14 ids: three chunks
    check_against_local(tuned, tiny_reference, chunk_swarm[1], input_ids, torch.ones_like(input_ids), input_ids)
    assert tuned.last_training_stats.failovers == 0
    # the hops after the head read their upstream as a client at chunk 0, as a server after: the lapse happened
    assert {owner is None for index, owner in owners if index == 0} == {False}
    assert {owner is None for index, owner in owners if index > 0} == {True}


def test_a_padded_batch_of_long_and_short_rows_equals_local_transformers(tuned, tiny_reference, chunk_swarm):
    torch.manual_seed(4)
    input_ids = torch.randint(0, tuned.config.vocab_size, (3, 23))
    mask = torch.ones_like(input_ids)
    mask[1, :19] = 0  # left padding: 4 ids, one chunk
    mask[2, :9] = 0  # 14 ids: three chunks
    labels = input_ids.masked_fill(mask == 0, -100)
    check_against_local(tuned, tiny_reference, chunk_swarm[1], input_ids, mask, labels)


def randomized(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    return model


def assert_freed(servers) -> None:
    for server in servers:
        assert len(server.handler.training.chunks) == 0 and len(server.handler.training.kept) == 0


def forwards(servers) -> int:
    """Forward laps the head computed so far (one per chunk, one per short row)."""
    return servers[0].handler.training.stats["train_forwards"]


# forward laps: 3 prompts + 16 ids in chunks of 5, 6, 5 ids; the batch's 23 ids in 5 chunks, 4 ids in 1, 14 in 3
CHUNK_LAPS = {"one 3-chunk row": 3, "padded batch": 5 + 1 + 3}
SHAPES = {"one 3-chunk row": (1, 16), "padded batch": (3, 23)}


@pytest.mark.parametrize("batch", ["one 3-chunk row", "padded batch"])
def test_deep_prompt_rows_in_chunks_equal_local_transformers(tiny_llama_path, tiny_reference, chunk_swarm, batch):
    from swarm import AutoDistributedModelForCausalLM

    swarm, servers = chunk_swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=swarm.peers, tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN
    )
    try:
        randomized(model, 12)
        torch.manual_seed(5)
        input_ids = torch.randint(0, model.config.vocab_size, SHAPES[batch])
        mask = torch.ones_like(input_ids)
        if batch == "padded batch":
            mask[1, :19] = 0  # 4 ids: one chunk
            mask[2, :9] = 0  # 14 ids: three chunks
        labels = input_ids.masked_fill(mask == 0, -100)
        before = forwards(servers)
        loss = model(input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        assert forwards(servers) - before == CHUNK_LAPS[batch]
        prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        weight = model.intermediate_prompt_embeddings.weight.detach().clone().requires_grad_(True)
        layers = model.config.num_hidden_layers
        with deep_hooks(tiny_reference, weight.view(PRE_SEQ_LEN, layers, -1).permute(1, 0, 2)):
            expected = local_loss(tiny_reference, prompts, input_ids, mask, labels)
        expected.backward()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), (loss.item(), expected.item())
        ours = model.intermediate_prompt_embeddings.weight.grad
        assert float(ours.abs().max()) > 0
        assert close_grads(model.prompt_embeddings.weight.grad, prompts.grad)
        assert close_grads(ours, weight.grad), float((ours - weight.grad).abs().max())
        assert model.last_training_stats.failovers == 0
        assert_freed(servers)
    finally:
        model.shutdown()


@pytest.mark.parametrize("batch", ["one 3-chunk row", "padded batch"])
def test_classification_rows_in_chunks_equal_local_transformers(tiny_llama_path, chunk_swarm, batch):
    from transformers import AutoModelForSequenceClassification

    from swarm import AutoDistributedModelForSequenceClassification

    swarm, servers = chunk_swarm
    model = AutoDistributedModelForSequenceClassification.from_pretrained(
        str(tiny_llama_path), initial_peers=swarm.peers, num_labels=3, tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN
    )
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_llama_path, num_labels=3, dtype="float32")
    try:
        randomized(model, 13)
        with torch.no_grad():
            reference.score.weight.copy_(model.score.weight)
        torch.manual_seed(6)
        pad = model.config.pad_token_id
        shape = SHAPES[batch]
        input_ids = torch.randint(0, model.config.vocab_size, shape)
        input_ids[input_ids == pad] = pad + 1
        mask = torch.ones_like(input_ids)
        if batch == "padded batch":
            mask[1, 4:] = 0  # right padding: 4 ids, one chunk
            mask[2, :9] = 0  # left padding: 14 ids, three chunks
        input_ids = input_ids.masked_fill(mask == 0, pad)
        labels = torch.tensor([2, 0, 1][: shape[0]])
        before = forwards(servers)
        out = model(input_ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert forwards(servers) - before == CHUNK_LAPS[batch]
        prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        weight = model.intermediate_prompt_embeddings.weight.detach().clone().requires_grad_(True)
        layers = model.config.num_hidden_layers
        with deep_hooks(reference, weight.view(PRE_SEQ_LEN, layers, -1).permute(1, 0, 2)):
            expected_logits = local_logits(reference, prompts, input_ids, mask)
        expected = torch.nn.functional.cross_entropy(expected_logits, labels)
        expected.backward()
        # the chunks' attention sums in another order: float32 logits agree to 1e-4 (1.2e-5 of 2.3 seen)
        assert torch.allclose(out.logits, expected_logits, rtol=1e-4, atol=1e-5)
        assert abs(out.loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
        assert float(model.score.weight.grad.abs().max()) > 0
        assert close_grads(model.score.weight.grad, reference.score.weight.grad)
        assert close_grads(model.prompt_embeddings.weight.grad, prompts.grad)
        assert close_grads(model.intermediate_prompt_embeddings.weight.grad, weight.grad)
        assert_freed(servers)
    finally:
        model.shutdown()


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
    relabeled = msgspec.structs.replace(lap(route, 1, 8, range(6)), deep_prompts=True)  # chunk 0 had none
    cases = [
        (lap(route, 2, 8, range(6)), [], ErrorCode.BAD_REQUEST, "out of order; expected chunk 1 at offset 8"),
        (lap(route, 1, 9, range(5)), [], ErrorCode.BAD_REQUEST, "out of order"),
        (lap(route, 0, 0, range(5), True), [], ErrorCode.BAD_REQUEST, "out of order; expected the backward lap"),
        (lap(route, 1, 8, range(6), step_id="nobody"), [], ErrorCode.UNKNOWN_SESSION, "'nobody'"),
        (lap(route, 0, 0, range(5), True, "nobody"), [], ErrorCode.UNKNOWN_SESSION, "'nobody'"),
        (lap(route, 1, 8, range(9)), [], ErrorCode.STEP_TOO_LARGE, "exceeds this server's 8 positions"),
        (lap(route, 0, 0, range(5), num_chunks=limits.MAX_TRAIN_CHUNKS + 1), prompts, ErrorCode.BAD_REQUEST, "256"),
        (lap(route, 1, limits.MAX_TRAIN_ROW_POSITIONS, range(8)), [], ErrorCode.STEP_TOO_LARGE, "a training row"),
        (lap(route, 1, 0, range(8)), [], ErrorCode.BAD_REQUEST, "cannot start at offset 0"),
        (lap(route, 2, 8, range(8), True), [], ErrorCode.BAD_REQUEST, "has no backward_only lap"),
        (relabeled, [], ErrorCode.BAD_REQUEST, "chunk 1's prompts, deep prompts, labels or adapter differ"),
        # a full step's chunk after 40 positions: its attention reads them all, past a step's backward budget
        (lap(route, 1, 40, range(8)), [], ErrorCode.BUSY, "8 positions after 40 earlier positions of its row"),
    ]
    for message, tensors, code, text in cases:
        reply = raw_exchange(tuned, head, message, tensors)
        assert isinstance(reply, ErrorReply) and reply.code == code and text in reply.message, (text, reply)
    # the row's next lap is still the one it expects, and a whole step runs beside it
    reply = raw_exchange(tuned, head, lap(route, 1, 8, range(6)), [])  # as large as a chunk after 8 may be
    assert isinstance(reply, TrainBackward), reply
    loss = tuned(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
    assert torch.isfinite(loss)
    for server in servers:
        server.handler.training.chunks.forget("chunky")


def test_a_failed_steps_rows_are_dropped_on_every_hop_at_once(tuned, chunk_swarm, monkeypatch):
    """The middle server fails chunk 1's backward lap of each row, after the tail ran it: the head and the middle
    forget the failing row (the error passed through them), the tail and every hop of the other row (cancelled)
    would keep theirs until the 120-s step timeout; the client's TrainDrop after each failed attempt (the step
    runs again, 3 failovers, on the swarm's one route) frees them all now."""
    _, servers = chunk_swarm
    chunks = servers[1].handler.training.chunks
    real = chunks._backward

    def failing(message, *args):
        if message.backward_only and message.chunk_index == 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "injected failure of chunk 1's backward lap")
        return real(message, *args)

    monkeypatch.setattr(chunks, "_backward", failing)
    dropped = sum(s.handler.training.stats["train_dropped"] for s in servers)
    torch.manual_seed(8)
    input_ids = torch.randint(0, tuned.config.vocab_size, (2, 21))
    with pytest.raises(GenerationError, match="failed after 3 failovers: .*injected failure"):
        tuned(input_ids, labels=input_ids).loss.backward()  # each attempt fails (and is dropped) on the one route
    assert all(s.handler.training.kept.timeout >= 120 for s in servers)  # expiry is not what frees them

    def freed() -> bool:
        return all(len(s.handler.training.chunks) == 0 and len(s.handler.training.kept) == 0 for s in servers)

    wait_until(freed, "every hop forgot the failed step's rows", timeout=30)
    assert sum(s.handler.training.stats["train_dropped"] for s in servers) > dropped  # the drop freed them
    monkeypatch.undo()
    loss = tuned(input_ids, labels=input_ids).loss  # the servers go on serving long rows
    assert torch.isfinite(loss)
    wait_until(freed, "the good step's rows freed", timeout=30)


def test_a_stale_or_foreign_drop_is_harmless(tuned, chunk_swarm):
    """A drop for steps no hop holds is answered (nothing dropped) and passed on; one for a server off its route
    is refused by name; a row held for the step goes on if the drop is not for it."""
    _, servers = chunk_swarm
    route = [Hop(s.handler.peer_id, start, end) for s, (start, end) in zip(servers, SPANS)]
    head = servers[0].handler.peer_id
    reply = raw_exchange(tuned, head, TrainDrop(step_ids=["nobody", "nobody"], route=route), [])
    assert isinstance(reply, TrainDrop) and reply.step_ids == [], reply
    reply = raw_exchange(tuned, head, TrainDrop(step_ids=["nobody"], route=route[1:]), [])
    assert isinstance(reply, ErrorReply) and "is not on the drop's route" in reply.message, reply
    # a row in chunks held on every hop, then a drop for another step: the row's next lap still runs
    prompts = [torch.zeros(PRE_SEQ_LEN, tuned.config.hidden_size)]
    assert isinstance(raw_exchange(tuned, head, lap(route, 0, 0, range(1, 6), step_id="kept"), prompts), TrainBackward)
    reply = raw_exchange(tuned, head, TrainDrop(step_ids=["other"], route=route), [])
    assert isinstance(reply, TrainDrop) and reply.step_ids == []
    assert isinstance(raw_exchange(tuned, head, lap(route, 1, 8, range(6), step_id="kept"), []), TrainBackward)
    # its own drop frees it on every hop, and a lap after it is refused by name
    reply = raw_exchange(tuned, head, TrainDrop(step_ids=["kept"], route=route), [])
    assert isinstance(reply, TrainDrop) and reply.step_ids == ["kept"]
    wait_until(lambda: all(len(s.handler.training.chunks) == 0 for s in servers), "the row dropped on every hop", 30)
    reply = raw_exchange(tuned, head, lap(route, 2, 14, range(5), step_id="kept"), [])
    assert isinstance(reply, ErrorReply) and "was dropped by its client" in reply.message, reply
