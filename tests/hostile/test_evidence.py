"""Disputes settled by evidence the client checks itself (client/_evidence.py, client/_lm_head.py):
the rule on fabricated hidden states, and the LM-head rows read from a real checkpoint. The live
framing scenario is in tests/hostile/test_sybils.py (``refuted_by_evidence``)."""

from __future__ import annotations

import torch

from client._evidence import LEAN_SPREAD, plain_greedy, plain_sampled, settle
from client._lm_head import HeadSums, LMHeadRows
from client._output_evidence import settle_logits, settle_logprobs
from protocol.messages import GREEDY, SamplingParams
from protocol.sampling import choose_token, top_logprobs
from protocol.seeded_draws import draw_noise

TOL = 1e-3  # float32's (client/_output_audits.py OUTPUT_TOLERANCES)


def test_agreed_hidden_states_refute_the_token_that_is_not_the_argmax():
    g = torch.Generator().manual_seed(0)
    head = torch.randn(50, 16, generator=g)
    h = torch.randn(16, generator=g)
    order = (head @ h).argsort(descending=True).tolist()
    best, second = order[0], order[1]
    # the route's tail chose the argmax, the shadow the second choice: the shadow is refuted
    assert settle(h, h.clone(), head[best], head[second], TOL).refuted == "shadow"
    # the other way round: the route's tail is refuted
    assert settle(h, h.clone(), head[second], head[best], TOL).refuted == "tail"
    # hidden states that differ (a tail that made one up to fit its verdict) settle nothing
    made_up = h + 0.5 * (head[second] - head[best])
    found = settle(h, made_up, head[best], head[second], TOL)
    assert found.refuted is None and "differ" in found.detail
    # a near tie (the two rows almost equal) settles nothing
    tie = settle(h, h.clone(), head[best], head[best] + 1e-6, TOL)
    assert tie.refuted is None and "near tie" in tie.detail


def test_a_near_tie_leans_against_the_token_that_loses_at_the_one_state_both_sent():
    """Inside the margin nothing is refuted, but where both tails sent one hidden state (within
    ``LEAN_SPREAD``) the token that loses there is named (``leans``), for the fallback order only; a state
    moved further (a tail tilting the lean) or a gap within float32 arithmetic names nobody."""
    g = torch.Generator().manual_seed(2)
    head = torch.randn(50, 16, generator=g)
    h = torch.randn(16, generator=g)
    order = (head @ h).argsort(descending=True).tolist()
    best = head[order[0]]
    close = best - 1e-4 * h.sign() / 16  # h . close is 1e-4 (times mean |h|) under h . best: inside the margin
    found = settle(h, h.clone(), best, close, TOL)
    assert found.refuted is None and "near tie" in found.detail and found.leans == "shadow"
    assert settle(h, h.clone(), close, best, TOL).leans == "tail"  # the route's tail named the loser
    scale = max(1.0, float(h.abs().max()))
    tilted = h + 10 * LEAN_SPREAD * scale * torch.sign(best - close)  # within the tolerance, past the lean's
    moved = settle(h, tilted, close, best, TOL)
    assert moved.refuted is None and moved.leans is None
    assert settle(h, h.clone(), best, best.clone(), TOL).leans is None  # a gap of 0: no side
    assert settle(h, h.clone(), best, head[order[-1]], TOL).leans is None  # settled: no lean needed


def test_an_honest_argmax_is_never_refuted_whatever_the_other_side_sends_within_the_tolerance():
    """Soundness against framing: the tail that chose the argmax of its own h is never refuted, for
    any h the other side sends (agreeing within the tolerance, or not) and any other token."""
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        head = torch.randn(40, 8, generator=g)
        h = torch.randn(8, generator=g) * 3
        honest = int((head @ h).argmax())
        for other in range(40):
            if other == honest:
                continue
            scale = max(1.0, float(h.abs().max()))
            nudged = h + (torch.rand(8, generator=g) * 2 - 1) * TOL * scale * 0.99
            for shadow_h in (nudged, h + torch.randn(8, generator=g)):
                assert settle(h, shadow_h, head[honest], head[other], TOL).refuted != "tail"
                assert settle(shadow_h, h, head[other], head[honest], TOL).refuted != "shadow"


def test_only_plain_greedy_is_settled_by_two_rows():
    assert plain_greedy(GREEDY) and plain_greedy(SamplingParams(output_start=7))
    for other in (
        SamplingParams(do_sample=True, seed=1),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(logit_bias={3: 1.0}),
    ):
        assert not plain_greedy(other)


def test_lm_head_rows_are_read_from_the_checkpoint_without_the_whole_matrix(tiny_llama_path, tiny_reference):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_path)
    rows = LMHeadRows(str(tiny_llama_path), config)
    got = rows.rows([5, 0, config.vocab_size - 1])
    want = tiny_reference.lm_head.weight.detach().float()[[5, 0, config.vocab_size - 1]]
    assert got is not None and torch.equal(got, want)
    assert rows.rows([config.vocab_size]) is None  # out of the vocabulary
    assert LMHeadRows("some-org/some-model", config).rows([5]) is None  # a hub repo: not downloaded for this


def _head(seed: int, vocab: int = 40, hidden: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g), g


