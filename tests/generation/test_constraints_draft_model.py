"""Constraints with a client draft model: the draft model proposes under the same grammar (the
client's own mask, forced tokens first), and the output is still local transformers' with xgrammar's
processor, token for token, greedy and seeded; the DSSD exchange stays inside the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from client._calls import compiler_for
from client.draft_model import ModelDrafter
from protocol.constraints import constraint_from_options
from protocol.messages import SamplingParams
from protocol.sampling import draw_draft, processed_scores, with_output_start
from tests.generation.test_constraints import (
    CONSTRAINTS,
    LONG_KEYS,
    PERSON,
    prompt_ids,
    reference_sample,
    transformers_greedy,
)
from tests.kit.checkpoints import noisy_copy
from tests.kit.routes import ROUTES, pinned
from tests.kit.threads import single_torch_thread


@pytest.fixture(scope="module")
def draft_model(tiny_llama_path):
    """The target's weights plus N(0, 0.005) noise: a drafter that agrees often, not always."""
    return noisy_copy(tiny_llama_path)


@pytest.mark.parametrize("kind", ["json schema", "regex", "choice"])
def test_greedy_draft_model_under_a_constraint_equals_transformers(tiny_model, tiny_reference, draft_model, kind):
    kwargs, prompt = CONSTRAINTS[kind], prompt_ids(tiny_model)
    expected = transformers_greedy(tiny_reference, tiny_model, kwargs, prompt, 20)
    with pinned(tiny_model, ROUTES["two servers"]):
        output = tiny_model.generate(
            torch.tensor([prompt]), max_new_tokens=20, draft_model=draft_model, num_draft_tokens=4, **kwargs
        )
    assert output[0, len(prompt) :].tolist() == expected
    stats = tiny_model.last_generation_stats
    assert stats.drafted > 0 and stats.accepted > 0 and stats.laps < len(expected)


def test_seeded_draft_model_under_a_constraint_equals_the_reference(tiny_model, tiny_reference, draft_model):
    """Sampling with token match: the tail's (seed, position) draws under the mask decide, the draft
    model's masked argmax only saves laps."""
    kwargs, prompt = dict(guided_json=PERSON), prompt_ids(tiny_model)
    expected = reference_sample(tiny_reference, tiny_model, kwargs, prompt, 20, 0.8, 0.9, 77)
    for grammar_drafts in (True, False):
        with pinned(tiny_model, ROUTES["two servers"]):
            output = tiny_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=20,
                do_sample=True,
                temperature=0.8,
                top_p=0.9,
                seed=77,
                draft_model=draft_model,
                num_draft_tokens=4,
                grammar_drafts=grammar_drafts,
                **kwargs,
            )
        assert output[0, len(prompt) :].tolist() == expected, grammar_drafts


def test_forced_ids_are_drafted_without_running_the_draft_model(tiny_model, tiny_reference, draft_model):
    """Long forced keys: the ids the mask leaves no choice about are drafted without a forward of M
    (fewer M forwards, the same laps: M's masked argmax there is the forced id), the output unchanged."""
    kwargs, prompt = dict(guided_json=LONG_KEYS), prompt_ids(tiny_model)
    expected = transformers_greedy(tiny_reference, tiny_model, kwargs, prompt, 100)
    laps, forwards = {}, {}
    for forced_first in (False, True):
        calls = []
        hook = draft_model.register_forward_hook(lambda *a: calls.append(1))
        try:
            with pinned(tiny_model, ROUTES["two servers"]):
                out = tiny_model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=100,
                    draft_model=draft_model,
                    num_draft_tokens=8,
                    grammar_drafts=forced_first,
                    **kwargs,
                )
        finally:
            hook.remove()
        assert out[0, len(prompt) :].tolist() == expected, forced_first
        laps[forced_first], forwards[forced_first] = tiny_model.last_generation_stats.laps, len(calls)
    assert laps[True] <= laps[False], laps
    assert forwards[True] < forwards[False] * 0.8, forwards


