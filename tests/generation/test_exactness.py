"""Generation through real servers equals local transformers, token for token (float32)."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import SamplingParams
from tests.kit.drafters import ScriptedDrafter
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.routes import ROUTES, pinned


@pytest.mark.parametrize("route", list(ROUTES), ids=list(ROUTES))
def test_greedy_equals_transformers(tiny_model, tiny_reference, route):
    expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=24, do_sample=False)
    with pinned(tiny_model, ROUTES[route]):
        output = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=24, speculation=None)
    assert output.tolist() == expected.tolist()
    stats = tiny_model.last_generation_stats
    assert stats.laps == 24 and stats.new_tokens == 24
    assert [hop[1:] for hop in stats.route] == [hop[1:] for hop in ROUTES[route]]


@pytest.mark.parametrize("route", ["two servers", "three servers, uneven"])
def test_seeded_sampling_equals_reference_sampler(tiny_model, tiny_reference, route):
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    expected = reference_sample(tiny_reference, PROMPT[0], 20, params)
    with pinned(tiny_model, ROUTES[route]):
        output = tiny_model.generate(
            torch.tensor(PROMPT), max_new_tokens=20, do_sample=True, temperature=0.8, top_p=0.9, seed=1234
        )
    assert output[0, len(PROMPT[0]) :].tolist() == expected
    with pinned(tiny_model, ROUTES[route]):  # another seed gives another sequence
        other = tiny_model.generate(
            torch.tensor(PROMPT), max_new_tokens=20, do_sample=True, temperature=0.8, top_p=0.9, seed=99
        )
    assert other[0, len(PROMPT[0]) :].tolist() != expected


@pytest.mark.parametrize("loop_runs", [False, True], ids=["client runs", "looped"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", ["all right", "all wrong", "half right"])
def test_supplied_drafts_never_change_the_output(tiny_model, tiny_reference, monkeypatch, case, sampling, loop_runs):
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=7) if sampling else {}
    with pinned(tiny_model, ROUTES["three servers, uneven"]):
        plain = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=16, speculation=None, **kwargs)
    truth = plain[0, len(PROMPT[0]) :].tolist()
    wrong_at = {
        "all right": set(),
        "all wrong": set(range(16)),
        "half right": set(range(2, 16, 4)) | set(range(3, 16, 4)),
    }[case]
    drafter = ScriptedDrafter(truth, len(PROMPT[0]), wrong_at, length=4)
    monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
    with pinned(tiny_model, ROUTES["three servers, uneven"]):
        output = tiny_model.generate(
            torch.tensor(PROMPT), max_new_tokens=16, num_draft_tokens=4, loop_runs=loop_runs, **kwargs
        )
    assert output.tolist() == plain.tolist()
    stats = tiny_model.last_generation_stats
    if loop_runs:  # a scripted drafter ranks no alternatives: only the client's first run carries its drafts
        assert stats.runs_sent == 1 and stats.looped_runs >= stats.laps - 1
    elif case == "all right":  # 4 drafts + the bonus token per lap
        assert stats.accepted == stats.drafted and stats.laps == 4
    elif case == "all wrong":
        assert stats.accepted == 0 and stats.laps == 16
    else:  # drafts 0,1 right and 2,3 wrong in every window of 4: 2 accepted + 1 own token per lap
        assert set(stats.accepted_lengths) <= {2} | {min(2, 16 - stats.new_tokens)} and stats.accepted >= 8


def test_inference_session_continues_like_one_call(tiny_model, tiny_reference):
    with pinned(tiny_model, ROUTES["two servers"]):
        whole = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=20, speculation=None)
        with tiny_model.inference_session(max_length=128):
            first = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=8, speculation=None)
            laps_first = tiny_model.last_generation_stats
            second = tiny_model.generate(first, max_new_tokens=12, speculation=None)
            stats = tiny_model.last_generation_stats
    assert second.tolist() == whole.tolist()
    assert laps_first.laps == 8 and stats.laps == 12
    assert stats.bytes_up < laps_first.bytes_up * 2  # the second call did not resend the prompt


def test_smollm2_greedy_64_tokens_equals_transformers(smol_model, smol_reference):
    tokenizer = smol_model.tokenizer
    messages = [{"role": "user", "content": "Write a long story about a dragon who learns to paint."}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    expected = smol_reference.generate(input_ids, max_new_tokens=64, do_sample=False)
    output = smol_model.generate(input_ids, max_new_tokens=64, speculation=None)
    assert output.tolist() == expected.tolist()
    assert smol_model.last_generation_stats.new_tokens == 64


def test_warm_draft_store_drafts_the_models_habits_and_never_changes_the_output(smol_swarm, smol_reference):
    """A new client's suffix store starts with SmolLM2's own answers to the tail drafter's training
    prompts (client/warm_corpus.py, warm_draft_store=True): asked one of those prompts again, a warm
    client drafts its answer from the first lap on, a cold one (the default) cannot; both give
    transformers' tokens."""
    from server.drafter_train import SELF_PROMPTS
    from swarm import AutoDistributedModelForCausalLM

    counts = {}
    for warm in (True, False):
        model = AutoDistributedModelForCausalLM.from_pretrained(
            "smollm2-135m", initial_peers=smol_swarm.initial_peers, warm_draft_store=warm
        )
        try:
            assert (len(model.warm_corpus) == len(SELF_PROMPTS)) is warm
            assert all(sequence in model._suffix_store for sequence in model.warm_corpus)
            messages = [{"role": "user", "content": SELF_PROMPTS[0]}]
            ids = model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            # fixed lap costs: on a loaded machine the fitted cost model may cut drafts (the same fix as b9f7898)
            output = model.generate(ids, max_new_tokens=32, draft_lap_costs=(1.0, 0.0))
            assert output.tolist() == smol_reference.generate(ids, max_new_tokens=32, do_sample=False).tolist()
            counts[warm] = model.last_generation_stats.laps
        finally:
            model.shutdown()
    assert counts[True] * 3 <= counts[False], counts  # its own answer, drafted from memory
    from client.warm_corpus import load_warm_corpus

    assert load_warm_corpus(smol_reference.config) and not load_warm_corpus(_tiny_config())  # matched by fingerprint


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculation", ["ngram", "suffix"])
def test_every_drafter_mode_matches_no_speculation_tiny(tiny_model, speculation, sampling):
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=11) if sampling else {}
    prompt = torch.tensor([PROMPT[0] * 3])  # repeats, so the drafters find something to propose
    with pinned(tiny_model, ROUTES["two servers"]):
        plain = tiny_model.generate(prompt, max_new_tokens=24, speculation=None, **kwargs)
        drafted = tiny_model.generate(prompt, max_new_tokens=24, speculation=speculation, **kwargs)
    assert drafted.tolist() == plain.tolist()
    assert tiny_model.last_generation_stats.drafted > 0


