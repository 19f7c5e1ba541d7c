"""Disputed tokens under every sampling processor, and rejection decisions, settled by evidence
(client/_processed_evidence.py) on real SmolLM2-135M final hidden states and its LM head: an honest
token (or decision) is never refuted, whatever the other side's h within the tolerance, including
near ties built on purpose; a token no admissible perturbation lets win is refuted. The live
scenario is in tests/hostile/test_sybils.py (``top_k_penalised``)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from client._evidence import HIDDEN_NOISE, ROUNDING
from client._processed_evidence import (
    correction_fits,
    logit_bounds,
    possible_winners,
    processed_bounds,
    settle_corrections,
    settle_decision,
    settle_token,
)
from protocol.messages import Constraint, SamplingParams
from protocol.sampling import choose_token, correction_top_k, pack_f16, processed_scores, unpack_f16
from protocol.seeded_draws import draw_noise, seeded_uniform

TOL = 1e-3  # float32's agreement tolerance (client/_output_audits.py)
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"

PROCESSORS = {
    "top_k": SamplingParams(do_sample=True, temperature=0.9, top_k=8, seed=3),
    "top_p": SamplingParams(do_sample=True, temperature=1.0, top_p=0.8, seed=5),
    "min_p": SamplingParams(do_sample=True, temperature=1.2, min_p=0.05, seed=7),
    "top_k+penalty": SamplingParams(do_sample=True, top_k=20, repetition_penalty=1.3, seed=9),
    "presence+frequency": SamplingParams(
        do_sample=True, top_p=0.95, presence_penalty=0.7, frequency_penalty=0.4, output_start=4, seed=11
    ),
    "logit_bias": SamplingParams(do_sample=True, temperature=0.7, logit_bias={13: 5.0, 42: -100.0}, seed=13),
    "greedy+penalty": SamplingParams(repetition_penalty=1.5, logit_bias={29: 3.0}),
}


@pytest.fixture(scope="module")
def smol(smol_reference):
    """(ids, final hidden states [n, hidden] after the final norm, the LM head [vocab, hidden])."""
    from transformers import AutoTokenizer

    from protocol.models import ensure_smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        h = smol_reference.model(torch.tensor([ids])).last_hidden_state[0].float()
    return ids, h, smol_reference.lm_head.weight.detach().float(), tokenizer


_ABS: dict = {}  # the head's |W| and row L1 norms, computed once (113 MB each time otherwise)


def products(h_a, h_b, w):
    """What client/_lm_head.py ``products`` streams from the checkpoint, from the head in memory."""
    if id(w) not in _ABS:
        _ABS.clear()
        _ABS[id(w)] = (w.abs(), w.abs().sum(-1))
    w_abs, l1 = _ABS[id(w)]
    h = torch.stack([h_a, h_b])
    return h @ w.T, l1, (h.abs() @ w_abs.T).amax(0)


def shaded(h, g, tol=TOL):
    """Another h within the agreement tolerance (what a dishonest side may send and still agree)."""
    scale = max(1.0, float(h.abs().max()))
    return h + (torch.rand(h.shape, generator=g) * 2 - 1) * tol * scale * 0.99


def bounds_at(h_a, h_b, w, ids, t, params, dtype="float32", guide=None):
    lo, hi = logit_bounds(h_a, h_b, products(h_a, h_b, w), HIDDEN_NOISE[dtype], ROUNDING[dtype])
    return processed_bounds(lo, hi, ids[:t], params, guide)


def noise_of(params, t, vocab):
    return draw_noise(params.seed, t, vocab) if params.do_sample else None


@pytest.fixture(scope="module")
def shaded_bounds(smol):
    """Per (position, dtype) of the last 3 positions: the honest logits (float32, or rounded through
    bfloat16 as a 16-bit server computes them) and the logit bounds against a shaded h (the other side's)."""
    ids, h, w, _ = smol
    g = torch.Generator().manual_seed(0)
    found = {}
    for t in range(len(ids) - 3, len(ids)):
        for dtype in ("float32", "bfloat16"):
            honest = (h[t - 1].to(getattr(torch, dtype)) @ w.to(getattr(torch, dtype)).T).float()
            other = shaded(h[t - 1], g, TOL if dtype == "float32" else 0.08)
            lo, hi = logit_bounds(h[t - 1], other, products(h[t - 1], other, w), HIDDEN_NOISE[dtype], ROUNDING[dtype])
            found[t, dtype] = honest, lo, hi
    return found


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_an_honest_token_is_never_refuted_and_an_impossible_one_is(smol, shaded_bounds, name):
    """For each processor, at 3 positions x 2 dtypes x 4 seeds: the honest tail's token (choose_token on
    its own logits) is always a possible winner, so it is never refuted against any rival, whichever side
    sends the shaded h (checked against a rival that cannot win and one or two that can); the rivals that
    cannot win are refuted, and some are."""
    ids, _, w, _ = smol
    refuted = 0
    for (t, dtype), (honest_logits, lo, hi) in shaded_bounds.items():
        b = processed_bounds(lo, hi, ids[:t], PROCESSORS[name])  # the seed moves only the draw's noise
        for seed in range(4):
            params = msgspec.structs.replace(PROCESSORS[name], seed=seed)
            honest = choose_token(honest_logits, ids[:t], t, params)
            noise = noise_of(params, t, w.shape[0])
            winners = possible_winners(b, noise if noise is not None else 0)
            assert winners[honest], (name, t, seed, dtype)  # so no rival's side can get it refuted
            rivals = [int(v) for v in (~winners).nonzero()[:1, 0]] + [int(v) for v in winners.nonzero()[:2, 0]]
            for rival in (r for r in rivals if r != honest):
                assert settle_token(b, noise, honest, rival, "").refuted != "tail"
                assert settle_token(b, noise, rival, honest, "").refuted != "shadow"
                if not winners[rival]:
                    assert settle_token(b, noise, rival, honest, "").refuted == "tail"
                    refuted += 1
    assert refuted > 0


def test_near_ties_built_on_purpose_settle_nothing(smol):
    """A top-p boundary on the exact cumulative mass of a token, and a draw whose two best noised scores
    are made equal: the honest token is still possible, the rival too (a near tie), nothing refuted."""
    ids, h, w, _ = smol
    t = len(ids) - 1
    logits = h[t - 1] @ w.T
    probs = torch.softmax(logits, -1).sort(descending=True).values
    for cut in (3, 5, 9):  # top_p exactly at the mass of the first `cut` tokens: the next one is on the edge
        params = SamplingParams(do_sample=True, top_p=float(probs[:cut].sum()), seed=2)
        b = bounds_at(h[t - 1], h[t - 1].clone(), w, ids, t, params)
        honest = choose_token(logits, ids[:t], t, params)
        assert possible_winners(b, draw_noise(2, t, w.shape[0]))[honest]
    # the draw's winner and runner-up brought within a hair of each other by the noise itself
    params = SamplingParams(do_sample=True, top_k=5, seed=4)
    noise = draw_noise(4, t, w.shape[0])
    order = (logits + noise).topk(2).indices.tolist()
    noise[order[1]] += float((logits + noise)[order[0]] - (logits + noise)[order[1]]) - 1e-6
    b = bounds_at(h[t - 1], h[t - 1].clone(), w, ids, t, params)
    assert settle_token(b, noise, order[0], order[1], "").refuted is None
    assert settle_token(b, noise, order[1], order[0], "").refuted is None


def test_a_processed_near_tie_leans_against_the_token_the_rule_does_not_choose_at_the_one_state(smol):
    """The draw's runner-up brought 1e-3 under its winner (inside the bounds): nothing refuted, and with the
    token the session's own rule chooses from the one state both tails sent (``at_state``, client/
    _evidence_disputes.py: ``choose_token`` on its logits) the near tie leans against the side that named
    the other; with no such state (``None``), or a choice neither side named, nobody; a settled dispute
    needs no lean. (The bounds' own kept sets are no guide there: top-p's are conservative, so at exact
    logits the honest token was often only possibly kept, measured in the two-tail benchmark.)"""
    ids, h, w, _ = smol
    t = len(ids) - 1
    logits = h[t - 1] @ w.T
    params = SamplingParams(do_sample=True, top_k=5, seed=4)
    noise = draw_noise(4, t, w.shape[0])
    order = (logits + noise).topk(2).indices.tolist()
    noise[order[1]] += float((logits + noise)[order[0]] - (logits + noise)[order[1]]) - 1e-3
    b = bounds_at(h[t - 1], h[t - 1].clone(), w, ids, t, params)
    first, second = order
    assert settle_token(b, noise, first, second, "", at_state=first).leans == "shadow"
    assert settle_token(b, noise, first, second, "", at_state=second).leans == "tail"
    assert settle_token(b, noise, second, first, "", at_state=first).leans == "tail"
    for at_state in (None, 99):
        assert settle_token(b, noise, first, second, "", at_state=at_state).leans is None
    found = settle_token(b, noise, first, second, "", at_state=first)
    assert found.refuted is None and "near tie" in found.detail
    impossible = int((~possible_winners(b, noise)).nonzero()[0, 0])
    assert settle_token(b, noise, first, impossible, "", at_state=first).leans is None  # settled: "shadow"


def test_a_constrained_token_outside_the_mask_is_refuted(smol):
    """A regex constraint (the tail's Guide): a token the mask forbids cannot win; the honest draw can."""
    from client._calls import compiler_for

    ids, h, w, tokenizer = smol
    t = len(ids) - 1
    guide = compiler_for(tokenizer, w.shape[0]).guide(Constraint(kind="regex", spec="[0-9]+"), t)
    params = SamplingParams(do_sample=True, top_p=0.9, constraint=Constraint(kind="regex", spec="[0-9]+"), seed=1)
    params = msgspec.structs.replace(params, output_start=t)
    b = bounds_at(h[t - 1], h[t - 1].clone(), w, ids, t, params, guide=guide)
    honest = choose_token(h[t - 1] @ w.T, ids[:t], t, params, guide)
    forbidden = int((h[t - 1] @ w.T).argmax())  # " Madrid" (or whatever the model likes best) is no digit
    noise = draw_noise(1, t, w.shape[0])
    assert settle_token(b, noise, forbidden, honest, "").refuted == "tail"
    assert settle_token(b, noise, honest, forbidden, "").refuted == "shadow"


def test_rejection_decisions_are_refuted_only_when_impossible_under_honest_p(smol):
    """DSSD: the tail accepts draft x at t iff u q(x) < p(x). With q(x) far from p(x)/u the decision is
    certain and the contradicting side is refuted; with u q(x) on p(x) (a near tie) nothing is, and an
    honest decision is never refuted for any q."""
    ids, h, w, _ = smol
    refuted = 0
    for t in range(len(ids) - 3, len(ids)):
        b = bounds_at(
            h[t - 1], h[t - 1].clone(), w, ids, t, SamplingParams(do_sample=True, top_k=20, repetition_penalty=1.2)
        )
        for seed in range(3):  # the seed moves u alone
            params = SamplingParams(do_sample=True, top_k=20, repetition_penalty=1.2, seed=seed)
            logits = h[t - 1] @ w.T
            p = torch.softmax(processed_scores(logits, ids[:t], params), -1)
            u = seeded_uniform(seed, t, "accept")
            for x in p.topk(2).indices.tolist():
                for q in (1.0, 0.5, 0.05, 0.001, min(1.0, float(p[x]) / max(u, 1e-9))):
                    sent = float(torch.tensor(q).half())
                    honest = u * sent < float(p[x])
                    for tail_accepted in (True, False):
                        found = settle_decision(b, params, t, q, tail_accepted, not tail_accepted, x)
                        liar = "tail" if tail_accepted != honest else "shadow"
                        assert found.refuted in (liar, None), found.detail
                        refuted += found.refuted is not None
            edge = float(p[p.argmax()]) / u if u > 0 else 1.0
            if edge <= 1.0:  # u q(x) == p(x): the decision rides on rounding; nothing settled
                x = int(p.argmax())
                assert settle_decision(b, params, t, edge, True, False, x).refuted is None
    assert refuted > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rejection_corrections_are_refuted_only_when_no_honest_p_gives_them(smol, dtype):
    """Both tails rejected the draft and their corrections differ: the client drew each from the top-K
    of p that tail sent (float16). An honest top-K (p from logits rounded in the tail's dtype) always
    fits, against bounds from its h and another h within the tolerance too. A top-K naming only the
    lie with p 1 (tests/kit/faults.py), one with the two likeliest ids' probabilities swapped, or one
    that leaves the likeliest id out is never taken for the honest one, and where both tails sent the
    same h (float32 on CPU) it is refuted: the side that sent it, never the honest one."""
    ids, h, w, _ = smol
    g = torch.Generator().manual_seed(1)
    cast = getattr(torch, dtype)
    refuted = 0
    for params in (
        SamplingParams(do_sample=True, top_k=20, repetition_penalty=1.2, seed=1),
        SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=2),
    ):
        k = correction_top_k(params)
        for t in range(len(ids) - 3, len(ids)):
            other = shaded(h[t - 1], g, TOL if dtype == "float32" else 0.08)
            wide = bounds_at(h[t - 1], other, w, ids, t, params, dtype)
            same = bounds_at(h[t - 1], h[t - 1].clone(), w, ids, t, params, dtype)
            logits = (h[t - 1].to(cast) @ w.to(cast).T).float()  # what the honest tail computes
            p = torch.softmax(processed_scores(logits, ids[:t], params), -1)
            top_p, top_ids = p.topk(k)
            honest = (top_ids.tolist(), unpack_f16(pack_f16(top_p.tolist())))
            for b in (wide, same):
                assert correction_fits(b, honest, k)[0], correction_fits(b, honest, k)[1]
            swapped = (honest[0], [honest[1][1], honest[1][0], *honest[1][2:]])
            rest = p.topk(k + 1)
            left_out = (rest.indices.tolist()[1:], unpack_f16(pack_f16(rest.values.tolist()[1:])))
            for lie in (([honest[0][1]], [1.0]), swapped, left_out):
                for b in (wide, same):
                    assert settle_corrections(b, honest, lie, k, "").refuted in ("shadow", None)
                    assert settle_corrections(b, lie, honest, k, "").refuted in ("tail", None)
                if dtype == "float32" and (lie is not swapped or honest[1][0] - honest[1][1] > 0.05):
                    assert settle_corrections(same, honest, lie, k, "").refuted == "shadow"
                    assert settle_corrections(same, lie, honest, k, "").refuted == "tail"
                    refuted += 2
            assert settle_corrections(wide, honest, honest, k, "").refuted is None
    assert refuted >= (12 if dtype == "float32" else 0)


def test_the_checkpoints_head_gives_every_logit(smol):
    """client/_lm_head.py ``products`` streams SmolLM2's head in chunks: the same numbers as in memory."""
    from transformers import AutoConfig

    from client._lm_head import LMHeadRows
    from protocol.models import ensure_smollm2_checkpoint

    ids, h, w, _ = smol
    path = ensure_smollm2_checkpoint()
    head = LMHeadRows(str(path), AutoConfig.from_pretrained(path))
    got = head.products(h[-2:], chunk=20000)  # 3 chunks, the last one short
    assert got is not None
    for mine, want in zip(got, products(h[-2], h[-1], w)):
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-4)
