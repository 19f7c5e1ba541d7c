"""A DeepSeek-V4 tail under a constraint: its matcher follows the committed history through the V4
cache's rollbacks (compression windows included), so a constrained generation over two real V4
servers equals transformers' DeepseekV4 with xgrammar's processor, greedy and seeded, with drafts
rejected at many offsets."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
from xgrammar.contrib.hf import LogitsProcessor

from client._calls import compiler_for
from protocol.constraints import constraint_from_options
from protocol.seeded_draws import seeded_choice
from tests.kit.drafters import ScriptedDrafter
from tests.server.test_deepseek_v4 import one_torch_thread, v4_model, v4_path, v4_reference  # noqa: F401 (fixtures)

RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def prompt_of(model) -> list[int]:
    return model.tokenizer("A record in JSON:", add_special_tokens=False).input_ids


def processors(model, sampled: bool) -> LogitsProcessorList:
    compiled = compiler_for(model.tokenizer, model.config.vocab_size).compile(
        constraint_from_options(guided_json=RECORD)
    )
    procs = [LogitsProcessor(compiled)]
    return LogitsProcessorList(procs + ([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)] if sampled else []))


def reference(target, model, prompt: list[int], new_tokens: int, sampled: bool, seed: int = 5) -> list[int]:
    """Transformers' V4 with xgrammar's processor; sampled: drawn with the exact rule's (seed, position)
    generator. Stops after EOS."""
    procs, tokens = processors(model, sampled), list(prompt)
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = target(torch.tensor([tokens])).logits[:, -1].float()
        scores = procs(torch.tensor([tokens]), logits)[0]
        if sampled:
            token = seeded_choice(torch.softmax(scores, -1), seed, len(tokens))
        else:
            token = int(scores.argmax())
        tokens.append(token)
        if token == model.config.eos_token_id:
            break
    return tokens[len(prompt) :]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_v4_tail_under_a_constraint_equals_transformers(v4_model, v4_reference, monkeypatch, sampled):  # noqa: F811
    prompt = prompt_of(v4_model)
    expected = reference(v4_reference, v4_model, prompt, 40, sampled)
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=5) if sampled else {}
    plain = v4_model.generate(torch.tensor([prompt]), max_new_tokens=40, speculation=None, guided_json=RECORD, **kwargs)
    assert plain[0, len(prompt) :].tolist() == expected
    assert expected[-1] == v4_model.config.eos_token_id  # the schema bounds the record: it ends
    # strict=False: xgrammar's JSON grammar lets a string hold raw control characters (json.loads refuses them)
    assert json.loads(v4_model.tokenizer.decode(expected[:-1]), strict=False).keys() == {"name", "n"}
    # wrong drafts at many offsets: each rejection trims the V4 caches and the tail's matcher
    drafter = ScriptedDrafter(expected, len(prompt), wrong_at={1, 4, 5, 9, 13, 14, 20}, length=4)
    monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
    output = v4_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=40,
        num_draft_tokens=4,
        grammar_drafts=False,
        guided_json=RECORD,
        **kwargs,
    )
    assert output[0, len(prompt) :].tolist() == expected
    stats = v4_model.last_generation_stats
    assert 0 < stats.accepted < stats.drafted
