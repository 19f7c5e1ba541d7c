"""Constraints (structured outputs) at the tail equal local transformers with xgrammar's own logits
processor, token for token, under every kind of draft and rollback; bad constraints are clear errors."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
from xgrammar.contrib.hf import LogitsProcessor

from client._calls import compiler_for
from client.errors import SwarmError
from protocol.constraints import constraint_from_options, constraint_from_response_format
from protocol.messages import MAX_CONSTRAINT_CHARS, Constraint
from protocol.seeded_draws import seeded_choice
from tests.kit.drafters import ScriptedDrafter
from tests.kit.routes import ROUTES, pinned

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"enum": ["Paris", "Oslo"]}},
    "required": ["name", "age", "city"],
}
CONSTRAINTS = {
    "json schema": dict(guided_json=PERSON),
    "json object": dict(response_format={"type": "json_object"}),
    "regex": dict(guided_regex=r"[0-9]{3}-[a-z]{2,6}"),
    "choice": dict(guided_choice=["yes", "no", "maybe not"]),
    "grammar": dict(guided_grammar='root ::= "(" [a-z]+ ")" | "[" [0-9]* "]"'),
}


def prompt_ids(model) -> list[int]:
    return model.tokenizer("Answer in JSON: the person is", add_special_tokens=False).input_ids


def compiled(model, kwargs):
    rf = kwargs.get("response_format")
    constraint = constraint_from_response_format(rf) if rf else constraint_from_options(**kwargs)
    return compiler_for(model.tokenizer, model.config.vocab_size).compile(constraint)


def transformers_greedy(reference, model, kwargs, prompt, new_tokens):
    """Local transformers with xgrammar's own processor: the reference."""
    out = reference.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=[LogitsProcessor(compiled(model, kwargs))],
        pad_token_id=model.config.eos_token_id,
    )
    return out[0, len(prompt) :].tolist()


def reference_sample(reference, model, kwargs, prompt, new_tokens, temperature, top_p, seed):
    """transformers' processing order (custom processor, then the warpers) with xgrammar's processor,
    drawn with the (seed, position) generator the exact rule uses; stops after EOS."""
    procs = LogitsProcessorList(
        [LogitsProcessor(compiled(model, kwargs)), TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)]
    )
    tokens = list(prompt)
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = reference(torch.tensor([tokens])).logits[:, -1].float()
        probs = torch.softmax(procs(torch.tensor([tokens]), logits)[0], dim=-1)
        tokens.append(seeded_choice(probs, seed, len(tokens)))
        if tokens[-1] == model.config.eos_token_id:
            break
    return tokens[len(prompt) :]


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("speculation", [None, "suffix"])
def test_constrained_greedy_equals_transformers(tiny_model, tiny_reference, kind, speculation):
    kwargs, prompt = CONSTRAINTS[kind], prompt_ids(tiny_model)
    expected = transformers_greedy(tiny_reference, tiny_model, kwargs, prompt, 20)
    with pinned(tiny_model, ROUTES["three servers, uneven"]):
        output = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=20, speculation=speculation, **kwargs)
    assert output[0, len(prompt) :].tolist() == expected
    if kind == "choice":  # a choice ends with EOS, which the grammar forces after it
        text = tiny_model.tokenizer.decode(expected[:-1])
        assert expected[-1] == tiny_model.config.eos_token_id and text in ("yes", "no", "maybe not")


