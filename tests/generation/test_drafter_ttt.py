"""Training the tail drafter (server/drafter_ttt.py, server/drafter_fit.py, server/drafter_train.py):
the training-time test's steps 2..k read the head's own predictions exactly as the chain at run time
does, a resumed run ends where an uninterrupted one does, and `python -m server.drafter_train`
writes a drafter the tail loads."""

from __future__ import annotations

import pytest
import torch

from server.drafter_data import generate
from server.drafter_fit import Fit, FitConfig, answer_vocab, init_head
from server.drafter_ttt import Head, chain_acceptance, ttt_forward, ttt_loss
from server.tail_drafter import load_drafter
from tests.kit.checkpoints import build_random_drafter


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def random_head(tiny, tiny_llama_path, tmp_path_factory):
    path = build_random_drafter(tiny_llama_path, tmp_path_factory.mktemp("ttt") / "head.safetensors", seed=3)
    net, _ = load_drafter(path, tiny[0].config)
    return net.eval()


@pytest.fixture(scope="module")
def tiny_data(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ttt-data")
    generate(*tiny, folder, model_name="tiny", target_tokens=10**9, batch=4, max_new_tokens=40, max_shards=3,
             progress=False)  # fmt: skip
    return folder


def _sequence(model, length=24, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        feats = model.model(input_ids=ids).last_hidden_state
    return feats, ids


@torch.no_grad()
def test_each_ttt_step_is_the_run_time_chain_on_the_heads_own_predictions(tiny, random_head):
    """Step k at position t must equal drafting k times from t with a fresh cache: step 1 over the
    target's features up to t, then the head's own normed feature and argmax id. A step 2 fed the
    target's feature and id at t + 1 (teacher forcing) gives other predictions and fails this."""
    from server.adapters.llama import _causal_mask

    model, net = tiny[0], random_head
    head = Head.of(model, torch.arange(model.config.vocab_size))
    feats, ids = _sequence(model)
    batched = ttt_forward(net, head, feats[:, :-1], ids[:, 1:], steps=3)
    for t in (0, 5, 17, 22):
        cache = net.new_cache()
        out = net(feats[:, : t + 1], head.embed[ids[:, 1 : t + 2]], torch.arange(t + 1)[None], cache,
                  _causal_mask(0, t + 1, torch.device("cpu")))  # fmt: skip
        predicted = head.norm(out[:, -1:])
        for k in range(3):
            assert torch.allclose(batched[k][:, t : t + 1], predicted, atol=1e-4), (t, k)
            own = head.draft_ids(predicted)
            predicted = head.norm(net(predicted, head.embed[own], torch.tensor([[t + 1 + k]]), cache, None))
    # the teacher-forced alternative for step 2 differs from what was trained
    teacher = head.norm(net(feats[:, 1:-1], head.embed[ids[:, 2:]], torch.arange(1, 23)[None], None,
                            _causal_mask(0, 22, torch.device("cpu"))))  # fmt: skip
    assert not torch.allclose(teacher, batched[1][:, :22], atol=1e-2)


def test_ttt_loss_trains_later_steps_through_the_heads_own_features(tiny, random_head):
    model = tiny[0]
    net = init_head(model, seed=0)
    head = Head.of(model, torch.arange(model.config.vocab_size))
    feats, ids = _sequence(model, seed=1)
    labels = model.lm_head(feats).argmax(-1)
    one, top1 = ttt_loss(net, head, feats, ids, labels, steps=1)
    three, top3 = ttt_loss(net, head, feats, ids, labels, steps=3)
    assert len(top1) == 1 and len(top3) == 3 and three.item() > one.item()
    three.backward()
    assert net.fc.weight.grad is not None and net.fc.weight.grad.abs().sum() > 0
    hits, count = chain_acceptance(net, head, feats, ids, labels, depth=3)
    assert count == 24 - 3 and hits[0] >= hits[1] >= hits[2]


def _params(fit: Fit) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fit.net.state_dict().items()}


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny, tiny_data, tmp_path):
    model = tiny[0]
    vocab = answer_vocab(tiny_data, 512, model.config.vocab_size)
    config = dict(steps=3, batch=2, chunk=16, lr=3e-3, seed=0, max_steps=7, train_seconds=1e9)
    whole = Fit(model, tiny_data, tmp_path / "whole.pt", FitConfig(**config), draft_vocab=vocab)
    whole.run(progress=False)
    first = Fit(model, tiny_data, tmp_path / "resumed.pt", FitConfig(**config), draft_vocab=vocab)
    first.run(progress=False, until=3)  # stopped there, as by a kill after its last checkpoint
    assert first.step == 3
    del first
    resumed = Fit(model, tiny_data, tmp_path / "resumed.pt", FitConfig(**config))
    assert resumed.resumed and resumed.step == 3
    resumed.run(progress=False)
    assert resumed.step == whole.step == 7
    assert vars(resumed.cursor) == vars(whole.cursor)
    for name, value in _params(whole).items():
        assert torch.equal(value, resumed.net.state_dict()[name]), name
    a, b = whole.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    assert all(torch.equal(a[i]["exp_avg"], b[i]["exp_avg"]) for i in a)
    assert torch.equal(whole.draft_vocab, resumed.draft_vocab)
    assert any(not torch.equal(v, init_head(model, 0).state_dict()[k]) for k, v in _params(whole).items())


def test_drafter_train_writes_a_drafter_the_tail_loads(tiny_llama_path, tiny, tiny_data, tmp_path):
    from server.drafter_train import main

    out = tmp_path / "drafters"
    argv = ["--model", str(tiny_llama_path), "--data", str(tiny_data), "--out", str(out), "--chunk", "16"]
    argv += ["--max-steps", "4", "--draft-vocab", "300", "--eval-prompts", "1", "--no-progress"]
    argv += ["--checkpoint", str(tmp_path / "ckpt.pt")]
    assert main(argv) == 0
    net, vocab = load_drafter(out / f"{tiny_llama_path.name}.safetensors", tiny[0].config)
    assert vocab is not None and len(vocab) == 300
    assert (tmp_path / "log.txt").read_text().count("held-out acceptance") == 1
    with pytest.raises(SystemExit, match="holds no data"):
        main([*argv[:2], "--data", str(tmp_path / "nothing"), "--out", str(out)])