CODE_PROMPT = (
    "Rename the variable `total` to `running_sum` in this function and change nothing else:\n\n"
    "def accumulate(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total\n"
)


@pytest.fixture(scope="module")
def smol_plain() -> dict:
    """sampling -> (output, laps) of SmolLM2 without speculation on CODE_PROMPT: both drafters are
    compared against the same run (48 laps of the real model), made once per sampling mode."""
    return {}


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculation", ["ngram", "suffix"])
def test_every_drafter_mode_matches_no_speculation_smollm2(smol_model, smol_plain, speculation, sampling):
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=5) if sampling else {}
    messages = [{"role": "user", "content": CODE_PROMPT}]
    input_ids = smol_model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    if sampling not in smol_plain:
        plain = smol_model.generate(input_ids, max_new_tokens=48, speculation=None, **kwargs)
        smol_plain[sampling] = plain, smol_model.last_generation_stats.laps
    plain, plain_laps = smol_plain[sampling]
    # Free drafts (a fixed lap cost, nothing per position) so every lap carries drafts whatever this
    # machine's timings are: acceptance then depends only on the model, never on a noisy clock.
    # Greedy runs are not looped (test_looped_runs covers those): a looped run carries the drafts the
    # client offered in time, and on a loaded machine they come late, so acceptance would read the clock.
    costs = dict(draft_lap_costs=(1.0, 0.0), **({} if sampling else dict(loop_runs=False)))
    drafted = smol_model.generate(input_ids, max_new_tokens=48, speculation=speculation, **costs, **kwargs)
    assert drafted.tolist() == plain.tolist()
    if sampling:
        return
    if speculation == "suffix":  # the store keeps the answer it just committed: asking again drafts it
        again = smol_model.generate(input_ids, max_new_tokens=48, speculation=speculation, **costs)
        assert again.tolist() == plain.tolist()
    stats = smol_model.last_generation_stats
    assert stats.accepted > 0 and stats.laps < plain_laps


def test_real_router_uses_the_clients_measured_rtts_to_heads_and_tails(tiny_model, tiny_reference):
    expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False)
    assert tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=8, speculation=None).tolist() == expected.tolist()
    from tests.kit.swarms import servers_by_name

    ends = {
        info.peer_id for info in servers_by_name(tiny_model, 6).values() if info.start_block == 0 or info.end_block == 6
    }
    measured = {peer: rtt for peer, (_, rtt) in tiny_model.swarm._rtts.items()}
    assert ends <= set(measured) and all(rtt > 0 for rtt in measured.values())
