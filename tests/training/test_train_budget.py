"""Training steps in the memory plan and under a budget (protocol/train_memory.py, server/train_budget.py).

The backward's activation estimate is checked against what autograd saves on a real span of the tiny Llama;
the plan is checked to count it (and the kept inputs) and to leave it out where spans refuse training; two
in-process servers (blocks 0:3, 3:6) refuse a stranger's rows past the backward budget and past its share of
the kept inputs, naming the bound, while an honest client's training step and generation go on exactly; and a tail
with a small backward budget announces it, so an honest client sends a long row in chunks it takes (and a
classification row, which computes no logits, whole), exactly as local transformers computes them.
"""

from __future__ import annotations

import pytest
import torch

from protocol.dht_records import fetch_servers
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, Hop, TrainForward
from server.memory import HEADROOM_FRACTION, backward_bytes, plan_blocks
from server.quantization import Quant
from server.train_budget import KeptInputs, RowsInFlight
from tests.kit import faults
from tests.kit.reference import PROMPT, greedy_reference
from tests.kit.swarms import start_inprocess
from tests.kit.waiting import wait_until
from tests.training.test_fine_tuning import close_grads, local_loss, raw_exchange

MiB = 1 << 20
PRE_SEQ_LEN = 4


@pytest.fixture(scope="module")
def tiny_config(tiny_llama_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama_path)


def saved_activation_bytes(span, run) -> int:
    """Bytes of the tensors autograd saves while ``run()`` builds its graph, the span's weights left out."""
    weights = {p.untyped_storage().data_ptr() for m in (span.layers, span.norm, span.lm_head) for p in m.parameters()}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


@pytest.mark.parametrize("positions", [8, 64])
@pytest.mark.parametrize("blocks, tail", [(3, False), (6, True)], ids=["middle", "tail"])
def test_the_backward_estimate_covers_what_autograd_keeps(tiny_llama_path, tiny_config, positions, blocks, tail):
    from server.adapters import load_span
    from server.weights import Checkpoint

    span = load_span(tiny_config, Checkpoint(str(tiny_llama_path)), 0, 6, torch.float32, "cpu")

    def run() -> None:
        hidden = torch.randn(1, positions, tiny_config.hidden_size, requires_grad=True)
        out = span.train_span(hidden, range(blocks))
        if tail:
            targets = torch.zeros(positions, dtype=torch.long)
            torch.nn.functional.cross_entropy(span.train_logits(out), targets, reduction="sum")

    measured = saved_activation_bytes(span, run)
    estimate = backward_bytes(tiny_config, torch.float32, positions, blocks, tail)
    # the estimate is the peak: what is saved, and the gradients computed beside it (a bound, not a twin)
    assert measured <= estimate <= 3 * measured, (measured, estimate)