@pytest.mark.parametrize("loop_runs", [False, True], ids=["client runs", "looped"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_wrong_drafts_roll_the_constraint_back(tiny_model, tiny_reference, monkeypatch, sampling, loop_runs):
    """Drafts wrong at every other pair of positions: each rejection trims the caches to start_pos,
    and the tail's matcher follows (the next verdicts are still the reference's)."""
    kwargs = dict(guided_json=PERSON)
    sample = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=11) if sampling else {}
    prompt = prompt_ids(tiny_model)
    if sampling:
        expected = reference_sample(tiny_reference, tiny_model, kwargs, prompt, 16, 0.8, 0.9, 11)
    else:
        expected = transformers_greedy(tiny_reference, tiny_model, kwargs, prompt, 16)
    drafter = ScriptedDrafter(expected, len(prompt), set(range(2, 16, 4)) | set(range(3, 16, 4)), length=4)
    monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
    with pinned(tiny_model, ROUTES["two servers"]):
        output = tiny_model.generate(
            torch.tensor([prompt]), max_new_tokens=16, num_draft_tokens=4, loop_runs=loop_runs, **kwargs, **sample
        )
    assert output[0, len(prompt) :].tolist() == expected
    assert tiny_model.last_generation_stats.accepted < tiny_model.last_generation_stats.drafted  # it rolled back


@pytest.mark.parametrize("kind", ["json schema", "regex"])
def test_constrained_sampling_equals_reference(tiny_model, tiny_reference, kind):
    kwargs, prompt = CONSTRAINTS[kind], prompt_ids(tiny_model)
    expected = reference_sample(tiny_reference, tiny_model, kwargs, prompt, 20, 0.8, 0.9, 1234)
    for speculation in (None, "suffix"):
        with pinned(tiny_model, ROUTES["two servers"]):
            output = tiny_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=20,
                do_sample=True,
                temperature=0.8,
                top_p=0.9,
                seed=1234,
                speculation=speculation,
                **kwargs,
            )
        assert output[0, len(prompt) :].tolist() == expected, speculation


def test_constrained_tree_drafts_equal_transformers(tiny_model, tiny_reference):
    kwargs, prompt = CONSTRAINTS["json schema"], prompt_ids(tiny_model)
    expected = transformers_greedy(tiny_reference, tiny_model, kwargs, prompt, 16)
    with pinned(tiny_model, ROUTES["two servers"]):
        output = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=16, draft_tree=True, **kwargs)
    assert output[0, len(prompt) :].tolist() == expected


def test_constrained_sampled_tree_drafts_equal_the_reference(tiny_model, tiny_reference):
    """Seeded sampling with token trees: each node's choice is the tail's (seed, position) draw under
    the mask along that node's path, so the output is the reference sampler's."""
    kwargs, prompt = CONSTRAINTS["json schema"], prompt_ids(tiny_model)
    expected = reference_sample(tiny_reference, tiny_model, kwargs, prompt, 20, 0.8, 0.9, 99)
    with pinned(tiny_model, ROUTES["two servers"]):
        output = tiny_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            do_sample=True,
            temperature=0.8,
            top_p=0.9,
            seed=99,
            draft_tree=True,
            draft_corpus=[prompt + expected],  # paths the tree can take
            **kwargs,
        )
    assert output[0, len(prompt) :].tolist() == expected
    stats = tiny_model.last_generation_stats
    assert stats.tree_laps > 0 and stats.tree_accepted > 0, stats


