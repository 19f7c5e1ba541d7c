"""Prompt tuning through the swarm (docs/design.md, "Fine-tuning"; docs/fine_tuning.md): the backward lap.

Three servers of the tiny random Llama (blocks 0:2, 2:4, 4:6) run in this process, so a test can look at
what they keep. The swarm's loss and prompt gradients are compared with local transformers given
``inputs_embeds = cat(prompts, embed(ids))`` and the forward pass's own loss (client._masks.causal_lm_loss)
over the ids' logits; a few Adam steps through the swarm follow the same steps done locally. Tolerances
(float32): losses 1e-5 relative, gradients 1e-4 of their largest entry; after Adam steps, 1e-4 of the loss.
"""

from __future__ import annotations

import pytest
import torch

from client import _loop
from client._masks import causal_lm_loss
from protocol import limits
from protocol.dht import make_dht
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, Hop, TrainBackward, TrainForward
from protocol.streams import TRAIN_PROTOCOL, MessageStream
from server.training import KeptInputs

SPANS = [(0, 2), (2, 4), (4, 6)]
MAX_POSITIONS = 64
PRE_SEQ_LEN = 4


@pytest.fixture(scope="module")
def tuning_swarm(tiny_llama_path):
    """Three in-process servers and their DHT's peers; everything stops after the module."""
    from server.span_server import ServerConfig, SpanServer

    bootstrap = make_dht(host="127.0.0.1")
    peers = [str(m) for m in bootstrap.get_visible_maddrs()]

    async def start():
        common = dict(
            model=str(tiny_llama_path),
            initial_peers=peers,
            host="127.0.0.1",
            reachability="public",
            update_period=2.0,
            torch_threads=1,
            max_positions_per_step=MAX_POSITIONS,
        )
        return [await SpanServer.create(ServerConfig(blocks=blocks, **common)) for blocks in SPANS]

    servers = _loop.run(start(), timeout=240)
    yield servers, peers
    for server in servers:
        _loop.run(server.shutdown(), timeout=60)
    bootstrap.shutdown()


@pytest.fixture(scope="module")
def tuned(tuning_swarm, tiny_llama_path):
    from swarm import AutoDistributedModelForCausalLM

    _, peers = tuning_swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=peers, tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN
    )
    yield model
    model.shutdown()


def local_loss(reference, prompts: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor):
    """transformers with inputs_embeds = cat(prompts, embed(ids)) per row (its padding removed), the ids'
    logits put back in the padded batch, and the forward pass's causal-LM loss over them."""
    logits = torch.zeros(*input_ids.shape, reference.config.vocab_size)
    for i in range(input_ids.shape[0]):
        keep = mask[i].bool()
        embeds = torch.cat([prompts, reference.model.embed_tokens(input_ids[i][keep])]).unsqueeze(0)
        row_logits = reference(inputs_embeds=embeds).logits[0, prompts.shape[0] :]
        logits = logits.index_put((torch.tensor([i]), keep.nonzero().flatten()), row_logits)
    return causal_lm_loss(logits, labels, mask)


def close_grads(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-4) -> bool:
    return float((ours - theirs).abs().max()) <= rel * float(theirs.abs().max()) + 1e-7


def test_tuning_arguments_are_consumed_and_checked(tuning_swarm, tiny_llama_path):
    from swarm import AutoDistributedModelForCausalLM

    _, peers = tuning_swarm
    for bad, match in [
        (dict(tuning_mode="bogus", pre_seq_len=4), "unknown tuning_mode 'bogus'"),
        (dict(tuning_mode="ptune", pre_seq_len=0), "pre_seq_len must be an int in 1..256"),
        (dict(tuning_mode="ptune", pre_seq_len=limits.MAX_PROMPT_POSITIONS + 1), "pre_seq_len must be"),
        (dict(pre_seq_len=4), "needs a tuning_mode"),
    ]:
        with pytest.raises(ValueError, match=match):
            AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=peers, **bad)


