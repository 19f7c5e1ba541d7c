"""The rows a verification computes in its first LM-head call (server/verify_rows.py) change only
how many calls the tail makes, never a token: through real servers, the output with the policy
forced to one row, to every row and left to plan is the same, and equals local transformers."""

from __future__ import annotations

import pytest
import torch

from server.verify_rows import ALL_ROWS, RowPlan
from tests.kit.drafters import ScriptedDrafter
from tests.kit.reference import PROMPT, reference_sample

HALF_RIGHT = set(range(2, 16, 4)) | set(range(3, 16, 4))


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_outputs_are_identical_whatever_rows_the_first_call_computes(
    limits_swarm, tiny_reference, monkeypatch, sampling
):
    from protocol.messages import GREEDY, SamplingParams

    model, servers, _ = limits_swarm
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=7) if sampling else GREEDY
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=7) if sampling else {}
    truth = reference_sample(tiny_reference, PROMPT[0], 16, params)
    tail = servers[1].span
    calls: list[int] = []
    logits = tail.logits
    monkeypatch.setattr(tail, "logits", lambda hidden: calls.append(hidden.shape[1]) or logits(hidden))
    # the plan from its prior and the measured acceptance alone: the call-time fit reads this machine's
    # clock, and on a loaded one it can price an extra row at a whole call and plan one row (tested apart)
    monkeypatch.setattr(RowPlan, "observe_call", lambda self, rows, seconds: None)
    counts = {}
    for forced in (1, ALL_ROWS, None):
        monkeypatch.setattr(RowPlan, "FORCED", forced)
        for wrong_at in (set(), HALF_RIGHT):
            drafter = ScriptedDrafter(truth, len(PROMPT[0]), wrong_at, length=4)
            monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, drafter=drafter, **k: drafter)
            calls.clear()
            output = model.generate(
                torch.tensor(PROMPT), max_new_tokens=16, num_draft_tokens=4, loop_runs=False, **kwargs
            )
            assert output[0, len(PROMPT[0]) :].tolist() == truth, (forced, wrong_at)
            counts[forced, bool(wrong_at)] = len(calls)
    # all drafts right: one row first costs a second call on every lap, every row first does not,
    # and the plan (from its prior, then the measured acceptance) saves most of them
    assert counts[1, False] > counts[None, False] >= counts[ALL_ROWS, False]
    assert counts[None, True] < counts[1, True]
