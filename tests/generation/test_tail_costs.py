"""The tail measures what verifying a run costs it and says so (StepResult.tail_costs,
server/tail_costs.py): filled and sane on a real (tiny) swarm, tokens unchanged; nonsense from a
peer refused by name; and the measured per-row cost sizes the first LM-head call (server/verify_rows.py)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from protocol.errors import ProtocolError
from protocol.messages import StepResult, decode, encode
from protocol.tail_costs import MAX_HEAD_CALLS, MAX_TAIL_US, TailCosts, check_tail_costs
from server.compute import LazyLogits
from server.tail_costs import CostMeter
from server.verify_rows import RowPlan
from tests.kit.reference import PROMPT
from tests.kit.swarms import inprocess_servers


@pytest.fixture(scope="module")
def own_swarm(tiny_llama_path):
    """A swarm of its own: the last test here makes its tail a liar, which the client then avoids."""
    yield from inprocess_servers(tiny_llama_path)


def _verdicts(monkeypatch) -> list[StepResult]:
    from client._remote_session import RemoteSession

    seen: list[StepResult] = []
    check = RemoteSession._check_verdict
    monkeypatch.setattr(
        RemoteSession, "_check_verdict", lambda self, result, *due: seen.append(result) or check(self, result, *due)
    )
    return seen


def test_every_verdict_reports_the_tails_costs_and_tokens_are_unchanged(own_swarm, tiny_reference, monkeypatch):
    model, _ = own_swarm
    prompt = [PROMPT[0][:6] * 2]  # repetitive: the suffix drafter drafts, so calls read several rows
    expected = tiny_reference.generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False)
    verdicts = _verdicts(monkeypatch)
    output = model.generate(torch.tensor(prompt), max_new_tokens=16, num_draft_tokens=4, loop_runs=False)
    assert output.tolist() == expected.tolist()
    assert len(verdicts) >= model.last_generation_stats.laps > 0
    for result in verdicts:
        costs = result.tail_costs
        assert costs is not None and 0 < costs.blocks_us < MAX_TAIL_US
        assert 1 <= len(costs.head_us) == len(costs.head_rows) <= 2  # the planned rows, and at most the rest
        assert all(0 <= us < MAX_TAIL_US for us in costs.head_us) and all(rows >= 1 for rows in costs.head_rows)
    assert sum(us for result in verdicts for us in result.tail_costs.head_us) > 0
    assert model.last_generation_stats.drafted > 0
    assert any(rows > 1 for result in verdicts for rows in result.tail_costs.head_rows)  # drafts' rows read together
    stats = model.last_generation_stats  # the laps' reports, summed for the caller
    assert 0 < stats.tail_head_calls <= sum(len(result.tail_costs.head_us) for result in verdicts)
    assert stats.tail_blocks_time > 0 and stats.tail_head_rows >= stats.tail_head_calls and stats.tail_positions > 0


def test_the_field_is_optional_and_typed_on_the_wire():
    plain = StepResult(session_id="s", run_id=3, accepted=1, next_token=5, step_digest=9)
    assert decode(encode(plain)).tail_costs is None  # a tail that does not measure sends none
    one_call = StepResult(**{**msgspec.structs.asdict(plain), "tail_costs": TailCosts(1500, [900], [3])})
    assert len(encode(one_call)) - len(encode(plain)) == 17  # the defaults before it (7), then the report
    costs = TailCosts(blocks_us=1200, head_us=[300, 250], head_rows=[3, 1])
    assert (
        decode(encode(StepResult(session_id="s", run_id=3, accepted=1, next_token=5, tail_costs=costs))).tail_costs
        == costs
    )
    wire = msgspec.msgpack.decode(
        encode(StepResult(session_id="s", run_id=3, accepted=1, next_token=5, tail_costs=costs))
    )
    for bad in (["many"], [1.5, [1], [1]], [1, [1] * (MAX_HEAD_CALLS + 1), [1] * (MAX_HEAD_CALLS + 1)]):
        forged = _replace_costs(wire, bad)
        with pytest.raises(ProtocolError, match="malformed message"):
            decode(msgspec.msgpack.encode(forged))


def _replace_costs(wire, costs):
    """The encoded message with its StepResult's last field (tail_costs) replaced."""
    if isinstance(wire, list):
        if wire and wire[0] == "result":
            return [*wire[:-1], costs]
        return [_replace_costs(item, costs) for item in wire]
    if isinstance(wire, dict):
        return {key: _replace_costs(value, costs) for key, value in wire.items()}
    return wire


