"""The seeded draws every peer makes alike (protocol/seeded_draws.py): a pinned stream, exact draws, the
Gumbel-max identity the evidence rule reads, and refusals of weights nothing can be drawn from."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.messages import SamplingParams
from protocol.sampling import choose_token
from protocol.seeded_draws import draw_noise, seeded_choice, seeded_uniform, uniforms


def test_the_stream_is_pinned():
    """The numbers every peer must draw for (seed 1, position 0): a change to the key, the bit
    generator or the conversion would make peers disagree on sampled tokens, and fails here first.
    Written down from numpy 2.4's Philox; NumPy keeps bit generators' raw streams across versions."""
    assert uniforms(1, 0, 3).tolist() == [0.6511502548937484, 0.6220673773435663, 0.3829264866527963]
    assert uniforms(1, 0, 3, "accept").tolist() == [0.03391818272194941, 0.06405117926092968, 0.34456139604498154]
    assert seeded_uniform(1, 0, "accept") == 0.03391818272194941
    assert uniforms(1, 1, 3).tolist() != uniforms(1, 0, 3).tolist() != uniforms(2, 0, 3).tolist()


def test_draws_are_distributed_as_the_weights():
    """4,000 positions drawing from p = (0.5, 0.3, 0.15, 0.05, 0): the counts pass a chi-square test
    at 0.1% (13.8 for 3 degrees of freedom) and the zero-weight id is never drawn."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    counts = [0] * 5
    for position in range(4000):
        counts[seeded_choice(p, 7, position)] += 1
    assert counts[4] == 0
    chi2 = sum((c - 4000 * float(q)) ** 2 / (4000 * float(q)) for c, q in zip(counts[:4], p[:4]))
    assert chi2 < 13.8, counts


def test_a_sampled_token_is_the_argmax_of_logits_over_t_plus_the_noise():
    """choose_token's seeded draw equals argmax(logits / T + G), G = draw_noise(seed, t): the identity
    client/_evidence.py settles sampled disputes with."""
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(do_sample=True, temperature=0.7, seed=5)
    for position in range(50):
        logits = torch.randn(300, generator=g) * 4
        drawn = choose_token(logits, [], position, params)
        assert drawn == int((logits / 0.7 + draw_noise(5, position, 300)).argmax())


@pytest.mark.parametrize("weights", [[0.0, 0.0], [0.5, -0.1], [math.nan, 1.0]])
def test_weights_nothing_can_be_drawn_from_are_refused(weights):
    with pytest.raises(ValueError, match="non-negative weights with a positive sum"):
        seeded_choice(torch.tensor(weights), 1, 0)
