"""Sequence classification through the swarm (Petals' ``Distributed*ForSequenceClassification``;
docs/fine_tuning.md): a trainable ``score`` head on the client over the final hidden state the tail
returns for each row's last kept position.

Compared with local transformers' LlamaForSequenceClassification with the same score weights, prompts via
``inputs_embeds`` (float32): logits and loss 1e-5 relative, gradients of ``score`` and of the prompts 1e-4
of their largest entry, on a padded batch. The three in-process servers of test_fine_tuning.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, TrainForward
from tests.training.test_deep_ptune import deep_hooks
from tests.training.test_fine_tuning import (  # noqa: F401 - the module's swarm fixture
    PRE_SEQ_LEN,
    close_grads,
    raw_exchange,
    route_of,
    tuning_swarm,
)

NUM_LABELS = 3


@pytest.fixture(scope="module")
def local_classifier(tiny_llama_path):
    from transformers import AutoModelForSequenceClassification

    def make(num_labels: int):
        model = AutoModelForSequenceClassification.from_pretrained(
            tiny_llama_path, num_labels=num_labels, dtype="float32"
        )
        return model.eval()

    return make


def classifier(tiny_llama_path, peers, **kwargs):
    from swarm import AutoDistributedModelForSequenceClassification

    return AutoDistributedModelForSequenceClassification.from_pretrained(
        str(tiny_llama_path), initial_peers=peers, **kwargs
    )


def local_logits(reference, prompts: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' classifier per row: inputs_embeds = cat(prompts, embed(kept ids)), scored at the last."""
    rows = []
    for ids, keep in zip(input_ids, mask):
        embeds = torch.cat([prompts, reference.model.embed_tokens(ids[keep.bool()])]).unsqueeze(0)
        rows.append(reference(inputs_embeds=embeds).logits[0])
    return torch.stack(rows)