def test_the_model_is_a_module_whose_only_parameters_are_the_prompts(tuned):
    assert isinstance(tuned, torch.nn.Module)
    params = dict(tuned.named_parameters())
    assert list(params) == ["prompt_embeddings.weight"]
    assert params["prompt_embeddings.weight"].requires_grad
    assert tuple(params["prompt_embeddings.weight"].shape) == (PRE_SEQ_LEN, tuned.config.hidden_size)
    assert "tuning_mode" not in tuned.config.to_dict() and "pre_seq_len" not in tuned.config.to_dict()
    state = tuned.state_dict()
    assert list(state) == ["prompt_embeddings.weight"]
    tuned.load_state_dict(state)


def test_prompt_gradients_equal_local_transformers(tuned, tiny_reference, tuning_swarm):
    torch.manual_seed(3)
    input_ids = torch.randint(0, tuned.config.vocab_size, (2, 10))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left padding on the second row
    labels = input_ids.clone()
    labels[0, 5] = -100
    tuned.zero_grad()
    loss = tuned(input_ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    ours = tuned.prompt_embeddings.weight.grad.clone()

    prompts = tuned.prompt_embeddings.weight.detach().clone().requires_grad_(True)
    expected = local_loss(tiny_reference, prompts, input_ids, mask, labels)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    assert float(ours.abs().max()) > 0
    assert close_grads(ours, prompts.grad), (ours - prompts.grad).abs().max()
    for server in tuning_swarm[0]:
        assert len(server.handler.training.kept) == 0  # every kept input was freed after its backward


def test_adam_steps_lower_the_loss_as_local_training_does(tuned, tiny_reference):
    torch.manual_seed(5)
    start = torch.randn(PRE_SEQ_LEN, tuned.config.hidden_size) * 0.02
    input_ids = torch.randint(0, tuned.config.vocab_size, (2, 8))
    with torch.no_grad():
        tuned.prompt_embeddings.weight.copy_(start)
    optimizer = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=0.05)
    local = start.clone().requires_grad_(True)
    local_optimizer = torch.optim.Adam([local], lr=0.05)
    mask = torch.ones_like(input_ids)
    swarm_losses, local_losses = [], []
    for _ in range(4):
        optimizer.zero_grad()
        loss = tuned(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        swarm_losses.append(loss.item())
        local_optimizer.zero_grad()
        expected = local_loss(tiny_reference, local, input_ids, mask, input_ids)
        expected.backward()
        local_optimizer.step()
        local_losses.append(expected.item())
    assert swarm_losses[-1] < swarm_losses[0]
    for ours, theirs in zip(swarm_losses, local_losses):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), (swarm_losses, local_losses)
    assert close_grads(tuned.prompt_embeddings.weight.detach(), local.detach(), rel=1e-4)


# ---- bad input: a named error, and the server goes on serving ----


def raw_exchange(model, peer_id: str, message, tensors, protocol: str = TRAIN_PROTOCOL):
    async def go():
        from hivemind.p2p import PeerID

        stream = await MessageStream.open(model.swarm.p2p, PeerID.from_base58(peer_id), protocol)
        try:
            await stream.send(message, tensors)
            return await stream.receive()
        finally:
            stream.close()

    return _loop.run(go(), timeout=60).message