@pytest.mark.parametrize("positions, offset", [(8, 8), (8, 256), (64, 256), (1, 256)])
def test_a_chunks_backward_estimate_covers_the_earlier_keys_and_values(tiny_llama_path, tiny_config, positions, offset):
    """A long row's chunk recomputes after ``offset`` earlier positions whose keys/values are autograd leaves
    (server/train_chunks.py): what autograd keeps grows with them, and the estimate grows with it."""
    from server.adapters import load_span
    from server.train_chunks import TrainCache
    from server.weights import Checkpoint

    span = load_span(tiny_config, Checkpoint(str(tiny_llama_path)), 0, 6, torch.float32, "cpu")
    kv_shape = (1, tiny_config.num_key_value_heads, offset, tiny_config.hidden_size // tiny_config.num_attention_heads)

    def run() -> None:
        past = {
            i: (torch.randn(kv_shape, requires_grad=True), torch.randn(kv_shape, requires_grad=True)) for i in range(3)
        }
        hidden = torch.randn(1, positions, tiny_config.hidden_size, requires_grad=True)
        span.train_span(hidden, range(3), None, TrainCache(offset, past))

    measured = saved_activation_bytes(span, run)
    estimate = backward_bytes(tiny_config, torch.float32, positions, 3, False, offset)
    assert measured > saved_activation_bytes(span, lambda: span.train_span(torch.randn(1, positions, 64), range(3)))
    assert measured <= estimate <= 3 * measured, (measured, estimate)


def test_the_plan_counts_kept_inputs_and_the_largest_backward(tiny_config):
    free = 250 * MiB
    base = plan_blocks(tiny_config, torch.float32, "cpu", 6, free_bytes=free)
    trained = plan_blocks(tiny_config, torch.float32, "cpu", 6, free_bytes=free, training=(16, 512, 0))
    headroom = int(free * HEADROOM_FRACTION)
    for blocks in range(1, 6):
        for tail in (False, True):
            backward = backward_bytes(tiny_config, torch.float32, 512, blocks, tail)
            extra = trained.needed_bytes(blocks, tail=tail) - base.needed_bytes(blocks, tail=tail)
            # the kept inputs, the replies kept for resends (a quarter of them) and the backward past the headroom
            assert extra == 16 * MiB + 4 * MiB + max(0, backward - headroom), (blocks, tail)
    # 512 positions of float32 logits at the tail (3 x 49,152 x 4 bytes each) do not fit in 250 MiB
    assert base.tail_blocks == 5 and trained.tail_blocks == 0 and trained.most_blocks() == 4
    assert "more for training steps" in trained.describe("cpu")
    assert "replies kept for resends: 0.00 GiB" in trained.describe("cpu")
    # the replies' share decides: a plan whose kept inputs and replies fill what a middle block leaves
    one_block = base.needed_bytes(1) + max(0, backward_bytes(tiny_config, torch.float32, 512, 1, False) - headroom)
    room = (free - one_block) >> 20  # MiB a middle span of one block leaves for the kept inputs and replies
    fits = plan_blocks(tiny_config, torch.float32, "cpu", 6, free_bytes=free, training=(room * 4 // 5, 512, 0))
    past = plan_blocks(tiny_config, torch.float32, "cpu", 6, free_bytes=free, training=(room * 4 // 5 + 2, 512, 0))
    assert fits.most_blocks() >= 1 and past.most_blocks() == 0, (room, fits.most_blocks(), past.most_blocks())
    # --max-backward-mib: a flat budget instead, which fits
    capped = plan_blocks(tiny_config, torch.float32, "cpu", 6, free_bytes=free, training=(16, 512, 64))
    assert capped.backward_budget(5, True) == 64 * MiB and capped.tail_blocks == 5
    # spans that refuse training (quantized) keep no room for it
    int8 = plan_blocks(tiny_config, torch.float32, "cpu", 6, free_bytes=free, quant=Quant.INT8, training=(16, 512, 0))
    assert int8.train_bytes(5, True) == 0


def test_kept_inputs_and_rows_are_shared_per_peer():
    kept = KeptInputs(max_bytes=1000, timeout=60.0)
    kept.keep("a1", torch.zeros(100), owner="stranger")  # 400 bytes
    with pytest.raises(ProtocolError, match="peer stranger already keeps 400 bytes.*its share of 500") as refused:
        kept.keep("a2", torch.zeros(50), owner="stranger")
    assert refused.value.code == ErrorCode.BUSY
    kept.keep("b1", torch.zeros(100), owner="honest")  # another peer has its own half
    kept.keep("s1", torch.zeros(50), owner=None)  # a forwarding server: the server-wide bound only
    with pytest.raises(ProtocolError, match="no room to keep"):
        kept.keep("s2", torch.zeros(10), owner=None)
    kept.take("a1")
    assert kept.held_by("stranger") == 0 and kept.held_by("honest") == 400

    rows = RowsInFlight(limit=4)
    with rows.admitted("stranger"), rows.admitted("stranger"):
        with pytest.raises(ProtocolError, match="peer stranger already has 2 training steps in flight"):
            with rows.admitted("stranger"):
                pass
        with rows.admitted("honest"), rows.admitted(None):
            with pytest.raises(ProtocolError, match="4 training steps are in flight"):
                with rows.admitted("other"):
                    pass
    assert rows.total == 0 and rows.held_by("stranger") == 0


@pytest.fixture(scope="module")
def budget_swarm(tiny_llama_path):
    options = dict(tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN)
    swarm = start_inprocess(tiny_llama_path, client_options=options, max_positions_per_step=64)
    from swarm import AutoDistributedModelForCausalLM

    stranger = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=swarm.peers, **options
    )
    yield swarm, stranger
    stranger.shutdown()
    swarm.stop()


def train_step(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), model.prompt_embeddings.weight.grad.clone()


def test_a_strangers_rows_past_the_budget_are_refused_while_others_train_and_generate(
    budget_swarm, tiny_reference, tiny_config
):
    from client.errors import GenerationError

    swarm, stranger = budget_swarm
    honest, (head, tail) = swarm.model, swarm.servers
    torch.manual_seed(4)
    short, long, pair = (torch.randint(0, tiny_config.vocab_size, shape) for shape in [(1, 8), (1, 48), (2, 8)])
    # the tail's backward budget holds a row of 8 ids (+ 4 prompts), not one of 48
    tail.handler.training.max_backward_bytes = backward_bytes(tiny_config, torch.float32, PRE_SEQ_LEN + 20, 3, True)
    # the head keeps each row's prompts (4 x 64 float32: 1 KiB) until its backward: two rows fit in all, one per peer
    head.handler.training.kept.max_bytes = 2048
    faults.slow_training(tail.handler.span, 0.5)  # so both rows of a step are in flight at the head at once
    try:
        # a stranger that ignores the budget the tail announces sends the 52-position row whole: refused by name
        route = [Hop(head.handler.peer_id, 0, 3), Hop(tail.handler.peer_id, 3, 6)]
        ids = long[0].tolist()
        row = TrainForward(
            step_id="long", route=route, hop_index=0, num_prompts=PRE_SEQ_LEN, token_ids=ids, targets=ids
        )
        reply = raw_exchange(stranger, head.handler.peer_id, row, [torch.zeros(PRE_SEQ_LEN, tiny_config.hidden_size)])
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BUSY, reply
        assert "a backward of 52 positions through 3 blocks and the LM head needs" in reply.message, reply
        assert tail.handler.training.stats["train_refused"] >= 1  # the tail refused it; the head relayed it
        with pytest.raises(
            GenerationError, match=r"already keeps 1024 bytes of training inputs here: .* share of 1024"
        ):
            train_step(stranger, pair)

        loss, grad = train_step(honest, short)  # an honest client's row: exact, as locally
        prompts = honest.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        expected = local_loss(tiny_reference, prompts, short, torch.ones_like(short), short)
        expected.backward()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
        assert close_grads(grad, prompts.grad)
        plain = plain_generation(honest)
        assert plain == greedy_reference(tiny_reference, PROMPT, 8), "sessions go on beside refused training"
    finally:
        del tail.handler.span.train_span  # the span's own method again
        tail.handler.training.max_backward_bytes = 0  # the default: what max_positions_per_step positions need
        head.handler.training.kept.max_bytes = 256 * MiB
    for server in swarm.servers:
        assert len(server.handler.training.kept) == 0 and server.handler.training.in_flight == 0


def announced_budget(model, peer_id: str) -> int:
    """The backward budget ``peer_id``'s record announces, as ``model``'s client reads it from the DHT."""
    infos = fetch_servers(model.swarm.dht, model.swarm.model, 6)
    return next((info.max_backward_bytes for info in infos if info.peer_id == peer_id), -1)


def test_a_long_row_goes_in_chunks_that_fit_a_tails_small_backward_budget(
    budget_swarm, tiny_reference, tiny_config, tiny_llama_path
):
    """The tail runs with 8 MiB of backward budget (``--max-backward-mib 8``; its default holds a 64-position row,
    whose logits alone are 36 MiB): its records announce it, and the client sends a 44-position row (4 prompts +
    40 ids: one step of 64) in the chunks the tail takes instead of whole, which the tail would refuse. Loss and
    prompt gradients equal local transformers over the whole row (loss 1e-5 relative, gradients 1e-4 of their
    largest entry); the tail refused nothing. A classification row of the same ids goes whole: its tail scores one
    position with the score head and computes no logits, so the tail's check and the client's sizing leave them
    out (its logits, loss and gradients equal local transformers'; counted with the logits it would be refused)."""
    swarm, _ = budget_swarm
    honest, tail = swarm.model, swarm.servers[1]
    training = tail.handler.training
    small = 8 << 20
    default = training.backward_budget  # a row of 64 positions through 3 blocks and the LM head
    assert default > small
    wait_until(lambda: announced_budget(honest, tail.handler.peer_id) == default, "the default budget announced", 30)
    training.max_backward_bytes = small  # what --max-backward-mib 8 sets (server/server_config.py train_limits)
    try:
        wait_until(lambda: announced_budget(honest, tail.handler.peer_id) == small, "the small budget announced", 30)
        torch.manual_seed(5)
        ids = torch.randint(0, tiny_config.vocab_size, (1, 40))
        assert backward_bytes(tiny_config, torch.float32, PRE_SEQ_LEN + 40, 3, True) > 3 * small  # whole: refused
        refused, forwards = training.stats["train_refused"], training.stats["train_forwards"]
        loss, grad = train_step(honest, ids)
        assert training.stats["train_forwards"] - forwards == 4  # chunks of 9, 13, 13 and 5 ids
        assert training.stats["train_refused"] == refused
        prompts = honest.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        expected = local_loss(tiny_reference, prompts, ids, torch.ones_like(ids), ids)
        expected.backward()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), (loss.item(), expected.item())
        assert float(grad.abs().max()) > 0
        assert close_grads(grad, prompts.grad), float((grad - prompts.grad).abs().max())
        classify_through_the_small_tail(swarm, tiny_llama_path, ids, training)
    finally:
        training.max_backward_bytes = 0
    for server in swarm.servers:
        assert len(server.handler.training.chunks) == 0 and len(server.handler.training.kept) == 0


def classify_through_the_small_tail(swarm, path, ids: torch.Tensor, training) -> None:
    from transformers import AutoModelForSequenceClassification

    from swarm import AutoDistributedModelForSequenceClassification
    from tests.training.test_classification import local_logits

    model = AutoDistributedModelForSequenceClassification.from_pretrained(
        str(path), initial_peers=swarm.peers, num_labels=2, tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN
    )
    reference = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, dtype="float32")
    try:
        torch.manual_seed(6)
        with torch.no_grad():
            model.prompt_embeddings.weight.normal_(0, 0.5)
            reference.score.weight.copy_(model.score.weight)
        config = model.config
        assert backward_bytes(config, torch.float32, PRE_SEQ_LEN + 40, 3, True) > training.max_backward_bytes
        forwards, labels = training.stats["train_forwards"], torch.tensor([1])
        out = model(ids, attention_mask=torch.ones_like(ids), labels=labels)
        out.loss.backward()
        assert training.stats["train_forwards"] - forwards == 1  # one lap: the row whole
        prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        expected_logits = local_logits(reference, prompts, ids, torch.ones_like(ids))
        expected = torch.nn.functional.cross_entropy(expected_logits, labels)
        expected.backward()
        assert torch.allclose(out.logits, expected_logits, rtol=1e-5, atol=1e-6)
        assert abs(out.loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
        assert close_grads(model.score.weight.grad, reference.score.weight.grad)
        assert close_grads(model.prompt_embeddings.weight.grad, prompts.grad)
    finally:
        model.shutdown()


def plain_generation(model) -> list[list[int]]:
    """Greedy PROMPT and its continuation through the swarm without the tuned prompts (the sessions path)."""
    prompts, model.prompt_embeddings = model.prompt_embeddings, None
    try:
        return model.generate(torch.tensor(PROMPT), max_new_tokens=8).tolist()
    finally:
        model.prompt_embeddings = prompts
