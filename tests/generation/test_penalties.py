"""presence_penalty, frequency_penalty and logit_bias at the tail: the same exact rule as the rest of
sampling, equal to local transformers with the equivalent processors, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from protocol.sampling import OutputPenalties
from protocol.seeded_draws import seeded_choice
from tests.kit.reference import PROMPT
from tests.kit.routes import ROUTES, pinned

RULES = dict(presence_penalty=1.5, frequency_penalty=0.7, logit_bias={1345: 6.0, 30: -100.0, 504: 3.5})


def bias_list(bias):
    return [[[t], b] for t, b in sorted(bias.items())]


def test_penalties_and_bias_greedy_equal_transformers(tiny_model, tiny_reference):
    prompt = PROMPT[0]
    expected = tiny_reference.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        sequence_bias=bias_list(RULES["logit_bias"]),
        logits_processor=[OutputPenalties(RULES["presence_penalty"], RULES["frequency_penalty"], len(prompt))],
    )[0, len(prompt) :].tolist()
    plain = tiny_reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
    assert expected != plain.tolist()  # the rules change this output
    for speculation in (None, "suffix"):
        with pinned(tiny_model, ROUTES["three servers, uneven"]):
            out = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=24, speculation=speculation, **RULES)
        assert out[0, len(prompt) :].tolist() == expected, speculation
    # transformers' own name for the bias, as one-token sequences: the same rule
    as_sequences = {**RULES, "logit_bias": None, "sequence_bias": bias_list(RULES["logit_bias"])}
    out = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=24, **as_sequences)
    assert out[0, len(prompt) :].tolist() == expected


def test_penalties_and_bias_sampled_equal_reference(tiny_model, tiny_reference):
    """Seeded sampling with the penalties, the bias and min_p (transformers' MinPLogitsWarper, after
    top-p as generate() orders them) equals the (seed, position) reference token for token."""
    prompt, seed, min_p = PROMPT[0], 99, 0.6
    warpers = [TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)]
    rules = [
        SequenceBiasLogitsProcessor(bias_list(RULES["logit_bias"])),
        OutputPenalties(RULES["presence_penalty"], RULES["frequency_penalty"], len(prompt)),
    ]

    def reference(procs):
        tokens = list(prompt)
        for _ in range(20):
            with torch.no_grad():
                logits = tiny_reference(torch.tensor([tokens])).logits[:, -1].float()
            probs = torch.softmax(LogitsProcessorList(procs)(torch.tensor([tokens]), logits)[0], dim=-1)
            tokens.append(seeded_choice(probs, seed, len(tokens)))
        return tokens

    tokens = reference(rules + warpers + [MinPLogitsWarper(min_p)])
    assert tokens != reference(rules + warpers)  # min_p changes this output
    for speculation in (None, "suffix"):
        with pinned(tiny_model, ROUTES["two servers"]):
            out = tiny_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=20,
                do_sample=True,
                temperature=0.8,
                top_p=0.9,
                min_p=min_p,
                seed=seed,
                speculation=speculation,
                eos_token_id=[],
                **RULES,
            )
        assert out[0].tolist() == tokens, speculation


def test_output_penalties_count_only_the_output():
    scores = torch.zeros(1, 6)
    ids = torch.tensor([[1, 1, 2, 3, 3, 3]])  # positions 0..2 are the prompt
    out = OutputPenalties(presence=0.5, frequency=0.25, start=3)(ids, scores)
    assert out.tolist() == [[0, 0, 0, -(0.5 + 3 * 0.25), 0, 0]]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(logit_bias={5: 101}), "[-100, 100]"),
        (dict(logit_bias={10**9: 1}), "outside the vocabulary"),
        (dict(logit_bias={"x": 1}), "token ids"),
        (dict(sequence_bias=[[[5, 6], 1.0]]), "one-token sequences"),
        (dict(sequence_bias={(5,): 1.0}, logit_bias={5: 1.0}), "not both"),
    ],
)
def test_bad_penalties_are_value_errors(tiny_model, kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=2, **kwargs)