def test_bad_constraints_are_value_errors_before_any_server(tiny_model):
    prompt = torch.tensor([prompt_ids(tiny_model)])
    bad = {
        "guided_regex": ("(unclosed", "does not compile"),
        "guided_json": ({"type": "object", "properties": {"a": {"type": "no-such-type"}}}, "does not compile"),
        "guided_grammar": ("root ::= undefined_rule", "does not compile"),
        "guided_choice": ([], "non-empty list"),
        "response_format": ({"type": "xml"}, "response_format.type"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            tiny_model.generate(prompt, max_new_tokens=4, **{name: value})
    with pytest.raises(ValueError, match="one constraint at a time"):
        tiny_model.generate(prompt, max_new_tokens=4, guided_regex="a", guided_choice=["a"])
    with pytest.raises(ValueError, match="limit"):
        tiny_model.generate(prompt, max_new_tokens=4, guided_regex="a" * (MAX_CONSTRAINT_CHARS + 1))
    with pytest.raises(ValueError, match="not valid JSON"):
        constraint_from_options(guided_json="{nope")


def test_tail_refuses_a_constraint_it_cannot_compile(tiny_model, monkeypatch):
    """A client that skips its own check gets the tail's refusal naming the problem; the server
    serves the next session as before."""
    monkeypatch.setattr("client._calls.call_constraint", lambda *a: Constraint("regex", "(unclosed"))
    prompt = torch.tensor([prompt_ids(tiny_model)])
    with pytest.raises(SwarmError, match="does not compile"):
        tiny_model.generate(prompt, max_new_tokens=4, speculation=None)
    monkeypatch.undo()
    out = tiny_model.generate(prompt, max_new_tokens=4, speculation=None, guided_choice=["ok"])
    assert tiny_model.tokenizer.decode(out[0, prompt.shape[1] : -1]) == "ok"


def test_constraint_travels_bounded_and_in_the_digest():
    """The constraint is part of the sampling parameters: on the wire once per change, inside the
    verdict's digest (a hop that rewrote it would be caught), refused past its size limit."""
    from protocol.digest import step_digest
    from protocol.messages import SamplingParams, Step, decode, encode

    c = Constraint("json_schema", json.dumps(PERSON))
    sampling = SamplingParams(constraint=c, output_start=7)
    step = Step(session_id="s", run_id=0, start_pos=0, token_ids=[1], sampling=sampling)
    assert decode(encode(step)).sampling == sampling
    other = SamplingParams(constraint=msgspec.structs.replace(c, spec="{}"))
    digests = {
        step_digest("k", run_id=0, start_pos=0, token_ids=[1], n_draft=0, sampling=s)
        for s in (SamplingParams(constraint=c), other)
    }
    assert len(digests) == 2

    class Before(msgspec.Struct, frozen=True, array_like=True):  # Constraint before stop_token_ids (v9)
        kind: str
        spec: str = ""

    def digest(constraint):
        return step_digest(
            "k", run_id=0, start_pos=0, token_ids=[1], n_draft=0, sampling=SamplingParams(constraint=constraint)
        )

    # without stop ids a verdict's digest is what a peer of before them computes; with them, they count
    assert digest(c) == digest(Before(c.kind, c.spec)) != digest(msgspec.structs.replace(c, stop_token_ids=(5,)))
    stops = SamplingParams(constraint=msgspec.structs.replace(c, stop_token_ids=(5, 9)))
    stopping = Step(session_id="s", run_id=0, start_pos=0, token_ids=[1], sampling=stops)
    assert decode(encode(stopping)).sampling == stopping.sampling
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stopping.sampling.constraint), type=Before) == Before(
        c.kind, c.spec
    )
    huge = Step(
        session_id="s",
        run_id=0,
        start_pos=0,
        token_ids=[1],
        sampling=SamplingParams(constraint=Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))),
    )
    with pytest.raises(Exception, match="malformed"):
        decode(encode(huge))


