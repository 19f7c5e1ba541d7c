"""The chain cost model (client/drafting/cost_model.py): drafts per lap from measured acceptance and
lap times; a lap with drafts is never slower in expectation than one without; it only changes speed."""

from __future__ import annotations

import random

import pytest
import torch

from client.drafting import SuffixDrafter
from client.drafting.cost_model import ChainCosts, LapCosts, draft_count, split_draft_count
from tests.kit.reference import PROMPT

HOPS = 3
COMPUTE_S, PER_POSITION_S = 0.004, 0.002  # a lap's fixed compute, and each position's, on 3 servers


def _rate(acceptance, fixed, per_position, k, committed=1):
    expected, reach = 1.0, 1.0
    for j in range(k):
        reach *= acceptance[min(j, len(acceptance) - 1)]
        expected += reach
    return expected / (fixed + per_position * (committed + k))


def test_more_drafts_pay_as_the_link_grows_and_never_fewer():
    acceptance = [0.6, 0.5, 0.4, 0.3]
    counts = [
        draft_count(acceptance, COMPUTE_S + 2 * HOPS * delay_ms / 1000, PER_POSITION_S, 8)
        for delay_ms in range(0, 101, 5)
    ]
    assert counts == sorted(counts)  # monotone in link delay
    at_0 = draft_count(acceptance, COMPUTE_S, PER_POSITION_S, 8)
    at_50 = draft_count(acceptance, COMPUTE_S + 2 * HOPS * 0.050, PER_POSITION_S, 8)
    assert at_50 > at_0
    assert draft_count([0.95], COMPUTE_S + 2 * HOPS * 0.050, PER_POSITION_S, 8) == 8  # predictable text, long link


def test_no_drafts_when_they_never_land_on_a_free_link():
    assert draft_count([0.01] * 8, 0.0, PER_POSITION_S, 8) == 0
    assert draft_count([], 0.2, PER_POSITION_S, 8) == 0  # nothing ever accepted: a draft buys nothing
    assert draft_count([0.9] * 8, 0.2, 0.0, 8) == 8  # free positions: every draft that may land pays


def test_the_chosen_count_is_never_slower_in_expectation_than_none():
    rng = random.Random(3)
    for _ in range(500):
        acceptance = [rng.random() for _ in range(rng.randint(1, 8))]
        fixed, per_position = rng.uniform(0, 0.3), rng.uniform(0, 0.05)
        k = draft_count(acceptance, fixed, per_position, 8)
        best = max(_rate(acceptance, fixed, per_position, j) for j in range(9))
        assert _rate(acceptance, fixed, per_position, k) == pytest.approx(best)
        assert _rate(acceptance, fixed, per_position, k) >= _rate(acceptance, fixed, per_position, 0)


def test_bad_costs_are_refused():
    with pytest.raises(ValueError, match="lap costs must be >= 0"):
        draft_count([0.5], -0.1, 0.01, 4)


def test_costs_are_fitted_from_laps_and_acceptance_by_depth():
    costs = ChainCosts()
    costs.observe_lap(3, 0.13)
    assert costs.cap(8) is None  # one lap size: the slope is unmeasured, the drafter drafts as before
    for positions in [1, 5, 2, 9, 4, 1, 6]:
        costs.observe_lap(positions, 0.1 + 0.01 * positions)
    assert costs.fitted
    assert costs.fixed_s == pytest.approx(0.1, abs=1e-3) and costs.per_position_s == pytest.approx(0.01, abs=1e-3)
    costs.observe_lap(500, 9.0)  # a prefill stays out of the fit
    assert costs.per_position_s == pytest.approx(0.01, abs=1e-3)
    for _ in range(30):
        costs.observe(4, 1)  # the first draft always lands, the second never
    first, second = costs.acceptance()[:2]
    assert first > 0.95 and second < 0.05
    assert costs.cap(8) == 1


