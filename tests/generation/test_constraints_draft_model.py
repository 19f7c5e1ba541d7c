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
from protocol.sampling import processed_scores, with_output_start
from protocol.seeded_draws import seeded_choice
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


def test_constrained_rejection_exchange_matches_the_masked_target_over_2000_seeds(
    tiny_model, tiny_reference, draft_model
):
    """In process, as client and tail compute it: ModelDrafter (M's rows memoized) samples up to 2
    drafts a lap from its masked q (as the decoder sizes laps for 3 tokens), the tail's
    verify_rejection (under its own Guide) accepts or corrects, the client draws the correction from
    p - q. The first three tokens follow the masked target's joint distribution p(a) p(b | a) p(c | a b)
    exactly (chi-square over its cells, those expecting < 5 pooled, p > 1e-3), as plain seeded sampling
    under the mask does; a client that corrects from p instead fails the first token's test (the test
    has power); every token is one the constraint allows, and both branches ran (some laps accepted
    every draft, some corrected)."""
    from protocol.sampling import check_draft_q, pack_f16, sample_correction, unpack_f16, verify_rejection
    from tests.generation.test_rejection_sampling import FALSE_ALARM, Rows, chi_square_p, counts_of

    compiler = compiler_for(tiny_model.tokenizer, tiny_model.config.vocab_size)
    constraint = constraint_from_options(guided_regex="[a-z]+ [a-z]+")
    prompt = prompt_ids(tiny_model)
    target, seeds, length = Rows(tiny_reference), 2000, 3
    draft_rows = Rows(draft_model)

    class Drafter(ModelDrafter):  # M's rows memoized across seeds (its own KV cache: test_rejection_sampling.py)
        def _next_logits(self, sequence):
            return draft_rows(sequence)

    def params_for(seed):
        return SamplingParams(do_sample=True, top_k=8, seed=seed, constraint=constraint, output_start=len(prompt))

    mask = compiler.guide(constraint, len(prompt))

    masked: dict[tuple, torch.Tensor] = {}

    def masked_probs(context) -> torch.Tensor:  # the masked, processed target distribution (any seed's)
        if tuple(context) not in masked:
            scores = processed_scores(target(context), context, params_for(0), mask)
            masked[tuple(context)] = torch.softmax(scores, -1)
        return masked[tuple(context)]

    def masked_p(context) -> dict[int, float]:
        probs = masked_probs(context)
        return {int(t): float(probs[t]) for t in probs.nonzero().flatten()}

    def plain_sample(seed: int) -> tuple[int, ...]:  # choose_token's draw, with the distributions memoized
        tokens = list(prompt)
        for _ in range(length):
            draw = seeded_choice(masked_probs(tokens), seed, len(tokens))
            tokens.append(int(draw))
        return tuple(tokens[len(prompt) :])

    first = masked_p(prompt)
    assert len(first) > 1  # a real choice, not a forced token
    joint = {
        (a, b, c): pa * pb * pc
        for a, pa in first.items()
        for b, pb in masked_p(prompt + [a]).items()
        for c, pc in masked_p(prompt + [a, b]).items()
    }
    check = compiler.guide(constraint, len(prompt))
    outputs, plain, naive_firsts, corrected, whole = [], [], [], 0, 0
    with single_torch_thread():
        for seed in range(seeds):
            params = params_for(seed)
            drafter = Drafter(draft_model, params, 2, sample=True, compiler=compiler)
            drafter.reset(prompt)
            tail_guide, new = compiler.guide(constraint, len(prompt)), []
            while len(new) < length:
                context = prompt + new
                drafts = drafter.draft(min(2, length - len(new) - 1))
                start_pos, history = len(context) - 1, context + drafts
                rows = [target(history[: i + 1]) for i in range(start_pos, len(history))]
                wire_q = check_draft_q(pack_f16(drafter.last_q), len(drafts))
                accepted, token, correction, _ = verify_rejection(
                    rows, history, start_pos, len(drafts), params, wire_q, guide=tail_guide
                )
                if correction is not None:
                    ids, top_p = correction[0], unpack_f16(pack_f16(correction[1]))
                    position = len(context) + accepted
                    token = sample_correction(ids, top_p, drafter.last_dists[accepted], params.seed, position)
                    if not new and accepted == 0:  # what a client correcting from p would commit first
                        naive = torch.zeros_like(drafter.last_dists[accepted])
                        naive_firsts.append(sample_correction(ids, top_p, naive, params.seed, position))
                    corrected += 1
                elif drafts:
                    whole += 1
                if not new and (correction is None or accepted > 0):
                    naive_firsts.append(drafts[0] if drafts else token)
                committed = (drafts[:accepted] + [token])[: length - len(new)]
                drafter.extend(committed)
                new += committed
            assert check.valid_prefix(prompt, new) == length
            outputs.append(tuple(new))
            plain.append(plain_sample(seed))
    assert chi_square_p(counts_of(outputs), joint, seeds) > FALSE_ALARM
    assert chi_square_p(counts_of(plain), joint, seeds) > FALSE_ALARM
    assert chi_square_p(counts_of(naive_firsts), first, seeds) < FALSE_ALARM
    assert corrected > 0 and whole > 0
