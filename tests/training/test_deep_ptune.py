"""Deep prompt tuning through the swarm (Petals' ``tuning_mode="deep_ptune"``; docs/fine_tuning.md).

Besides the prompts before the ids, every block has ``pre_seq_len`` prompts of its own that the server
adds to the prompt positions of the block's input. The swarm's loss and the gradients of both prompt
tensors are compared with local transformers given ``inputs_embeds = cat(prompts, embed(ids))`` and a
forward pre-hook on each decoder layer that adds that layer's deep prompts (float32; losses 1e-5
relative, gradients 1e-4 of their largest entry). The three in-process servers of test_fine_tuning.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from protocol import limits
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, TrainForward
from tests.training.test_fine_tuning import (  # noqa: F401 - the module's swarm fixture
    MAX_POSITIONS,
    PRE_SEQ_LEN,
    close_grads,
    local_loss,
    raw_exchange,
    route_of,
    tuning_swarm,
)


@pytest.fixture(scope="module")
def deep(tuning_swarm, tiny_llama_path):  # noqa: F811
    from swarm import AutoDistributedModelForCausalLM

    _, peers = tuning_swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=peers, tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN
    )
    yield model
    model.shutdown()


@contextlib.contextmanager
def deep_hooks(reference, deep_prompts: torch.Tensor):
    """Each decoder layer of ``reference`` adds its row of ``deep_prompts`` [blocks, P, hidden] to the first
    P positions of its input (Petals' server: ``hidden_states[:, :P] += prompt`` before each block)."""

    def hook_for(block: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            count = min(deep_prompts.shape[1], hidden.shape[1])
            hidden = torch.cat([hidden[:, :count] + deep_prompts[block, :count], hidden[:, count:]], dim=1)
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        return hook

    handles = [
        layer.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(reference.model.layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def randomize(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        model.prompt_embeddings.weight.normal_(0, 0.5)
        model.intermediate_prompt_embeddings.weight.normal_(0, 0.5)


def deep_of(model) -> torch.Tensor:
    weight = model.intermediate_prompt_embeddings.weight
    return weight.view(PRE_SEQ_LEN, model.config.num_hidden_layers, -1).permute(1, 0, 2)


def test_deep_ptune_parameters_are_petals_names_and_start_at_zero(deep):
    params = dict(deep.named_parameters())
    assert list(params) == ["prompt_embeddings.weight", "intermediate_prompt_embeddings.weight"]
    layers, hidden = deep.config.num_hidden_layers, deep.config.hidden_size
    assert tuple(params["intermediate_prompt_embeddings.weight"].shape) == (PRE_SEQ_LEN, layers * hidden)
    assert all(p.requires_grad for p in params.values())
    assert not params["intermediate_prompt_embeddings.weight"].any()  # zeros at first, as Petals
    assert list(deep.state_dict()) == list(params)


def test_deep_prompt_gradients_equal_local_transformers(deep, tiny_reference, tuning_swarm):  # noqa: F811
    randomize(deep, 21)
    torch.manual_seed(4)
    input_ids = torch.randint(0, deep.config.vocab_size, (2, 9))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0  # left padding on the first row
    labels = input_ids.clone()
    deep.zero_grad()
    loss = deep(input_ids, attention_mask=mask, labels=labels).loss
    loss.backward()

    prompts = deep.prompt_embeddings.weight.detach().clone().requires_grad_(True)
    weight = deep.intermediate_prompt_embeddings.weight.detach().clone().requires_grad_(True)
    layers = deep.config.num_hidden_layers
    with deep_hooks(tiny_reference, weight.view(PRE_SEQ_LEN, layers, -1).permute(1, 0, 2)):
        expected = local_loss(tiny_reference, prompts, input_ids, mask, labels)
    expected.backward()
    without = local_loss(tiny_reference, prompts.detach(), input_ids, mask, labels)
    assert abs(without.item() - expected.item()) > 1e-3  # the deep prompts change the loss
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    ours = deep.intermediate_prompt_embeddings.weight.grad
    assert float(ours.abs().max()) > 0 and float(deep.prompt_embeddings.weight.grad.abs().max()) > 0
    assert close_grads(deep.prompt_embeddings.weight.grad, prompts.grad)
    assert close_grads(ours, weight.grad), (ours - weight.grad).abs().max()
    for server in tuning_swarm[0]:
        assert len(server.handler.training.kept) == 0


def deep_message(route, hop_index=0, ids=(1, 2, 3)) -> TrainForward:
    ids = list(ids)
    return TrainForward(
        step_id="deep1",
        route=route,
        hop_index=hop_index,
        num_prompts=PRE_SEQ_LEN,
        token_ids=ids,
        targets=ids,
        deep_prompts=True,
    )


def test_bad_deep_prompts_get_named_errors_and_the_server_keeps_serving(deep, tuning_swarm):  # noqa: F811
    servers, _ = tuning_swarm
    route, head = route_of(servers), servers[0].handler.peer_id
    layers, hidden = deep.config.num_hidden_layers, deep.config.hidden_size
    prompts, good = torch.zeros(PRE_SEQ_LEN, hidden), torch.zeros(layers, PRE_SEQ_LEN, hidden)
    assert limits.MAX_DEEP_PROMPT_ELEMENTS >= layers * limits.MAX_PROMPT_POSITIONS * hidden
    cases = [
        ([prompts, torch.zeros(layers - 1, PRE_SEQ_LEN, hidden)], "deep prompts must have shape (6, 4, 64)"),
        ([prompts, good.half()], "deep prompts must be float32"),
        ([prompts, good * float("nan")], "not finite"),
        ([prompts], "expected one tensor of deep prompts, got 0"),
    ]
    for tensors, text in cases:
        reply = raw_exchange(deep, head, deep_message(route), tensors)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST and text in reply.message, reply
    # the server goes on serving: a good deep step through the whole route
    randomize(deep, 5)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    assert torch.isfinite(deep(ids, labels=ids).loss)


def test_deep_ptune_arguments_are_checked(tuning_swarm, tiny_llama_path):  # noqa: F811
    from swarm import AutoDistributedModelForCausalLM

    _, peers = tuning_swarm
    for pre_seq_len in (0, limits.MAX_PROMPT_POSITIONS + 1):
        with pytest.raises(ValueError, match="pre_seq_len must be an int in 1..256"):
            AutoDistributedModelForCausalLM.from_pretrained(
                str(tiny_llama_path), initial_peers=peers, tuning_mode="deep_ptune", pre_seq_len=pre_seq_len
            )


def local_deep_greedy(reference, prompts, deep_prompts, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers, greedy, with inputs_embeds = cat(prompts, embed(ids so far)) and the deep hooks."""
    new: list[int] = []
    with torch.no_grad(), deep_hooks(reference, deep_prompts):
        for _ in range(max_new_tokens):
            embeds = torch.cat([prompts, reference.model.embed_tokens(torch.tensor(ids + new))]).unsqueeze(0)
            new.append(int(reference(inputs_embeds=embeds).logits[0, -1].argmax()))
            if new[-1] == eos:
                break
    return new


@pytest.mark.parametrize("speculation", [None, "suffix"])
def test_generate_with_deep_prompts_equals_local_transformers(deep, tiny_reference, speculation):
    randomize(deep, 31)
    prompts, deep_prompts = deep.prompt_embeddings.weight.detach().clone(), deep_of(deep).detach().clone()
    ids, eos = [5, 9, 14, 9, 5, 9, 14], deep.config.eos_token_id
    expected = local_deep_greedy(tiny_reference, prompts, deep_prompts, ids, 12, eos)
    assert expected != local_deep_greedy(tiny_reference, prompts, deep_prompts * 0, ids, 12, eos)
    out = deep.generate(torch.tensor([ids]), max_new_tokens=12, speculation=speculation)
    assert out[0].tolist() == ids + expected
    with deep.inference_session(max_length=64):  # the session keeps its deep prompts across calls
        first = deep.generate(torch.tensor([ids]), max_new_tokens=5, speculation=speculation)
        more = deep.generate(first, max_new_tokens=7, speculation=speculation)
    assert more[0].tolist() == (ids + expected)[: len(ids) + 12]


def test_forward_without_grad_adds_the_deep_prompts(deep, tiny_reference):
    randomize(deep, 37)
    torch.manual_seed(2)
    input_ids = torch.randint(0, deep.config.vocab_size, (1, 6))
    prompts, deep_prompts = deep.prompt_embeddings.weight.detach().clone(), deep_of(deep).detach().clone()
    logits = deep(input_ids).logits
    with torch.no_grad(), deep_hooks(tiny_reference, deep_prompts):
        embeds = torch.cat([prompts, tiny_reference.model.embed_tokens(input_ids[0])]).unsqueeze(0)
        expected = tiny_reference(inputs_embeds=embeds).logits[0, PRE_SEQ_LEN:]
    assert torch.allclose(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_a_session_with_bad_deep_prompts_is_refused_by_name(deep, tuning_swarm):  # noqa: F811
    import hashlib

    from protocol.messages import OpenSession
    from protocol.streams import SESSION_PROTOCOL

    servers, _ = tuning_swarm
    route, head = route_of(servers), servers[0].handler.peer_id
    layers, hidden = deep.config.num_hidden_layers, deep.config.hidden_size
    prompts = torch.zeros(PRE_SEQ_LEN, hidden)

    def opening(session_id: str, num_prompts: int, tensors):
        message = OpenSession(
            session_id=session_id,
            max_length=32,
            route=route,
            hop_index=0,
            secret_hash=hashlib.sha256(b"s").hexdigest(),
            num_prompts=num_prompts,
            deep_prompts=True,
        )
        return raw_exchange(deep, head, message, tensors, protocol=SESSION_PROTOCOL)

    big = MAX_POSITIONS // layers + 1  # blocks x prompts above one step's positions
    for session_id, count, tensors, code, text in [
        ("d1", 4, [prompts, torch.zeros(layers, 3, hidden)], ErrorCode.BAD_REQUEST, "must have shape (6, 4, 64)"),
        ("d2", 4, [prompts, torch.zeros(layers, 4, hidden).half()], ErrorCode.BAD_REQUEST, "must be float32"),
        ("d3", 4, [], ErrorCode.BAD_REQUEST, "expected a tensor of deep prompts"),
        ("d4", big, [torch.zeros(big, hidden)] * 2, ErrorCode.STEP_TOO_LARGE, "blocks x num_prompts"),
    ]:
        reply = opening(session_id, count, tensors)
        assert isinstance(reply, ErrorReply) and reply.code == code and text in reply.message, reply
    assert all(not s.handler.sessions for s in servers)
    assert all(s.handler.budget.free_tokens == s.handler.budget.total_tokens for s in servers)