def test_a_drafter_on_a_free_link_with_failing_drafts_stops_drafting_and_probes():
    drafter = SuffixDrafter(num_draft_tokens=8)
    drafter.reset([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])
    for positions in [1, 5, 2, 9, 4, 1, 6]:
        drafter.observe_lap(positions, 0.001 + 0.01 * positions)  # compute-bound: positions cost, the link nothing
    for _ in range(20):
        drafter.observe(3, 0)
    assert drafter.draft_cap == 0 and drafter.propose(8) == []
    for _ in range(ChainCosts.PROBE_EVERY):
        drafter.observe(0, 0)  # laps without drafts
    assert drafter.draft_cap == 1  # a probe keeps acceptance measured


def test_fixed_lap_costs_give_the_same_caps_whatever_the_lap_times():
    """draft_lap_costs: the cap follows from the verdicts alone, so two streams with the same verdicts
    and different (noisy) lap times draft the same counts, lap after lap."""
    rng = random.Random(7)
    verdicts = [(4, rng.choice([0, 0, 1, 2, 4])) for _ in range(40)]
    caps = []
    for _ in range(2):
        drafter = SuffixDrafter(num_draft_tokens=8)
        drafter.price_laps((0.05, 0.004))
        seen = []
        for drafted, accepted in verdicts:
            drafter.observe_lap(1 + drafted, rng.uniform(0.001, 0.5))  # ignored: the prices are fixed
            drafter.observe(drafted, accepted)
            seen.append(drafter.draft_cap)
        caps.append(seen)
    assert caps[0] == caps[1] and len(set(caps[0])) > 1  # the same counts, and they do change with the verdicts
    assert drafter.costs.fixed_s == 0.05 and drafter.costs.per_position_s == 0.004
    free = SuffixDrafter(num_draft_tokens=8)
    free.price_laps((1.0, 0.0))  # positions cost nothing: the adaptive length alone decides
    for _ in range(20):
        free.observe(8, 0)
    assert free.draft_cap == 1 and free.costs.cap(8) == 8  # the cost model cuts nothing


def test_bad_lap_costs_are_refused_by_name():
    from client._options import GenerationOptions
    from client.drafting import make_drafter

    for bad in [(-0.1, 0.0), (0.1, float("nan")), "fast", (1.0,)]:
        with pytest.raises(ValueError, match="draft_lap_costs must be"):
            GenerationOptions(draft_lap_costs=bad).checked()
    tail = make_drafter("suffix+tail", lap_costs=(0.05, 0.002))
    assert tail.costs.priced and tail.inner.costs.priced and tail.inner.costs.fixed_s == 0.05  # both sources


def test_the_tail_drafts_are_priced_too():
    """The tail's drafts (TailDrafts) go through the cost model as retrieval's do: where they pay they
    are sent whole; once they never land on a compute-bound link, a lap carries none but a probe."""
    from client.drafting import TailDrafts

    for prices, pays in [((0.1, 0.001), True), ((0.001, 0.01), False)]:
        drafter = TailDrafts(None)
        drafter.price_laps(prices)
        drafter.reset([1, 2, 3])
        sent = []
        for _ in range(24):
            drafter.offer(len(drafter._context), [7, 8, 9, 10])
            sent.append(drafter.draft(4))
            drafter.observe(len(sent[-1]), 0)
            drafter.extend([5])  # the target's token: the tail's first draft was wrong
        assert drafter.sources["tail"][:2] == [24, 96]  # measured as offered, whatever was sent
        lengths = [len(ids) for ids in sent]
        if pays:  # the link costs a hundred positions: a draft stays worth a try, fewer as they keep failing
            assert sent[0] == [7, 8, 9, 10]  # unmeasured acceptance (the prior, 0.5 per depth): all four
            assert min(lengths) >= 1 and lengths == sorted(lengths, reverse=True) and lengths[-1] < 4
        else:  # a position costs ten links: none (even at the prior's 0.5) but a probe every few laps
            assert lengths[0] == 0
            assert 1 <= sum(lengths[-8:]) <= 2