def test_rejection_exchange_under_a_constraint_stays_in_the_grammar(tiny_model, draft_model):
    """The DSSD exchange with masked q (one-hot on forced drafts): every seed's output is a record the
    schema (its strings bounded, so that a random model ends it) accepts, the same for the same seed,
    and the exchange corrected some drafts."""
    prompt = prompt_ids(tiny_model)
    eos = tiny_model.config.eos_token_id
    outputs, corrections = {}, 0
    for seed in (5, 6, 5):
        with pinned(tiny_model, ROUTES["two servers"]):
            out = tiny_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=100,
                do_sample=True,
                top_k=8,
                seed=seed,
                draft_model=draft_model,
                num_draft_tokens=4,
                verification="rejection",
                guided_json=LONG_KEYS,
            )
        new = out[0, len(prompt) :].tolist()
        assert new[-1] == eos, "the record did not end within 100 tokens"
        jsonschema.validate(json.loads(tiny_model.tokenizer.decode(new[:-1])), LONG_KEYS)
        assert outputs.setdefault(seed, new) == new
        corrections += tiny_model.last_generation_stats.corrections
    assert corrections > 0


def test_model_drafter_drafts_forced_ids_first_then_its_masked_choice(tiny_model, draft_model):
    """Forced ids come first (with a one-hot q when sampling); M's own drafts are the argmax of its
    masked, processed scores; no draft is one the constraint forbids."""
    vocab = tiny_model.config.vocab_size
    compiler = compiler_for(tiny_model.tokenizer, vocab)
    constraint = constraint_from_options(guided_json=LONG_KEYS)
    prompt = prompt_ids(tiny_model)
    greedy = SamplingParams(constraint=constraint)
    drafter = ModelDrafter(draft_model, greedy, 8, compiler=compiler)
    drafter.reset(prompt)
    drafts = drafter.draft(40)
    check = compiler.guide(constraint, len(prompt))
    assert len(drafts) == 40 and check.valid_prefix(prompt, drafts) == 40
    # a point inside the record where the mask leaves no choice (a key's rest, a separator)
    cut = next(i for i in range(40) if check.forced(prompt + drafts[:i], 8, certain=True))
    after = drafts[:cut]
    forced = check.forced(prompt + after, 8, certain=True)
    drafter.reset(prompt)
    before = drafter.forced_drafted
    again = drafter.draft(len(forced) + 1, after=after)
    assert again[: len(forced)] == forced and drafter.forced_drafted - before == len(forced)
    # the draft after them is M's masked argmax
    context = prompt + after + forced
    with torch.no_grad():
        logits = draft_model(torch.tensor([context])).logits[0, -1]
    mask_guide = compiler.guide(constraint, len(prompt))
    scores = processed_scores(logits, context, with_output_start(greedy, len(prompt)), mask_guide)
    assert again[len(forced)] == int(scores.argmax())
    assert check.forced(prompt + after, 8, certain=True) == forced  # the guides were left where they were

    sampled = SamplingParams(do_sample=True, top_k=8, seed=3, constraint=constraint)
    drafter = ModelDrafter(draft_model, sampled, 8, sample=True, compiler=compiler)
    drafter.reset(prompt)
    drafts = drafter.draft(len(forced) + 3, after=after)
    assert drafts[: len(forced)] == forced
    assert check.valid_prefix(prompt + after, drafts) == len(drafts) == len(drafter.last_q) == len(drafter.last_dists)
    assert drafter.last_q[: len(forced)] == [1.0] * len(forced)
    assert all(float(q[t]) == 1.0 and float(q.sum()) == 1.0 for q, t in zip(drafter.last_dists, forced))
    assert all(0 < q <= 1 for q in drafter.last_q)
    with pytest.raises(ValueError, match="ConstraintCompiler"):
        ModelDrafter(draft_model, sampled, 8, sample=True)


