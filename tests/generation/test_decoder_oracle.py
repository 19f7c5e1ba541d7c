"""The client's decoder against an oracle target (tests/kit/oracle.py): no servers, so every
scheduling choice (window, split front runs, hedges, cancels) can be checked on many streams in
milliseconds. The oracle fails the test if the decoder ever reads the verdict of a run whose
assumptions were wrong, and the output must be the target, token for token."""

from __future__ import annotations

import asyncio
import random

import pytest

from client._generation import SessionState, SpeculativeDecoder
from client.drafting import SuffixDrafter, SuffixStore
from client.drafting.base import _AdaptiveDrafter
from protocol.messages import GREEDY
from tests.kit.drafters import ScriptedDrafter
from tests.kit.oracle import OracleSwarm

EOS = 0


def stream(seed: int, length: int = 160) -> tuple[list[int], list[int]]:
    """(prompt, answer) over a small vocabulary, with phrases repeated from the prompt: drafts that
    are often right, sometimes long, and often wrong somewhere."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(1, 60) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
    text: list[int] = []
    while len(text) < length + 40:
        text += rng.choice(phrases) if rng.random() < 0.75 else [rng.randrange(1, 60)]
    return text[:40], text[40 : 40 + length]


class RecordingDrafter(SuffixDrafter):
    def __init__(self, *args, **kwargs):
        self.observed: list[tuple[int, int]] = []
        super().__init__(*args, **kwargs)

    def observe(self, drafted: int, accepted: int) -> None:
        self.observed.append((drafted, accepted))
        super().observe(drafted, accepted)


def decode(prompt, answer, inflight: int, front_drafts=None, num_draft_tokens: int = 6, lap_costs=None):
    swarm = OracleSwarm(prompt + answer, EOS)
    drafter = RecordingDrafter(num_draft_tokens, store=SuffixStore(), eos_token_ids=[EOS])
    if lap_costs is not None:  # the draft cost model at fixed prices: Step shapes from the verdicts alone
        drafter.price_laps(lap_costs)
    decoder = SpeculativeDecoder(
        swarm,
        SessionState(max_length=len(prompt) + len(answer) + num_draft_tokens + 1),
        GREEDY,
        drafter=drafter,
        num_draft_tokens=num_draft_tokens,
        max_inflight_runs=inflight,
        eos_token_ids=[EOS],
        front_drafts=front_drafts,
    )
    out = asyncio.run(decoder.generate(prompt, len(answer)))
    return out, decoder.stats, swarm.session, drafter


@pytest.mark.parametrize("front_drafts", [None, 0, 1, 2])
@pytest.mark.parametrize("inflight", [1, 2, 3, 5])
def test_every_window_and_front_split_reproduces_the_target(inflight, front_drafts):
    for seed in range(6):
        prompt, answer = stream(seed)
        out, stats, _, _ = decode(prompt, answer, inflight, front_drafts)
        assert out == answer, seed
        if inflight > 1:
            assert stats.runs_sent > stats.laps  # runs did overlap


@pytest.mark.parametrize("front_drafts", [0, 1])
def test_a_split_front_run_carries_at_most_front_drafts(front_drafts):
    prompt, answer = stream(3)
    _, stats, session, _ = decode(prompt, answer, 3, front_drafts)
    fronts = [step for run_id, step in session.steps.items() if run_id not in session.overlapped]
    assert len(fronts) > 10 and all(step.n_draft <= front_drafts for step in fronts)
    assert max(step.n_draft for step in session.steps.values()) > front_drafts  # the rest went behind
    assert stats.accepted > 0


class AlwaysWrongDrafter(_AdaptiveDrafter):
    """Proposes as many drafts as its adaptive cap allows, every one of them wrong."""

    def reset(self, context):
        pass

    def extend(self, new_tokens):
        pass

    def draft(self, max_tokens, after=()):
        return [99] * max_tokens  # the streams use ids 1..59

    def finish(self):
        pass


@pytest.mark.parametrize("inflight, front_drafts", [(1, None), (3, None), (3, 0), (2, 1)])
def test_a_split_proposal_teaches_the_adaptive_length_as_a_whole(inflight, front_drafts):
    """A split front run carries fewer drafts than were proposed; its refutation must still count
    against the whole proposal, or the draft length would never shrink. The adaptive length alone:
    the draft cost model prices positions at nothing (it would price the oracle's near-zero, noisy lap
    times), so it never cuts a draft."""
    prompt, answer = stream(5, length=40)
    drafter = AlwaysWrongDrafter(6)
    drafter.price_laps((1.0, 0.0))
    decoder = SpeculativeDecoder(
        OracleSwarm(prompt + answer, EOS),
        SessionState(max_length=100),
        GREEDY,
        drafter=drafter,
        num_draft_tokens=6,
        max_inflight_runs=inflight,
        front_drafts=front_drafts,
    )
    assert asyncio.run(decoder.generate(prompt, len(answer))) == answer
    assert drafter.draft_cap == 1


def test_front_drafts_are_ignored_without_a_window():
    # the same Steps in both runs: the draft cost model prices laps at fixed costs, not wall-clock times
    prompt, answer = stream(2)
    _, sync_stats, sync_session, _ = decode(prompt, answer, 1, lap_costs=(0.05, 0.002))
    _, split_stats, split_session, _ = decode(prompt, answer, 1, front_drafts=0, lap_costs=(0.05, 0.002))
    assert [s.token_ids for s in sync_session.steps.values()] == [s.token_ids for s in split_session.steps.values()]
    assert sync_stats.laps == split_stats.laps


def test_no_split_when_the_rest_of_the_proposal_could_not_follow():
    """With one token of budget left after the front's guess there is no room for a run behind it,
    so the front keeps its draft and one verdict commits both tokens, as synchronously."""
    prompt, answer = stream(4)
    for start in (0, 7, 19, 40):
        context, rest = prompt + answer[:start], answer[start : start + 2]
        swarm = OracleSwarm(context + rest, EOS)
        truth = ScriptedDrafter(rest, len(context), length=6)
        decoder = SpeculativeDecoder(
            swarm, SessionState(max_length=200), GREEDY, drafter=truth, num_draft_tokens=6, max_inflight_runs=3
        )
        assert asyncio.run(decoder.generate(context, 2)) == rest
        assert decoder.stats.laps == 1 and decoder.stats.accepted == 1