def test_fixed_lap_costs_repeat_step_shapes_over_servers(limits_swarm, tiny_reference):
    """The same generate() twice with draft_lap_costs: the same laps and drafts (the suffix store reset
    between them), and transformers' tokens."""
    model, _, _ = limits_swarm
    prompt = [PROMPT[0][:6] * 2]
    expected = tiny_reference.generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False)
    shapes = []
    for _ in range(2):
        model.reset_draft_store()
        output = model.generate(
            torch.tensor(prompt), max_new_tokens=16, num_draft_tokens=4, draft_lap_costs=(0.05, 0.01), loop_runs=False
        )
        assert output.tolist() == expected.tolist()
        stats = model.last_generation_stats
        shapes.append((stats.laps, stats.drafted, stats.accepted))
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize("cap", [0, 1, None])
def test_the_priced_cap_never_changes_tokens(limits_swarm, tiny_reference, monkeypatch, cap):
    model, _, _ = limits_swarm
    prompt = [PROMPT[0][:6] * 2]  # repetitive: the suffix drafter drafts
    expected = tiny_reference.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False)
    monkeypatch.setattr(ChainCosts, "cap", lambda self, max_drafts: cap)
    output = model.generate(torch.tensor(prompt), max_new_tokens=12, speculation="suffix", num_draft_tokens=4)
    assert output.tolist() == expected.tolist()
    if cap == 0:
        assert model.last_generation_stats.drafted == 0


# ---- the lap by its parts: the network's time and the tail's reported costs ----------------------

LINK_S = 2 * HOPS * 0.025  # 25 ms per hop, there and back


def _split_rate(acceptance, costs, k, committed=1):
    return _rate(
        acceptance,
        costs.network_s + costs.tail_call_s,
        costs.network_per_position_s + costs.tail_per_position_s,
        k,
        committed,
    )


def test_a_slower_tail_per_draft_gives_fewer_drafts_at_the_same_link():
    acceptance = [0.7, 0.6, 0.5, 0.4]
    counts = [
        split_draft_count(acceptance, LapCosts(LINK_S, 0.001, 0.016, tail_ms / 1000), 8)
        for tail_ms in (1, 5, 10, 20, 40, 80, 160, 1000)
    ]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]  # never more, and fewer in the end
    assert counts[-1] == 0  # a draft costing the tail several links' time: not worth sending


def test_more_link_delay_gives_more_drafts_at_the_same_tail_cost():
    acceptance = [0.7, 0.6, 0.5, 0.4]
    counts = [
        split_draft_count(acceptance, LapCosts(2 * HOPS * delay_ms / 1000, 0.001, 0.016, 0.010), 8)
        for delay_ms in (0, 10, 25, 50, 100)
    ]
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_the_split_count_is_never_slower_in_expectation_than_none():
    rng = random.Random(5)
    for _ in range(500):
        acceptance = [rng.random() for _ in range(rng.randint(1, 8))]
        costs = LapCosts(rng.uniform(0, 0.3), rng.uniform(0, 0.01), rng.uniform(0, 0.03), rng.uniform(0, 0.05))
        k = split_draft_count(acceptance, costs, 8)
        assert _split_rate(acceptance, costs, k) >= _split_rate(acceptance, costs, 0)
        assert _split_rate(acceptance, costs, k) == pytest.approx(
            max(_split_rate(acceptance, costs, j) for j in range(9))
        )
        assert costs.lap_s(1 + k) == pytest.approx(
            costs.network_s + costs.tail_call_s + (costs.network_per_position_s + costs.tail_per_position_s) * (1 + k)
        )


def test_the_tails_reports_are_fitted_apart_from_the_network():
    """Laps whose time is network + the tail's report: the fit recovers each part, and the same lap
    times with a slower tail report leave the network's part as it was."""
    from protocol.tail_costs import TailCosts

    def fitted(tail_per_position_s: float) -> ChainCosts:
        costs = ChainCosts()
        for positions in [1, 5, 2, 9, 4, 1, 6, 3]:
            rows = min(positions, 3)
            call_s = 0.016 + 0.0005 * rows  # one LM-head call reading `rows` rows
            blocks_s = tail_per_position_s * positions
            network_s = 0.150 + 0.002 * positions
            report = TailCosts(round(blocks_s * 1e6), [round(call_s * 1e6)], [rows])
            costs.observe_lap(positions, network_s + blocks_s + call_s, report)
        return costs

    fast, slow = fitted(0.004), fitted(0.040)
    for costs, tail_per_position_s in ((fast, 0.004), (slow, 0.040)):
        split = costs.split
        assert costs.reported and split is not None
        assert split.network_s == pytest.approx(0.150, abs=1e-3)
        assert split.network_per_position_s == pytest.approx(0.002, abs=1e-4)
        assert split.tail_call_s == pytest.approx(0.016, abs=1e-4)
        assert split.tail_per_position_s == pytest.approx(tail_per_position_s + 0.0005, abs=1e-4)
        assert costs.fixed_s == pytest.approx(split.network_s + split.tail_call_s)
    for accepted in [4, 3, 2, 1, 0] * 6:  # acceptance falling with depth, the same for both
        fast.observe(4, accepted)
        slow.observe(4, accepted)
    assert fast.cap(8) > slow.cap(8)  # the same link, a slower tail: fewer drafts


