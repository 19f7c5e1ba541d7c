"""The tail computes logits rows on demand: same verdicts, and only the rows the walk reads."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import GREEDY, SamplingParams
from protocol.sampling import verify
from server.compute import LazyLogits
from server.verify_rows import ALL_ROWS, RowPlan


class CountingLMHead:
    """A stand-in LM head (a fixed linear map) that records which rows each call computed."""

    def __init__(self, hidden: int = 8, vocab: int = 16, seed: int = 0):
        self.weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))
        self.calls: list[int] = []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[1])
        return (hidden @ self.weight.T)[0]


@pytest.mark.parametrize("n_draft", [0, 1, 3, 7])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(do_sample=True, temperature=0.9, top_p=0.9, seed=5)])
def test_lazy_rows_give_the_verdict_of_full_logits(n_draft, sampling):
    lm_head = CountingLMHead()
    start_pos, num_new = 4, n_draft + 2
    hidden = torch.randn(1, num_new, 8, generator=torch.Generator().manual_seed(n_draft))
    full = lm_head.logits(hidden)
    # two committed tokens, then drafts equal to the target's greedy choices (the last one wrong
    # when there are three or more), so the walk reads several rows
    choices = full.argmax(-1).tolist()
    history = [1, 2, 3, 4] + [7, 8] + [choices[num_new - n_draft - 1 + i] for i in range(n_draft)]
    if n_draft >= 3:
        history[-1] = (history[-1] + 1) % 16  # the last draft is wrong
    expected = verify(full, history, start_pos, n_draft, sampling, num_logprobs=3)
    lm_head.calls.clear()
    got = verify(LazyLogits(lm_head, hidden), history, start_pos, n_draft, sampling, num_logprobs=3)
    assert got[:2] == expected[:2]
    assert [(lp.token_id, lp.top_ids) for lp in got[2]] == [(lp.token_id, lp.top_ids) for lp in expected[2]]
    for a, b in zip(got[2], expected[2]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_a_rejected_first_draft_costs_one_row_and_a_prefill_only_its_last():
    lm_head = CountingLMHead()
    hidden = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1))
    first_choice = int(lm_head.logits(hidden[:, :1]).argmax())
    lm_head.calls.clear()
    # one committed token then four drafts, the first of them wrong
    verify(LazyLogits(lm_head, hidden), [0, 0, 0, 9, (first_choice + 1) % 16, 1, 1, 1], 3, 4, GREEDY)
    assert lm_head.calls == [1]
    lm_head.calls.clear()
    verify(LazyLogits(lm_head, torch.randn(1, 40, 8)), list(range(40)), 0, 0, GREEDY)  # a 40-token prefill
    assert lm_head.calls == [1]


def test_rows_after_the_first_are_computed_in_one_call():
    lm_head = CountingLMHead()
    hidden = torch.randn(1, 6, 8)
    rows = LazyLogits(lm_head, hidden)
    full = lm_head.logits(hidden)
    lm_head.calls.clear()
    for r in range(2, 6):
        assert torch.allclose(rows[r], full[r], atol=1e-6)
    assert lm_head.calls == [1, 3]
    with pytest.raises(IndexError):
        rows[6]


def _lap(lm_head: CountingLMHead, plan: RowPlan, n_draft: int, accepted: int, seed: int) -> list[int]:
    """One verification of ``n_draft`` drafts, the first ``accepted`` of them right, with the first
    call sized by ``plan``; the plan then observes the verdict. Returns the LM-head calls' row counts."""
    hidden = torch.randn(1, n_draft + 1, 8, generator=torch.Generator().manual_seed(seed))
    choices = lm_head.logits(hidden).argmax(-1).tolist()
    drafts = [c if i < accepted else (c + 1) % 16 for i, c in enumerate(choices[:n_draft])]
    lm_head.calls.clear()
    rows = LazyLogits(lm_head, hidden, first_call=plan.rows(n_draft))
    got, next_token, _ = verify(rows, [3, 5, 9] + drafts, 2, n_draft, GREEDY)
    assert (got, next_token) == (accepted, choices[accepted])
    plan.observe(n_draft, got)
    return list(lm_head.calls)


