"""Disputes settled by evidence the client checks itself (client/_evidence.py, client/_lm_head.py):
the rule on fabricated hidden states, and the LM-head rows read from a real checkpoint. The live
framing scenario is in tests/hostile/test_sybils.py (``refuted_by_evidence``)."""

from __future__ import annotations

import torch

from client._evidence import plain_greedy, settle
from client._lm_head import LMHeadRows
from protocol.messages import GREEDY, SamplingParams

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
