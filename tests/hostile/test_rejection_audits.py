"""What a verdict audit under rejection sampling replays (client/_rejection_audits.py), without
servers: the live runs' drafts and q from any position, token match elsewhere, and the client's own
correction drawn from a shadow's top-K. The live test is tests/hostile/test_sybils.py -k rejection."""

from __future__ import annotations

import torch

from client._rejection_audits import RejectionRuns
from client._runs import Run
from protocol.messages import StepResult
from protocol.sampling import pack_f16, sample_correction, unpack_f16

VOCAB = 10


def live_run(first: int, drafts: list[int], q: list[float], replay: bool = False) -> Run:
    """A live run whose first draft lands at ``first`` (one committed token before its drafts)."""
    dists = [torch.full((VOCAB,), 1.0 / VOCAB) for _ in drafts]
    return Run(0, first - 1, [7, *drafts], drafts, None, draft_q=q, q_dists=dists, replay=replay)


def verdict(accepted: int) -> StepResult:
    """A live verdict accepting ``accepted`` drafts (no rejection's top-K: none is needed here)."""
    return StepResult(session_id="s", run_id=0, accepted=accepted, next_token=0)


def test_the_shadow_is_sent_the_live_runs_drafts_and_q_and_token_match_elsewhere():
    runs = RejectionRuns()
    runs.record(live_run(20, [1, 2, 3, 4], [0.5, 0.25, 0.5, 0.125]), verdict(1))  # 2 rejected at 21
    runs.record(live_run(23, [5, 6], [0.5, 0.5]), verdict(2))  # both accepted, bonus at 25
    runs.record(live_run(30, [8], [0.5], replay=True), verdict(1))  # a replay: token match, not recorded
    ids = list(range(100, 140))
    drafts, q, cut = runs.replay(ids, 20, 8)
    assert drafts == [1, 2, 3, 4] and unpack_f16(q) == [0.5, 0.25, 0.5, 0.125] and not cut
    drafts, q, cut = runs.replay(ids, 21, 8)  # the rejected draft, with its q: the shadow must reject it too
    assert drafts == [2, 3, 4] and unpack_f16(q) == [0.25, 0.5, 0.125]
    drafts, q, cut = runs.replay(ids, 20, 2)  # cut short: the token after them is not comparable
    assert drafts == [1, 2] and cut
    assert runs.covering(22) is None  # past the rejection: the next run committed 22 by its own verdict
    drafts, q, cut = runs.replay(ids, 22, 8)  # token match up to the next recorded run, whose first draft is 23
    assert drafts == [] and q is None  # the verdict's own token lands on 22
    drafts, q, cut = runs.replay(ids, 25, 8)  # after the last recorded run: committed ids as drafts
    assert drafts == ids[25:33] and q is None and not cut
    runs.forget()
    assert runs.replay(ids, 20, 3) == (ids[20:23], None, False)


def test_the_correction_is_the_clients_own_draw_from_the_shadows_top_k():
    runs = RejectionRuns()
    runs.record(live_run(20, [1, 2, 3], [0.5, 0.5, 0.5]), verdict(1))
    top_ids, top_p = [4, 2, 9], [0.5, 0.3, 0.2]
    result = StepResult(
        session_id="s", run_id=0, accepted=1, next_token=9, correction_ids=top_ids, correction_p=pack_f16(top_p)
    )
    expected = sample_correction(top_ids, unpack_f16(pack_f16(top_p)), runs.runs[20].dists[1], 42, 21)
    assert runs.chosen(result, [1, 2, 3], 20, seed=42) == [1, expected]
    every = StepResult(session_id="s", run_id=0, accepted=3, next_token=6)
    assert runs.chosen(every, [1, 2, 3], 20, seed=42) == [1, 2, 3, 6]  # the bonus: the seeded choice