LONG_KEYS = {
    "type": "object",
    "properties": {
        "the_full_name_of_the_person": {"type": "string", "maxLength": 6},
        "the_city_where_the_person_lives": {"enum": ["Paris", "Oslo"]},
        "the_age_of_the_person_in_years": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["the_full_name_of_the_person", "the_city_where_the_person_lives", "the_age_of_the_person_in_years"],
    "additionalProperties": False,
}


def test_forced_tokens_are_what_the_constraint_leaves_no_choice_about(tiny_model):
    """A one-choice grammar forces (a prefix of) its text, and EOS once it is complete; the guide is
    left where it was."""
    tokenizer, eos = tiny_model.tokenizer, tiny_model.config.eos_token_id
    compiler = compiler_for(tokenizer, tiny_model.config.vocab_size)
    guide = compiler.guide(constraint_from_options(guided_choice=["maybe not"]), 3)
    forced = guide.forced([1, 2, 3], 10)
    assert forced and "maybe not".startswith(tokenizer.decode(forced))
    assert guide.forced([1, 2, 3], 10) == forced  # nothing was left accepted
    whole = tokenizer.encode("maybe not", add_special_tokens=False)
    assert guide.forced([1, 2, 3, *whole], 10) == [eos]  # the only id after a complete answer
    assert guide.valid_prefix([1, 2, 3], whole + [eos, 5]) == len(whole) + 1
    assert guide.valid_prefix([1, 2, 3], [eos]) == 0


def test_grammar_drafts_save_laps_and_never_change_the_output(tiny_model, tiny_reference):
    kwargs, prompt = dict(guided_json=LONG_KEYS), prompt_ids(tiny_model)
    expected = transformers_greedy(tiny_reference, tiny_model, kwargs, prompt, 100)
    laps = {}
    for grammar_drafts in (False, True):
        with pinned(tiny_model, ROUTES["two servers"]):
            out = tiny_model.generate(
                torch.tensor([prompt]), max_new_tokens=100, grammar_drafts=grammar_drafts, loop_runs=False, **kwargs
            )
        assert out[0, len(prompt) :].tolist() == expected, grammar_drafts
        stats = tiny_model.last_generation_stats
        laps[grammar_drafts] = stats.laps
        # verdict audits re-verified the output on another tail under the same constraint, and it agreed
        assert stats.verdict_audits > 0 and stats.verdict_audits_failed == 0 and not stats.liars_excluded
    assert json.loads(tiny_model.tokenizer.decode(expected[:-1])).keys() == LONG_KEYS["properties"].keys()
    assert laps[True] < laps[False] / 2, laps


def test_smollm2_json_schema_equals_transformers(smol_model, smol_reference):
    """The real model and tokenizer: a chat asking for a record, constrained to LONG_KEYS, greedy with
    the default speculation (suffix + grammar drafts, looped runs), equals transformers + xgrammar."""
    messages = [{"role": "user", "content": "Extract the record as JSON: Ana, from Paris, is 31 years old."}]
    prompt = smol_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    prompt = prompt["input_ids"]
    kwargs = dict(guided_json=LONG_KEYS)
    expected = transformers_greedy(smol_reference, smol_model, kwargs, prompt, 120)
    out = smol_model.generate([prompt], max_new_tokens=120, **kwargs)[0, len(prompt) :].tolist()
    assert out == expected
    record = json.loads(smol_model.tokenizer.decode(expected[:-1]))
    assert record.keys() == LONG_KEYS["properties"].keys() and expected[-1] == smol_model.config.eos_token_id


def test_the_calls_stop_ids_are_stops_of_every_matcher(tiny_model):
    """A call's eos ids besides the tokenizer's EOS travel in the constraint (``stop_token_ids``), and
    the matchers (the tail's, the drafts') take them as stops: after a complete answer either ends it,
    and the constraint has ended there. Ids outside the vocabulary are a ValueError naming them."""
    from protocol.constraints import with_stops

    tokenizer, eos, vocab = tiny_model.tokenizer, tiny_model.config.eos_token_id, tiny_model.config.vocab_size
    compiler = compiler_for(tokenizer, vocab)
    plain = constraint_from_options(guided_choice=["maybe not"])
    assert with_stops(plain, compiler, [eos]) is plain  # EOS alone: nothing more on the wire
    stop = tokenizer.encode("!", add_special_tokens=False)[0]
    constraint = with_stops(plain, compiler, [eos, stop])
    assert constraint.stop_token_ids == (stop,)
    whole = tokenizer.encode("maybe not", add_special_tokens=False)
    guide = compiler.guide(constraint, 3)
    assert guide.valid_prefix([1, 2, 3, *whole], [stop]) == guide.valid_prefix([1, 2, 3, *whole], [eos]) == 1
    assert guide.ended([1, 2, 3, *whole, stop]) and not guide.ended([1, 2, 3, *whole])
    assert compiler.guide(plain, 3).valid_prefix([1, 2, 3, *whole], [stop]) == 0  # without it, no stop
    with pytest.raises(ValueError, match="outside the vocabulary"):
        with_stops(plain, compiler, [eos, vocab + 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):  # a tail asked with a bad id
        compiler.guide(msgspec.structs.replace(plain, stop_token_ids=(vocab,)), 3)


def test_a_dead_end_allows_only_the_stop_token(tiny_model):
    """Where the mask allows nothing (a grammar the vocabulary cannot spell), the stop token is the
    only choice: the generation ends with EOS instead of failing on a row of -inf."""
    compiler = compiler_for(tiny_model.tokenizer, tiny_model.config.vocab_size)
    guide = compiler.guide(constraint_from_options(guided_regex="[a-z]+"), 2)

    class DeadEnd:  # the real matcher, whose masks allow nothing
        def __init__(self, matcher):
            self.matcher = matcher

        def __getattr__(self, name):
            return getattr(self.matcher, name)

        def fill_next_token_bitmask(self, bitmask, index):
            bitmask.zero_()

    guide._matcher = DeadEnd(guide._matcher)
    scores = guide.apply(torch.randn(1, tiny_model.config.vocab_size), [1, 2])
    eos = tiny_model.config.eos_token_id
    assert torch.isfinite(scores).nonzero()[:, 1].tolist() == [eos]