def test_the_first_call_grows_with_measured_acceptance_and_shrinks_when_drafts_fail():
    lm_head, plan = CountingLMHead(), RowPlan()
    # four drafts per lap, all accepted: the walk reads 5 rows. The plan starts from a neutral
    # prior (acceptance 0.5: the first four rows, then a second call for the fifth) and as the
    # average rises (0.75, ...) the first call takes all five rows: one call per verification
    calls = [_lap(lm_head, plan, 4, 4, seed) for seed in range(5)]
    assert calls == [[4, 1], [5], [5], [5], [5]]
    # then every draft rejected: the walk reads one row; the plan shrinks back to one
    calls = [_lap(lm_head, plan, 4, 0, seed) for seed in range(10, 16)]
    assert calls == [[5], [4], [2], [2], [1], [1]] and plan.rows(4) == 1
    # a prefill (no drafts) says nothing and costs one row
    assert _lap(lm_head, plan, 0, 0, 99) == [1] and plan.rows(4) == 1


@pytest.mark.parametrize("forced, expected_calls", [(1, [1, 5]), (ALL_ROWS, [6]), (3, [3, 3])])
def test_a_forced_row_count_gives_the_same_rows(monkeypatch, forced, expected_calls):
    monkeypatch.setattr(RowPlan, "FORCED", forced)
    lm_head = CountingLMHead()
    hidden = torch.randn(1, 6, 8)
    full = lm_head.logits(hidden)
    lm_head.calls.clear()
    rows = LazyLogits(lm_head, hidden, first_call=RowPlan(rate=0.9).rows(5))
    for r in range(6):
        assert torch.allclose(rows[r], full[r], atol=1e-5)
    assert lm_head.calls == expected_calls


def test_a_tree_walk_costs_its_root_row_then_one_call_for_the_rest_with_the_verdict_of_full_logits():
    """A tree's walk reads one path; past the root its rows come in one more call, whatever the depth."""
    from protocol.sampling import verify_tree

    lm_head = CountingLMHead()
    hidden = torch.randn(1, 9, 8, generator=torch.Generator().manual_seed(3))
    full = lm_head.logits(hidden)
    choice = full.argmax(-1).tolist()
    # two committed ids, then 7 nodes: the target's path root -> node 1 -> node 4 -> node 6, beside wrong siblings
    parents = [-1, -1, 0, 1, 1, 3, 4]
    token_ids = [5, 6, 0, 0, 0, 0, 0, 0, 0]
    token_ids[2 + 0] = (choice[1] + 1) % 16  # node 0: a wrong child of the root
    token_ids[2 + 1] = choice[1]  # node 1: the target's choice at the root
    token_ids[2 + 2] = choice[2]  # node 2: under the wrong node 0
    token_ids[2 + 3] = (choice[3] + 1) % 16  # node 3: a wrong child of node 1
    token_ids[2 + 4] = choice[3]  # node 4: the target's choice after node 1
    token_ids[2 + 5] = 0
    token_ids[2 + 6] = choice[6]  # node 6: the target's choice after node 4
    history = [1, 2, 3] + token_ids
    expected = verify_tree(full, history, 3, token_ids, parents, GREEDY, num_logprobs=2)
    assert expected[0] == [1, 4, 6]
    for contiguous, first_call in ((False, 1), (True, 1)):
        lm_head.calls.clear()
        got = verify_tree(
            LazyLogits(lm_head, hidden, contiguous, first_call), history, 3, token_ids, parents, GREEDY, 2
        )
        assert got[:2] == expected[:2]
        assert [(lp.token_id, lp.top_ids) for lp in got[2]] == [(lp.token_id, lp.top_ids) for lp in expected[2]]
        if not contiguous:
            assert lm_head.calls == [1, 9 - 3]  # the root's row (run row 1), then rows 3..8 at once
    lm_head.calls.clear()
    wrong = list(token_ids)
    wrong[2 + 1] = (choice[1] + 2) % 16 if (choice[1] + 2) % 16 != token_ids[2] else (choice[1] + 3) % 16
    verify_tree(LazyLogits(lm_head, hidden, False), history[:3] + wrong, 3, wrong, parents, GREEDY)
    assert lm_head.calls == [1]  # rejected at the root: one row