@pytest.mark.parametrize(
    "costs, named",
    [
        (TailCosts(blocks_us=-1), "tail_costs.blocks_us -1"),
        (TailCosts(blocks_us=MAX_TAIL_US + 1), "tail_costs.blocks_us"),
        (TailCosts(blocks_us=10, head_us=[5, 6], head_rows=[1]), "2 LM-head call times for 1 row counts"),
        (TailCosts(blocks_us=10, head_us=[-5], head_rows=[1]), "tail_costs.head_us"),
        (TailCosts(blocks_us=10, head_us=[5], head_rows=[0]), "tail_costs.head_rows"),
        (TailCosts(blocks_us=10, head_us=[5], head_rows=[9]), "does not fit a run of 8 positions"),
    ],
)
def test_nonsense_costs_are_refused_by_name(costs, named):
    with pytest.raises(ValueError, match=named):
        check_tail_costs(costs, 8)
    assert check_tail_costs(TailCosts(blocks_us=0, head_us=[0], head_rows=[8]), 8)  # the bounds themselves pass


def test_the_meter_times_each_call_and_merges_past_the_limit():
    head = torch.nn.Linear(8, 32, bias=False)

    class Span:
        def logits(self, hidden):
            return head(hidden)[0]

    meter = CostMeter(blocks_s=0.002)
    logits = LazyLogits(Span(), torch.randn(1, 6, 8), first_call=2, meter=meter)
    logits[1], logits[2], logits[3]  # the first call computes rows 1 and 2, the second the rest
    assert [rows for rows, _ in meter.calls] == [2, 3]
    report = meter.report()
    assert report.blocks_us == 2000 and report.head_rows == [2, 3] and len(report.head_us) == 2
    for _ in range(MAX_HEAD_CALLS + 3):
        meter.call(1, 0.001)
    report = meter.report()
    assert len(report.head_rows) == MAX_HEAD_CALLS and report.head_rows[-1] == 6  # the last holds the rest
    assert check_tail_costs(report, 64)


def test_the_measured_row_cost_sizes_the_first_call():
    def plan_after(base_s: float, per_row_s: float) -> RowPlan:
        plan = RowPlan(rate=0.6)
        for rows in [1, 4, 2, 1, 3, 5, 1, 2]:
            plan.observe_call(rows, base_s + per_row_s * rows)
        return plan

    unmeasured = RowPlan(rate=0.6)
    for _ in range(5):
        unmeasured.observe_call(1, 0.016)  # one size only: the slope is unknown, the prior stands
    assert unmeasured.extra_row_cost() == RowPlan.EXTRA_ROW_COST
    memory_bound = plan_after(0.016, 0.0002)  # the matrix read dominates: rows are nearly free
    compute_bound = plan_after(0.001, 0.004)  # each row costs more than the call around it
    assert memory_bound.extra_row_cost() == pytest.approx(0.0002 / 0.0162, rel=1e-3)
    assert compute_bound.extra_row_cost() == pytest.approx(0.8, rel=1e-3)
    assert memory_bound.rows(8) > unmeasured.rows(8) > compute_bound.rows(8) == 1


def test_a_tail_that_reports_nonsense_is_refused_by_name(own_swarm, monkeypatch):
    model, _ = own_swarm
    monkeypatch.setattr(CostMeter, "report", lambda self: TailCosts(blocks_us=-7))
    with pytest.raises(Exception) as caught:
        model.generate(torch.tensor(PROMPT), max_new_tokens=4, speculation=None)
    chain, error = [], caught.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("tail_costs.blocks_us -7" in text for text in chain), chain