class MaskedDrafts:
    """What ModelDrafter(sample=True, compiler=...) drafts after ``prompt`` (forced ids first with a
    one-hot q, then draws from M's masked, processed q), from memoized full-context logits of M
    (test_rejection_sampling's Rows): 2,000 seeds visit a handful of contexts, so M runs a few times,
    not twice per seed. The test below checks it drafts what ModelDrafter does, seed by seed."""

    def __init__(self, rows, guide, prompt: list[int]):
        self.rows, self.guide, self.prompt = rows, guide, prompt
        self.dists: dict[tuple[int, ...], torch.Tensor] = {}

    def draft(self, params: SamplingParams, n: int) -> tuple[list[int], list[float], list[torch.Tensor]]:
        sequence, drafts, q, dists = list(self.prompt), [], [], []
        while len(drafts) < n:
            for token in self.guide.forced(sequence, n - len(drafts), certain=True):
                one_hot = torch.zeros(self.guide.vocab_size)
                one_hot[token] = 1.0
                drafts, sequence, q, dists = drafts + [token], sequence + [token], q + [1.0], dists + [one_hot]
            if len(drafts) >= n:
                break
            key = tuple(sequence)
            if key not in self.dists:  # processing ignores the seed: one q per context
                self.dists[key] = torch.softmax(processed_scores(self.rows(sequence), sequence, params, self.guide), -1)
            dist = self.dists[key]
            token = draw_draft(dist, params.seed, len(sequence))
            drafts, sequence, q, dists = drafts + [token], sequence + [token], q + [float(dist[token])], dists + [dist]
        return drafts, q, dists


CHECKED_SEEDS = 100  # seeds whose drafts ModelDrafter itself computes, checked equal to MaskedDrafts'


def test_constrained_rejection_exchange_matches_the_masked_target_over_2000_seeds(
    tiny_model, tiny_reference, draft_model
):
    """In process, as client and tail compute it: the client samples 2 drafts from its masked q
    (ModelDrafter for the first CHECKED_SEEDS seeds, its memoized equivalent MaskedDrafts, checked
    equal on those, for the rest), the tail's verify_rejection (under its own Guide) accepts or
    corrects, the client draws the correction from p - q. The first token follows the masked target p
    exactly (chi-square, p > 1e-3), and every token is one the constraint allows."""
    from protocol.sampling import check_draft_q, pack_f16, sample_correction, unpack_f16, verify_rejection
    from tests.generation.test_rejection_sampling import FALSE_ALARM, Rows, chi_square_p, counts_of

    compiler = compiler_for(tiny_model.tokenizer, tiny_model.config.vocab_size)
    constraint = constraint_from_options(guided_regex="[a-z]+ [a-z]+")
    prompt = prompt_ids(tiny_model)
    target = Rows(tiny_reference)

    def params_for(seed):
        return SamplingParams(do_sample=True, top_k=8, seed=seed, constraint=constraint, output_start=len(prompt))

    mask = compiler.guide(constraint, len(prompt))
    expected_p = torch.softmax(processed_scores(target(prompt), prompt, params_for(0), mask), -1)
    support = {int(t): float(expected_p[t]) for t in expected_p.nonzero().flatten()}
    assert len(support) > 1  # a real choice, not a forced token
    check = compiler.guide(constraint, len(prompt))
    memoized = MaskedDrafts(Rows(draft_model), compiler.guide(constraint, len(prompt)), prompt)
    firsts, corrected = [], 0
    with single_torch_thread():
        for seed in range(2000):
            params = params_for(seed)
            drafts, q, dists = memoized.draft(params, 2)
            if seed < CHECKED_SEEDS:
                drafter = ModelDrafter(draft_model, params, 2, sample=True, compiler=compiler)
                drafter.reset(prompt)
                assert drafter.draft(2) == drafts, seed
                assert drafter.last_q == pytest.approx(q, rel=1e-4), seed
                q, dists = drafter.last_q, drafter.last_dists
            start_pos, history = len(prompt) - 1, prompt + drafts
            rows = [target(history[: i + 1]) for i in range(start_pos, len(history))]
            wire_q = check_draft_q(pack_f16(q), len(drafts))
            tail_guide = compiler.guide(constraint, len(prompt))
            accepted, token, correction, _ = verify_rejection(
                rows, history, start_pos, len(drafts), params, wire_q, guide=tail_guide
            )
            if correction is not None:
                ids, top_p = correction[0], unpack_f16(pack_f16(correction[1]))
                position = len(prompt) + accepted
                token = sample_correction(ids, top_p, dists[accepted], params.seed, position)
                corrected += 1
            committed = drafts[:accepted] + [token]
            assert check.valid_prefix(prompt, committed) == len(committed)
            firsts.append(committed[0])
    assert chi_square_p(counts_of(firsts), support, 2000) > FALSE_ALARM
    assert 0 < corrected < 2000