def test_the_tails_blocks_are_fitted_with_their_fixed_part():
    """A tail whose forward pass costs most of its time whatever the positions (as measured on the 2-core
    machine: 22 ms, and 3 ms a position): the fit prices its blocks as 22 ms a lap and 3 ms a position, and
    chooses more drafts than the time per position of small laps did (14 ms a position at three positions:
    fewer drafts, laps as small as before, so the ratio never fell)."""
    from protocol.tail_costs import TailCosts

    costs = ChainCosts()
    for positions in [1, 3, 4, 3, 2, 5, 3, 1, 4, 3]:
        blocks_s = 0.022 + 0.003 * positions
        call_s = 0.010
        report = TailCosts(round(blocks_s * 1e6), [round(call_s * 1e6)], [1])
        costs.observe_lap(positions, 0.080 + 0.004 * positions + blocks_s + call_s, report)
    split = costs.split
    assert split is not None and split.tail_blocks_s == pytest.approx(0.022, abs=1e-3)
    assert split.tail_per_position_s == pytest.approx(0.003, abs=2e-4)
    assert costs.fixed_s == pytest.approx(0.080 + 0.010 + 0.022, abs=2e-3)
    assert split.lap_s(5) == pytest.approx(0.080 + 0.010 + 0.022 + 5 * 0.007, abs=2e-3)
    for accepted in [3, 3, 2, 3, 3, 1, 3, 3] * 3:  # drafts 1-3 nearly always accepted, depth 4+ unseen
        costs.observe(3, accepted)
    ratio = draft_count(costs.acceptance(), 0.090, 0.004 + (0.022 + 0.003 * 3) / 3, 8)  # the old price
    assert costs.cap(8) > ratio >= 1


def test_async_mode_with_a_cap_of_0_sends_no_guess(limits_swarm, tiny_reference, monkeypatch):
    """A cap of 0 (priced laps where no draft pays, no probes): no Step carries a draft, and no run is
    sent behind one in flight with a guessed token; the tokens are transformers'. Priced so that
    drafts pay, the same generate() does send runs behind runs in flight (what the check would catch)."""
    from client._remote_session import RemoteSession

    model, _, _ = limits_swarm
    prompt = [PROMPT[0][:6] * 2]  # repetitive: the suffix drafter has drafts to offer
    expected = tiny_reference.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False)
    events: list[tuple[str, int]] = []
    send, result = RemoteSession.send_step, RemoteSession.next_result

    async def recorded_send(self, step):
        events.append(("send", step.n_draft))
        return await send(self, step)

    async def recorded_result(self, *args, **kwargs):
        verdict = await result(self, *args, **kwargs)
        events.append(("verdict", verdict.run_id))
        return verdict

    monkeypatch.setattr(RemoteSession, "send_step", recorded_send)
    monkeypatch.setattr(RemoteSession, "next_result", recorded_result)
    monkeypatch.setattr(ChainCosts, "PROBE_EVERY", 10**6)

    def run(lap_costs):
        events.clear()
        model.reset_draft_store()
        output = model.generate(
            torch.tensor(prompt),
            max_new_tokens=12,
            speculation="suffix",
            num_draft_tokens=4,
            async_speculation=True,
            max_inflight_runs=3,
            draft_lap_costs=lap_costs,
        )
        assert output.tolist() == expected.tolist()
        in_flight, most = 0, 0
        for kind, _ in events:
            in_flight += 1 if kind == "send" else -1
            most = max(most, in_flight)
        return [n for kind, n in events if kind == "send"], most

    drafts, most = run((0.0, 1.0))  # a position costs a second, the link nothing: no draft pays
    assert drafts and all(n == 0 for n in drafts) and model.last_generation_stats.drafted == 0
    assert most == 1  # each run waits for the verdict before it: nothing guessed
    _, most = run((1.0, 0.0))  # positions free: drafts and guesses pay
    assert most > 1