def test_disputed_logits_refute_the_tail_whose_numbers_are_not_h_times_the_rows():
    head, g = _head(2)
    h = torch.randn(3, 8, generator=g) * 3
    honest = h @ head.T
    lie = honest.clone()
    lie[:, 5] += 3.0  # a liar that shifts one logit per row, sending its true h

    def rows(ids):
        return head[ids]

    assert settle_logits(h, h.clone(), lie, honest, rows, TOL, 1e-4, 1e-5).refuted == "tail"
    assert settle_logits(h, h.clone(), honest, lie, rows, TOL, 1e-4, 1e-5).refuted == "shadow"
    made_up = settle_logits(h + 0.5, h, (h + 0.5) @ head.T, honest, rows, TOL, 1e-4, 1e-5)  # a made-up h
    assert made_up.refuted is None and "differ" in made_up.detail
    assert settle_logits(h, h, honest, honest.clone(), rows, TOL, 1e-4, 1e-5).refuted is None  # nothing disputed


def test_an_honest_tail_is_never_refuted_over_logits_or_log_probs():
    """Soundness against framing: honest numbers (h . W, in float32 or rounded as a 16-bit server
    rounds them) are never refuted, whatever the other side sends: lies, shaded h within the
    tolerance, or an h of its own."""
    for seed in range(20):
        head, g = _head(100 + seed)
        h = torch.randn(2, 8, generator=g) * 3
        for dtype, noise, rounding, tol in ((torch.float32, 1e-4, 1e-5, TOL), (torch.bfloat16, 0.04, 8e-3, 0.08)):
            honest = (h.to(dtype) @ head.to(dtype).T).float()
            scale = float(h.abs().max())
            shaded = h + (torch.rand(2, 8, generator=g) * 2 - 1) * tol * scale * 0.99
            for other_h in (shaded, h + torch.randn(2, 8, generator=g)):
                other = other_h @ head.T + torch.randn(2, 40, generator=g)
                found = settle_logits(h, other_h, honest, other, lambda ids: head[ids], tol, noise, rounding)
                assert found.refuted != "tail", found.detail
                head_reader = _Streamed(head)
                mine = top_logprobs(honest[0], int(honest[0].argmax()), 3)
                theirs = top_logprobs(other[0], int(other[0].argmax()), 3)
                found = settle_logprobs(h[0], other_h[0], mine, theirs, head_reader, tol, noise, rounding)
                assert found.refuted != "tail", found.detail


class _Streamed:
    """An LMHeadRows stand-in over an in-memory head (the streaming itself is tested on a checkpoint)."""

    def __init__(self, head):
        self.head = head

    def rows(self, ids):
        return self.head[ids]

    def stream(self, h):
        logits = h @ self.head.T
        return HeadSums(
            logits.double().logsumexp(-1), float(self.head.abs().sum(-1).max()), (h.abs() @ self.head.abs().T).amax(-1)
        )


def test_log_probs_shaded_by_half_a_nat_are_refuted_over_the_whole_head(tiny_llama_path, tiny_reference):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_path)
    head = LMHeadRows(str(tiny_llama_path), config)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, config.hidden_size, generator=g)
    weight = tiny_reference.lm_head.weight.detach().float()
    sums = head.stream(h, chunk=8000)  # 7 chunks of the 49,152 rows, the last one short
    assert sums is not None
    torch.testing.assert_close(sums.lse, (h @ weight.T).double().logsumexp(-1), rtol=1e-6, atol=1e-6)
    logits = h[0] @ weight.T
    honest = top_logprobs(logits, int(logits.argmax()), 3)
    shaded = top_logprobs(logits, int(logits.argmax()), 3)
    shaded.logprob += 0.5
    shaded.top_logprobs = [v + 0.5 for v in shaded.top_logprobs]
    assert settle_logprobs(h[0], h[0].clone(), shaded, honest, head, TOL, 1e-4, 1e-5).refuted == "tail"
    assert settle_logprobs(h[0], h[0].clone(), honest, shaded, head, TOL, 1e-4, 1e-5).refuted == "shadow"
    missing = top_logprobs(logits, int(logits.argmax()), 3)  # a list that leaves out the second choice
    missing.top_ids, missing.top_logprobs = (
        [missing.top_ids[0], *missing.top_ids[2:]],
        [
            missing.top_logprobs[0],
            *missing.top_logprobs[2:],
        ],
    )
    assert settle_logprobs(h[0], h[0].clone(), honest, missing, head, TOL, 1e-4, 1e-5).refuted == "shadow"
    assert settle_logprobs(h[0], h[0] + 0.5, honest, shaded, head, TOL, 1e-4, 1e-5).refuted is None


def test_a_seeded_draw_is_an_argmax_and_settles_like_a_greedy_token():
    """choose_token's seeded draw is argmax(logits / T + G) with G fixed by (seed, position) alone, so
    an honest tail's drawn token is never refuted and the other side's second choice is."""
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(do_sample=True, temperature=0.8, seed=11)
    assert plain_sampled(params) and not plain_sampled(SamplingParams(do_sample=True, top_p=0.9, seed=1))
    for position in range(40):
        head = torch.randn(50, 16, generator=g)
        h = torch.randn(16, generator=g) * 2
        drawn = choose_token(h @ head.T, [], position, params)
        noise = draw_noise(params.seed, position, 50)
        assert drawn == int(((h @ head.T) / params.temperature + noise).argmax())
        for other in range(50):
            if other == drawn:
                continue
            offset = float(noise[drawn] - noise[other])
            found = settle(h, h.clone(), head[drawn], head[other], TOL, temperature=0.8, offset=offset)
            assert found.refuted != "tail"  # never the honest draw
            back = settle(h, h.clone(), head[other], head[drawn], TOL, temperature=0.8, offset=-offset)
            assert back.refuted != "shadow"
        rival = int(((h @ head.T) / params.temperature + noise).topk(2).indices[1])
        offset = float(noise[drawn] - noise[rival])
        found = settle(h, h.clone(), head[drawn], head[rival], TOL, temperature=0.8, offset=offset)
        assert found.refuted in ("shadow", None)  # refuted unless a near tie
