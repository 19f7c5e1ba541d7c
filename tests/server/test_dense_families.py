"""The dense Llama-like families the generic adapter serves besides Llama: Mistral (every layer
sliding), Qwen2 (sliding layers after ``max_window_layers``, q/k/v bias) and Qwen3 (q/k norms).
Each is a tiny random checkpoint (tests/kit/checkpoints.py ``DENSE_FAMILIES``, windows of 8
positions so every generation here crosses them) served by two CLI servers, token-equal to local
transformers: greedy in every speculation mode, seeded sampling, padded concurrent sessions, and
nf4 weights against one process quantized by the same recipe.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from protocol.messages import SamplingParams
from server.quantization import Quant
from tests.kit.batch_rows import greedy_truth, padded, prompts
from tests.kit.checkpoints import DENSE_FAMILIES
from tests.kit.families import cli_swarm_model, quantized_reference
from tests.kit.reference import PROMPT, reference_sample

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]
FAMILIES = list(DENSE_FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, family_paths, artifacts_dir):
    model_type = request.param
    path = family_paths(model_type)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with cli_swarm_model(path, [(0, 2), (2, 4)], artifacts_dir / model_type) as model:
        yield model_type, model, reference


def test_the_tiny_checkpoints_cross_their_windows(family_paths):
    """What the tests below must exercise: a sliding window shorter than every generation here."""
    from transformers import AutoConfig

    windows = {t: AutoConfig.from_pretrained(family_paths(t)).sliding_window for t in FAMILIES}
    assert windows["mistral"] == 8 and windows["qwen2"] == 8
    assert AutoConfig.from_pretrained(family_paths("qwen2")).layer_types[2:] == ["sliding_attention"] * 2
    assert len(PROMPT[0]) + 20 > 8


def test_swarm_generation_equals_transformers(served):
    """Greedy with no speculation, suffix chains and token trees (qwen2 also n-gram chains and async speculation);
    seeded sampling with and without drafts: token for token against local transformers."""
    model_type, model, reference = served
    prompt = torch.tensor([PROMPT[0] + PROMPT[0][1:6]])  # a repeat, so suffix drafting has something to draft
    expected = reference.generate(prompt, max_new_tokens=20, do_sample=False)
    modes = [dict(speculation=None), dict(speculation="suffix"), dict(speculation="suffix", draft_tree=True)]
    if model_type == "qwen2":  # the client's other modes send the same Steps whatever the family
        modes += [dict(speculation="ngram"), dict(speculation="suffix", async_speculation=True)]
    for extra in modes:
        output = model.generate(prompt, max_new_tokens=20, **extra)
        assert output.tolist() == expected.tolist(), (model_type, extra)
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=77)
    truth = reference_sample(reference, prompt[0].tolist(), 16, SamplingParams(**sampling))
    for speculation in (None, "suffix"):
        output = model.generate(prompt, max_new_tokens=16, speculation=speculation, **sampling)
        assert output[0, prompt.shape[1] :].tolist() == truth, (model_type, speculation)


def test_padded_concurrent_sessions_each_equal_transformers(served):
    model_type, model, reference = served
    rows = prompts(4, seed=9)
    ids, mask = padded(rows)
    output = model.generate(ids, attention_mask=mask, max_new_tokens=12, speculation="suffix")
    got = [output[i, ids.shape[1] :].tolist() for i in range(len(rows))]
    assert got == [greedy_truth(reference, row, 12) for row in rows], model_type


@pytest.mark.parametrize("model_type", ["qwen2"])
def test_nf4_swarm_equals_the_same_quantization_in_one_process(family_paths, artifacts_dir, model_type):
    """Qwen2 carries q/k/v biases and sliding layers: nf4 linears keep both exact against one
    process quantized by the servers' recipe."""
    path = family_paths(model_type)
    reference = quantized_reference(path, Quant.NF4)
    prompt = torch.tensor(PROMPT)
    expected = reference.generate(prompt, max_new_tokens=16, do_sample=False)
    with cli_swarm_model(path, [(0, 2), (2, 4)], artifacts_dir / f"{model_type}-nf4", ["--quant", "nf4"]) as model:
        for speculation in (None, "suffix"):
            output = model.generate(prompt, max_new_tokens=16, speculation=speculation)
            assert output.tolist() == expected.tolist(), speculation