def declare_frame(model, peer_id: str, length: int):
    """Only a frame header declaring ``length`` bytes; the server's answer."""
    from hivemind.p2p import P2P, PeerID

    async def go():
        stream = await MessageStream.open(model.swarm.p2p, PeerID.from_base58(peer_id), TRAIN_PROTOCOL)
        try:
            stream.writer.write(P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            await stream.writer.drain()
            return await stream.receive()
        finally:
            stream.close()

    return _loop.run(go(), timeout=60).message


def route_of(servers) -> list[Hop]:
    return [Hop(s.handler.peer_id, start, end) for s, (start, end) in zip(servers, SPANS)]


def forward_message(route, hop_index=0, num_prompts=PRE_SEQ_LEN, ids=(1, 2, 3)) -> TrainForward:
    ids = list(ids)
    return TrainForward(
        step_id="bad1", route=route, hop_index=hop_index, num_prompts=num_prompts, token_ids=ids, targets=ids
    )


def test_bad_training_requests_get_named_errors_and_the_server_keeps_serving(tuned, tuning_swarm):
    servers, _ = tuning_swarm
    route, head, hidden = route_of(servers), servers[0].handler.peer_id, tuned.config.hidden_size
    zeros = torch.zeros(PRE_SEQ_LEN, hidden)
    cases = [
        (forward_message(route), [torch.zeros(PRE_SEQ_LEN + 1, hidden)], ErrorCode.BAD_REQUEST, "must have shape"),
        (forward_message(route), [zeros.half()], ErrorCode.BAD_REQUEST, "must be float32"),
        (forward_message(route), [zeros * float("nan")], ErrorCode.BAD_REQUEST, "not finite"),
        (forward_message(route), [], ErrorCode.BAD_REQUEST, "expected one tensor"),
        (forward_message(route, num_prompts=limits.MAX_PROMPT_POSITIONS + 1), [zeros], ErrorCode.BAD_REQUEST, "0..256"),
        (forward_message(route, ids=range(MAX_POSITIONS)), [zeros], ErrorCode.STEP_TOO_LARGE, "exceeds"),
        (forward_message(route, ids=[10**7]), [zeros], ErrorCode.TOKEN_OUT_OF_VOCAB, "vocabulary"),
        (TrainBackward(step_id="nope", loss_sum=0.0, num_targets=0), [], ErrorCode.UNKNOWN_SESSION, "'nope'"),
    ]
    for message, tensors, code, text in cases:
        reply = raw_exchange(tuned, head, message, tensors)
        assert isinstance(reply, ErrorReply) and reply.code == code and text in reply.message, (code, reply)
    # oversize: a frame above what max_positions_per_step positions need is refused before it is read
    training = servers[0].handler.training
    deep = limits.deep_prompt_elements(training.span.num_blocks, hidden)
    assert training.max_frame_bytes == limits.train_frame_bytes((hidden,), MAX_POSITIONS, deep)
    reply = declare_frame(tuned, head, training.max_frame_bytes + 1)
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.FRAME_TOO_LARGE, reply
    # past the head, only the route's previous hop may send a row
    reply = raw_exchange(tuned, servers[1].handler.peer_id, forward_message(route, 1), [torch.zeros(7, hidden)])
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNAUTHORIZED
    loss = tuned(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
    assert torch.isfinite(loss)


def test_kept_inputs_are_bounded_in_bytes_and_time():
    kept = KeptInputs(max_bytes=1000, timeout=60.0)
    kept.keep("a", torch.zeros(200))  # 800 bytes
    with pytest.raises(ProtocolError, match="no room to keep"):
        kept.keep("b", torch.zeros(100))
    assert kept.take("a").numel() == 200 and len(kept) == 0
    with pytest.raises(ProtocolError, match="no input of training step 'a'"):
        kept.take("a")
    stale = KeptInputs(max_bytes=1000, timeout=-1.0)  # every input is already past its time
    stale.keep("c", torch.zeros(10))
    assert "c" not in stale
    with pytest.raises(ProtocolError) as refused:
        stale.take("c")
    assert refused.value.code == ErrorCode.UNKNOWN_SESSION


def test_a_server_lost_mid_step_fails_the_step_and_the_client_runs_it_again(
    tuned, tiny_reference, tuning_swarm, caplog
):
    """The middle server drops its stream once mid-step (as a dying server's stream ends): the head frees
    its kept input and reports downstream_failed, and the client runs the whole step again, with the
    gradients of a step that never failed."""
    servers, _ = tuning_swarm
    middle = servers[1].handler.training
    real_step, dropped = middle._step, []

    async def die_once(message, tensors, upstream):
        if not dropped:
            dropped.append(message.step_id)
            upstream.close()  # the stream ends without a reply
            raise ConnectionError("server lost")
        return await real_step(message, tensors, upstream)

    middle._step = die_once
    try:
        input_ids = torch.tensor([[11, 12, 13, 14, 15, 16]])
        tuned.zero_grad()
        with caplog.at_level("WARNING", logger="client._training"):
            loss = tuned(input_ids, labels=input_ids).loss
        loss.backward()
    finally:
        middle._step = real_step
    assert dropped and any("running it again on a new route" in r.message for r in caplog.records)
    assert all(len(server.handler.training.kept) == 0 for server in servers)
    prompts = tuned.prompt_embeddings.weight.detach().clone().requires_grad_(True)
    expected = local_loss(tiny_reference, prompts, input_ids, torch.ones_like(input_ids), input_ids)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    assert close_grads(tuned.prompt_embeddings.weight.grad, prompts.grad)


def local_prompted_greedy(reference, prompts: torch.Tensor, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers, greedy, with inputs_embeds = cat(prompts, embed(ids so far)) at every step."""
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            embeds = torch.cat([prompts, reference.model.embed_tokens(torch.tensor(ids + new))]).unsqueeze(0)
            new.append(int(reference(inputs_embeds=embeds).logits[0, -1].argmax()))
            if new[-1] == eos:
                break
    return new


@pytest.mark.parametrize("speculation", [None, "suffix"])
def test_generate_with_tuned_prompts_equals_local_transformers(tuned, tiny_reference, speculation):
    torch.manual_seed(11)
    with torch.no_grad():
        tuned.prompt_embeddings.weight.normal_(0, 0.5)  # far from zero: the prompts change the output
    prompts = tuned.prompt_embeddings.weight.detach().clone()
    ids = [5, 9, 14, 9, 5, 9, 14]
    eos = tuned.config.eos_token_id
    expected = local_prompted_greedy(tiny_reference, prompts, ids, 12, eos)
    without = local_prompted_greedy(tiny_reference, prompts[:0], ids, 12, eos)
    assert expected != without
    out = tuned.generate(torch.tensor([ids]), max_new_tokens=12, speculation=speculation)
    assert out[0].tolist() == ids + expected
    # an inference session continues the same sequence, the prompts still in front
    with tuned.inference_session(max_length=64):
        first = tuned.generate(torch.tensor([ids]), max_new_tokens=5, speculation=speculation)
        more = tuned.generate(first, max_new_tokens=7, speculation=speculation)
    assert more[0].tolist() == (ids + expected)[: len(ids) + 12]
    with pytest.raises(ValueError, match="repetition_penalty"):
        tuned.generate(torch.tensor([ids]), max_new_tokens=2, repetition_penalty=1.2)


def test_an_open_session_with_bad_prompts_is_refused_by_name(tuned, tuning_swarm):
    import hashlib

    from protocol.messages import OpenSession
    from protocol.streams import SESSION_PROTOCOL

    servers, _ = tuning_swarm
    route, head, hidden = route_of(servers), servers[0].handler.peer_id, tuned.config.hidden_size
    secret_hash = hashlib.sha256(b"s").hexdigest()

    def opening(session_id: str, num_prompts: int, tensors):
        message = OpenSession(
            session_id=session_id,
            max_length=32,
            route=route,
            hop_index=0,
            secret_hash=secret_hash,
            num_prompts=num_prompts,
        )
        return raw_exchange(tuned, head, message, tensors, protocol=SESSION_PROTOCOL)

    for session_id, count, tensors, text in [
        ("p1", 4, [torch.zeros(5, hidden)], "must have shape (4, 64)"),
        ("p2", 4, [torch.zeros(4, hidden).half()], "must be float32"),
        ("p3", 33, [torch.zeros(33, hidden)], "num_prompts must be in 0..32"),
        ("p4", 0, [torch.zeros(4, hidden)], "only to the head, with num_prompts"),
    ]:
        reply = opening(session_id, count, tensors)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST and text in reply.message, reply
    assert all(not s.handler.sessions for s in servers)  # nothing was opened, nothing reserved
    assert all(s.handler.budget.free_tokens == s.handler.budget.total_tokens for s in servers)


def test_forward_without_grad_gives_the_logits_and_loss_after_the_prompts(tuned, tiny_reference):
    """No labels, or labels under torch.no_grad(): a forward lap whose sessions carry the prompts, the ids'
    logits as local transformers gives them after cat(prompts, embed(ids)), and the training step's loss."""
    torch.manual_seed(13)
    input_ids = torch.randint(0, tuned.config.vocab_size, (2, 7))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0
    prompts = tuned.prompt_embeddings.weight.detach().clone()
    logits = tuned(input_ids, attention_mask=mask).logits
    with torch.no_grad():
        for i in range(2):
            keep = mask[i].bool()
            embeds = torch.cat([prompts, tiny_reference.model.embed_tokens(input_ids[i][keep])]).unsqueeze(0)
            expected = tiny_reference(inputs_embeds=embeds).logits[0, PRE_SEQ_LEN:]
            assert torch.allclose(logits[i][keep], expected, atol=1e-4, rtol=1e-4)
            assert not logits[i][~keep].any()
        evaluated = tuned(input_ids, attention_mask=mask, labels=input_ids).loss
    trained = tuned(input_ids, attention_mask=mask, labels=input_ids).loss
    assert evaluated.grad_fn is None and trained.grad_fn is not None
    assert abs(evaluated.item() - trained.item()) <= 1e-5 * abs(trained.item())


def test_training_steps_past_the_in_flight_cap_are_refused_busy(tuned, tuning_swarm):
    servers, _ = tuning_swarm
    training = servers[0].handler.training
    assert training.max_in_flight == limits.MAX_TRAIN_STEPS_IN_FLIGHT
    message, prompts = forward_message(route_of(servers)), [torch.zeros(PRE_SEQ_LEN, tuned.config.hidden_size)]
    training.max_in_flight = 0  # as if every slot were taken
    try:
        reply = raw_exchange(tuned, training.peer_id, message, prompts)
    finally:
        training.max_in_flight = limits.MAX_TRAIN_STEPS_IN_FLIGHT
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BUSY and "in flight" in reply.message
    reply = raw_exchange(tuned, training.peer_id, message, prompts)  # a slot is free again: computed
    assert isinstance(reply, TrainBackward) and reply.num_targets == 3 and training.in_flight == 0


def test_spans_without_a_backward_refuse_a_training_step_in_one_line():
    """Quantized Llama spans and DeepSeek-V4 spans refuse (bad_request) before computing anything."""
    import asyncio
    from types import SimpleNamespace

    from server.adapters.deepseek_v4 import DeepseekV4Adapter
    from server.adapters.llama import LlamaFamilyAdapter
    from server.quantization import Quant
    from server.training import TrainingHandler

    quantized = LlamaFamilyAdapter.__new__(LlamaFamilyAdapter)
    quantized.quant = Quant.INT8
    assert quantized.backward_refusal() == "a int8 span does not support backward (training); serve it unquantized"
    deepseek = DeepseekV4Adapter.__new__(DeepseekV4Adapter)
    assert deepseek.backward_refusal() == "DeepseekV4Adapter spans do not support backward (training) yet"

    span = SimpleNamespace(start=0, end=6, num_blocks=6, hidden_shape=(64,), vocab_size=100)
    span.backward_refusal = quantized.backward_refusal
    handler = TrainingHandler(SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")), span, None)
    route = [Hop("me", 0, 6)]
    with pytest.raises(ProtocolError) as refused:
        asyncio.run(handler._admitted_step(forward_message(route), [torch.zeros(PRE_SEQ_LEN, 64)], None))
    assert refused.value.code == ErrorCode.BAD_REQUEST and "int8" in refused.value.message
    assert handler.in_flight == 0 and len(handler.kept) == 0