def padded_batch(vocab: int, pad: int, seed: int):
    torch.manual_seed(seed)
    input_ids = torch.randint(0, vocab, (3, 8))
    input_ids[input_ids == pad] = pad + 1
    mask = torch.ones_like(input_ids)
    mask[0, 5:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return input_ids.masked_fill(mask == 0, pad), mask


@pytest.mark.parametrize("tuning_mode", ["ptune", "deep_ptune"])
def test_classifier_logits_loss_and_gradients_equal_local_transformers(
    tuning_swarm,  # noqa: F811
    tiny_llama_path,
    local_classifier,
    tuning_mode,
):
    model = classifier(
        tiny_llama_path, tuning_swarm[1], num_labels=NUM_LABELS, tuning_mode=tuning_mode, pre_seq_len=PRE_SEQ_LEN
    )
    try:
        names = ["score.weight", "prompt_embeddings.weight"]
        names += ["intermediate_prompt_embeddings.weight"] if tuning_mode == "deep_ptune" else []
        assert [n for n, _ in model.named_parameters()] == names
        assert model.config.num_labels == NUM_LABELS
        reference = local_classifier(NUM_LABELS)
        with torch.no_grad():
            for param in model.parameters():
                if param is not model.score.weight:
                    param.normal_(0, 0.5)
            reference.score.weight.copy_(model.score.weight)
        input_ids, mask = padded_batch(model.config.vocab_size, model.config.pad_token_id, 7)
        labels = torch.tensor([2, 0, 1])
        out = model(input_ids, attention_mask=mask, labels=labels)
        out.loss.backward()

        prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        deep = model.intermediate_prompt_embeddings
        weight = torch.zeros(PRE_SEQ_LEN, 0) if deep is None else deep.weight.detach().clone().requires_grad_(True)
        layers = model.config.num_hidden_layers
        hooks = deep_hooks(reference, weight.view(PRE_SEQ_LEN, layers, -1).permute(1, 0, 2)) if deep else nullcontext()
        with hooks:
            expected_logits = local_logits(reference, prompts, input_ids, mask)
        expected = torch.nn.functional.cross_entropy(expected_logits, labels)
        expected.backward()
        if deep is not None:
            assert close_grads(deep.weight.grad, weight.grad)
        assert torch.allclose(out.logits, expected_logits, rtol=1e-5, atol=1e-6)
        assert abs(out.loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
        assert float(model.prompt_embeddings.weight.grad.abs().max()) > 0
        assert close_grads(model.score.weight.grad, reference.score.weight.grad)
        assert close_grads(model.prompt_embeddings.weight.grad, prompts.grad)
        # without grad: a forward pass (no backward lap) gives the same logits and loss
        with torch.no_grad():
            evaluated = model(input_ids, attention_mask=mask, labels=labels)
        assert torch.allclose(evaluated.logits, expected_logits, rtol=1e-4, atol=1e-5)
        assert abs(evaluated.loss.item() - expected.item()) <= 1e-4 * abs(expected.item())
        assert all(len(server.handler.training.kept) == 0 for server in tuning_swarm[0])
    finally:
        model.shutdown()


def test_untuned_classifier_pools_the_last_token_as_transformers_does_and_regresses(
    tuning_swarm,  # noqa: F811
    tiny_llama_path,
    local_classifier,
):
    """No prompts: transformers' own padded-batch call (it finds each row's last token by pad_token_id);
    num_labels=1 is regression (mean squared error)."""
    model = classifier(tiny_llama_path, tuning_swarm[1], num_labels=1)
    try:
        reference = local_classifier(1)
        with torch.no_grad():
            reference.score.weight.copy_(model.score.weight)
        input_ids, mask = padded_batch(model.config.vocab_size, model.config.pad_token_id, 9)
        input_ids, mask = input_ids[:2], mask[:2]  # right padding and none (transformers pools by pad id)
        labels = torch.tensor([0.5, -1.25])
        out = model(input_ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        expected = reference(input_ids, attention_mask=mask, labels=labels)
        expected.loss.backward()
        assert torch.allclose(out.logits, expected.logits, rtol=1e-5, atol=1e-6)
        assert abs(out.loss.item() - expected.loss.item()) <= 1e-5 * abs(expected.loss.item())
        assert close_grads(model.score.weight.grad, reference.score.weight.grad)
    finally:
        model.shutdown()


def multi(message: TrainForward, labels: list[float]) -> TrainForward:
    import msgspec

    return msgspec.structs.replace(message, multi_labels=labels)


def test_multi_label_classification_equals_local_transformers(
    tuning_swarm,  # noqa: F811
    tiny_llama_path,
    local_classifier,
):
    """Float labels [batch, num_labels] (transformers' multi_label_classification): the mean binary cross-entropy
    with logits over every row and label; logits, loss and the score's and prompts' gradients as locally."""
    model = classifier(tiny_llama_path, tuning_swarm[1], num_labels=NUM_LABELS, tuning_mode="ptune", pre_seq_len=2)
    try:
        reference = local_classifier(NUM_LABELS)
        with torch.no_grad():
            model.prompt_embeddings.weight.normal_(0, 0.5)
            reference.score.weight.copy_(model.score.weight)
        input_ids, mask = padded_batch(model.config.vocab_size, model.config.pad_token_id, 11)
        labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.25, 1.0, 0.0]])
        out = model(input_ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert model.config.problem_type == "multi_label_classification"  # as transformers' loss sets it

        prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        expected_logits = local_logits(reference, prompts, input_ids, mask)
        reference.config.problem_type = None  # transformers' own loss picks multi-label from float labels
        from transformers.loss.loss_utils import ForSequenceClassificationLoss

        expected = ForSequenceClassificationLoss(labels, expected_logits, reference.config)
        assert reference.config.problem_type == "multi_label_classification"
        expected.backward()
        assert torch.allclose(out.logits, expected_logits, rtol=1e-4, atol=1e-6)
        assert abs(out.loss.item() - expected.item()) <= 1e-4 * abs(expected.item())
        assert float(model.prompt_embeddings.weight.grad.abs().max()) > 0
        assert close_grads(model.score.weight.grad, reference.score.weight.grad)
        assert close_grads(model.prompt_embeddings.weight.grad, prompts.grad)
        with torch.no_grad():  # evaluation: a forward pass, the same loss
            evaluated = model(input_ids, attention_mask=mask, labels=labels)
        assert abs(evaluated.loss.item() - expected.item()) <= 1e-4 * abs(expected.item())
    finally:
        model.shutdown()


def test_bad_classification_input_is_refused_by_name(tuning_swarm, tiny_llama_path):  # noqa: F811
    servers, peers = tuning_swarm
    model = classifier(tiny_llama_path, peers, num_labels=NUM_LABELS)
    try:
        ids = torch.tensor([[5, 6, 7]])
        with pytest.raises(ValueError, match=r"class indices in \[0, 3\)"):
            model(ids, labels=torch.tensor([3]))
        with pytest.raises(ValueError, match=r"multi-label labels are floats of shape \(1, 3\), got \(1, 2\)"):
            model(ids, labels=torch.tensor([[0.0, 1.0]]))
        with pytest.raises(ValueError, match=r"multi-label labels must be in \[0, 1\]"):
            model(ids, labels=torch.tensor([[0.0, 2.0, 0.0]]))
        with pytest.raises(ValueError, match="one per row"):
            model(ids, labels=torch.tensor([0, 1]))
        route, head, hidden = route_of(servers), servers[0].handler.peer_id, model.config.hidden_size

        def row(num_labels=NUM_LABELS, label=1.0, targets=(-100, -100)):
            return TrainForward(
                step_id="cls1",
                route=route,
                hop_index=0,
                num_prompts=0,
                token_ids=[5, 6],
                targets=list(targets),
                num_labels=num_labels,
                label=label,
            )

        score = torch.zeros(NUM_LABELS, hidden)
        for message, tensors, text in [
            (row(), [torch.zeros(NUM_LABELS + 1, hidden)], "score weights must be float32 of shape (3, 64)"),
            (row(), [score.half()], "score weights must be float32"),
            (row(label=3.0), [score], "label must be a class index in [0, 3)"),
            (row(label=0.5), [score], "label must be a class index"),
            (row(targets=(5, -100)), [score], "targets must all be -100"),
            (row(num_labels=5000), [score], "num_labels must be in 1..1024"),
            (multi(row(), [0.0, 1.0]), [score], "multi_labels must be 3 targets in [0, 1]"),
            (multi(row(), [0.0, 1.5, 0.0]), [score], "multi_labels must be 3 targets in [0, 1]"),
            (multi(row(num_labels=0), [1.0]), [], "multi_labels without num_labels"),
        ]:
            reply = raw_exchange(model, head, message, tensors)
            assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST, reply
            assert text in reply.message, reply.message
        assert torch.isfinite(model(ids, labels=torch.tensor([1])).loss)  # still serving
    finally:
        model.shutdown()