# ---- the tail's second LM-head call (a walk reading past the first call's rows) -------------------


def test_a_second_lm_head_call_is_priced_with_its_chance():
    """A lap of k >= first_call_rows drafts costs a second call when the first first_call_rows drafts
    are all accepted: an expensive second call keeps the count below the first call's rows, a free one
    changes nothing, and the count stays the best in expectation with the call priced."""
    acceptance = [0.9] * 8
    assert draft_count(acceptance, 0.05, 0.001, 8) == 8
    assert draft_count(acceptance, 0.05, 0.001, 8, second_call_s=1.0, first_call_rows=2) == 1
    assert draft_count(acceptance, 0.05, 0.001, 8, second_call_s=0.0, first_call_rows=2) == 8
    assert draft_count([0.1] * 8, 0.05, 0.001, 8, second_call_s=0.016, first_call_rows=1) == draft_count(
        [0.1] * 8, 0.05, 0.001, 8
    )  # a second call that rarely happens costs too little to change the count here

    def rate(acc, fixed, per_position, k, second_s, rows):
        reach, expected = 1.0, 1.0
        for j in range(k):
            reach *= acc[min(j, len(acc) - 1)]
            expected += reach
        p_second = 1.0
        for j in range(rows):
            p_second *= acc[min(j, len(acc) - 1)]
        return expected / (fixed + per_position * (1 + k) + (second_s * p_second if 0 < rows <= k else 0.0))

    rng = random.Random(9)
    for _ in range(300):
        acc = [rng.random() for _ in range(rng.randint(1, 8))]
        fixed, per_position, second_s, rows = (
            rng.uniform(0, 0.3),
            rng.uniform(0, 0.01),
            rng.uniform(0, 0.1),
            rng.randint(0, 5),
        )
        k = draft_count(acc, fixed, per_position, 8, second_call_s=second_s, first_call_rows=rows)
        assert rate(acc, fixed, per_position, k, second_s, rows) == pytest.approx(
            max(rate(acc, fixed, per_position, j, second_s, rows) for j in range(9))
        )
    with pytest.raises(ValueError, match="second call"):
        draft_count(acceptance, 0.05, 0.001, 8, second_call_s=-1.0)


def test_the_tails_second_calls_are_learned_from_its_reports():
    """Reports with a second LM-head call tell the first call's rows (2 here); the cap then prices
    that call: on a near-free link a 16 ms call more keeps the chain below the first call's rows,
    on a 50 ms link the link dominates and the count is what it was."""
    from protocol.tail_costs import TailCosts

    def fitted(second_calls: bool, link_s: float) -> ChainCosts:
        costs = ChainCosts()
        for positions in [1, 5, 2, 9, 4, 1, 6, 3] * 2:
            first = min(positions, 2)
            rows = [first, positions - first] if second_calls and positions > first else [first]
            report = TailCosts(1000 * positions, [16_000 + 100 * r for r in rows], rows)
            tail_s = (1000 * positions + sum(report.head_us)) * 1e-6
            costs.observe_lap(positions, link_s + 0.001 * positions + tail_s, report)
        for _ in range(5):
            for accepted in (0, 1, 0, 2, 0, 1, 0, 3):  # about half accepted at each depth
                costs.observe(8, accepted)
        return costs

    for link_s, without, priced in ((0.005, 3, 1), (0.05, 3, 3)):
        one_call, two_calls = fitted(False, link_s), fitted(True, link_s)
        assert one_call.split is not None and one_call.split.first_call_rows == 0
        assert two_calls.split is not None and two_calls.split.first_call_rows == 2
        assert one_call.cap(8) == without and two_calls.cap(8) == priced, link_s
        assert two_calls.cap(8) == split_draft_count(two_calls.acceptance(), two_calls.split, 8)
