"""A verdict dispute whose tails disagree on the hidden state, narrowed by bisection over the span's blocks
to one block the client replays itself (client/_bisection.py, client/_block_replay.py; issue 35).

Unit: the bisection on synthetic states (a chain of random blocks, a liar wrong from one block on, or
making up any states it likes: the honest side is never refuted), and the client's replay of a real
checkpoint's block and final norm, equal to transformers'. Live: the sybil swarm of
tests/hostile/test_sybils.py (H 0:2, M 2:4, T 4:6 honest) with a tail F (4:6) as T's shadow that either
lies in its verdicts from position 32 and makes up its final hidden state to fit (honest in every
block: the bisection ends in the final norm), or computes block 4 wrongly (``--corrupt-block 4``: the
state entering block 5 is off, every token after it honest from it). Either way F is refuted, never T,
and the output equals local transformers.
"""

from __future__ import annotations

import asyncio
import copy
import warnings

import pytest
import torch

from client._bisection import Divergence, bisect, first_divergence, judge
from client._block_replay import BlockReplay
from client._output_audits import fresh_pass
from client.errors import ServerError
from protocol.messages import Hop
from tests.hostile.test_sybils import _run as run_on_loop
from tests.hostile.test_sybils import client, generate, greedy_reference, route, start, stop, sybil_swarm
from tests.kit.reference import PROMPT

__all__ = ["greedy_reference", "sybil_swarm"]  # the sybil swarm's fixtures, a module's own here

TOL = 1e-3  # float32's (client/_output_audits.py OUTPUT_TOLERANCES)


def _chain(seed: int, blocks: int = 6, t: int = 5, hidden: int = 8):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(hidden, hidden, generator=g) / hidden**0.5 for _ in range(blocks)]
    scale = torch.rand(hidden, generator=g) + 0.5

    def replay(k: int, x: torch.Tensor) -> torch.Tensor:
        return x * scale / x.pow(2).mean(-1, keepdim=True).sqrt() if k == blocks else x + torch.tanh(x @ weights[k])

    states = [torch.randn(t, hidden, generator=g)]
    for k in range(blocks):
        states.append(replay(k, states[-1]))
    return replay, states, g


def _run(states_of, replay, a, b, finals):
    async def states(k):
        return states_of(k)

    return asyncio.run(bisect(states, replay, a, b, finals, TOL))


def test_the_bisection_finds_the_wrong_block_and_refutes_the_side_that_computed_it():
    replay, honest, _ = _chain(0)
    final = replay(6, honest[6])[-1]
    for wrong in range(6):  # the liar's block ``wrong`` adds 0.5; every later block is honest from there
        lied = honest[: wrong + 1]
        for k in range(wrong, 6):
            lied.append(replay(k, lied[-1]) + (0.5 if k == wrong else 0.0))
        asked = []

        def tail_honest(k):
            asked.append(k)
            return honest[k], lied[k]

        found = asyncio.run(first_divergence(_async(tail_honest), 0, 6, (final, replay(6, lied[6])[-1]), TOL))
        assert isinstance(found, Divergence) and found.block == wrong and not found.norm
        assert len(asked) <= 2 + 3  # 2 + ceil(log2(6)) laps
        liar_final = replay(6, lied[6])[-1]
        assert _run(tail_honest, replay, 0, 6, (final, liar_final)).refuted == "shadow"
        assert _run(lambda k: (lied[k], honest[k]), replay, 0, 6, (liar_final, final)).refuted == "tail"


def _async(fn):
    async def wrapped(k):
        return fn(k)

    return wrapped


def test_a_made_up_final_state_is_refuted_by_the_final_norm_and_differing_inputs_settle_nothing():
    replay, honest, _ = _chain(1)
    final = replay(6, honest[6])[-1]
    settled = _run(lambda k: (honest[k], honest[k].clone()), replay, 0, 6, (final, final + 0.3))
    assert settled.refuted == "shadow" and "final norm" in settled.detail
    moved = _run(lambda k: (honest[k], honest[k] + 0.5), replay, 0, 6, (final, final + 0.3))
    assert moved.refuted is None and "inputs" in moved.detail


def test_an_honest_tail_is_never_refuted_whatever_states_the_other_side_sends():
    """Soundness against framing: the other side sends any states at any boundary (random, shaded
    within the tolerance, consistent with the replay from states of its own), in any order asked."""
    for seed in range(30):
        replay, honest, g = _chain(10 + seed)
        final = replay(6, honest[6])[-1]
        kind = seed % 3
        made = {}

        def other(k):
            if k not in made:
                if kind == 0:
                    made[k] = torch.randn_like(honest[k], generator=g) * 3
                elif kind == 1:
                    made[k] = honest[k] + (torch.rand(honest[k].shape, generator=g) * 2 - 1) * TOL * 0.9
                else:  # consistent with the replay from its own (wrong) input at every boundary
                    made[k] = replay(k - 1, honest[k - 1] + 0.7) if k > 0 else honest[0]
            return made[k]

        other_final = torch.randn(final.shape, generator=g)
        assert _run(lambda k: (honest[k], other(k)), replay, 0, 6, (final, other_final)).refuted != "tail"
        assert _run(lambda k: (other(k), honest[k]), replay, 0, 6, (other_final, final)).refuted != "shadow"


def test_judge_settles_nothing_when_both_or_neither_fit():
    x = torch.ones(2, 4)
    both = judge(Divergence(3, (x, x), (x * 2, x * 2)), (x * 2, x * 2), TOL)
    neither = judge(Divergence(3, (x, x), (x * 2, x * 3)), (x * 5, x * 5), TOL)
    assert both.refuted is None and "both fit" in both.detail
    assert neither.refuted is None and "neither fits" in neither.detail


def test_the_client_replays_a_checkpoints_block_and_final_norm_as_transformers_computes_them(
    tiny_llama_path, tiny_reference
):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_path)
    replay = BlockReplay(str(tiny_llama_path), config)
    assert replay.refusal() is None
    ids = torch.tensor([[1, 5, 9, 200, 31, 7, 64]])
    with torch.no_grad():
        states = tiny_reference(ids, output_hidden_states=True).hidden_states
    for k in range(config.num_hidden_layers - 1):
        torch.testing.assert_close(replay.replay(k, states[k][0]), states[k + 1][0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        pre_norm = replay.replay(config.num_hidden_layers - 1, states[-2][0])
        torch.testing.assert_close(replay.replay(config.num_hidden_layers, pre_norm), states[-1][0])
    assert BlockReplay("some-org/some-model", config).refusal() is not None  # a hub repo: not downloaded
    other = copy.deepcopy(config)
    other.model_type = "gemma3"
    assert "rebuilds no" in BlockReplay(str(tiny_llama_path), other).refusal()


@pytest.mark.parametrize(
    "fault, where",
    [
        (("--lie-in-verdicts", "1", "--lie-after", "32", "--made-up-final", "0.5"), "the final norm"),
        (("--corrupt-block", "4"), "block 4"),
    ],  # each liar its own name: a stopped server's name lingers in the DHT
    ids=["made-up-h", "wrong-block"],
)
def test_a_tail_whose_hidden_state_is_wrong_is_refuted_by_bisection(
    sybil_swarm, tiny_llama_path, greedy_reference, fault, where
):
    """T live, F (4:6: FM or FB) its only shadow, F's final hidden state off (made up to fit its lie, or computed from a
    wrong block 4): the dispute's evidence states differ, the bisection narrows it to ``where``, the client
    replays it and F is refuted (avoided: H and M are strangers; with them trusted, convicted), never T; the
    output stays exact."""
    name = "FM" if "--made-up-final" in fault else "FB"
    processes = start(sybil_swarm, *fault, names=(name,))
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route(name), hidden=["U"]) as model:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tokens after F's refutation have no shadow left
                out = generate(model)
            stats = model.last_generation_stats
            print(f"\n{where}: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.verdict_audits_by_evidence >= 1 and stats.disputed_peers == [model.peers[name]]
            assert any(f"bisection to {where}" in e and "refuted (not convicted" in e for e in stats.spot_check_events)
            assert model.peers["T"] not in model.swarm.liars and stats.route[-1][0] == model.peers["T"]
            if where == "block 4":  # H and M trusted (not T): the same bisection convicts F
                out = generate(model, trusted_peers=[model.peers["H"], model.peers["M"]])
                stats = model.last_generation_stats
                assert out == greedy_reference, stats.spot_check_events
                assert stats.liars_excluded == [model.peers[name]] and model.peers[name] in model.swarm.liars
                assert any("bisection to block 4" in e and "refuted by evidence" in e for e in stats.spot_check_events)
                assert model.peers["T"] not in model.swarm.liars | set(stats.disputed_peers)
    finally:
        stop(sybil_swarm, processes)


def test_a_tail_returns_the_state_at_a_block_boundary_and_refuses_one_outside_its_span(
    sybil_swarm, tiny_llama_path, tiny_reference
):
    """``Step.hidden_at`` on the real route H, M, T: the state entering block 5 equals transformers' (every
    position of the prompt), the span's input (4) too; 3 is outside T's span: refused naming the field, and
    T keeps serving (the final state after)."""
    with client(sybil_swarm, tiny_llama_path, route("T"), hidden=["U"]) as model:
        hops = [Hop(model.peers[name], a, b) for name, a, b in route("T")]
        prefix = PROMPT[0]
        shape = (len(prefix), model.config.vocab_size, model.config.hidden_size, True)
        with torch.no_grad():
            want = tiny_reference(torch.tensor(PROMPT), output_hidden_states=True).hidden_states
        for k in (4, 5):
            _, got = run_on_loop(fresh_pass(model.swarm, hops, prefix, shape, hidden_at=k))
            torch.testing.assert_close(got, want[k][0], rtol=1e-4, atol=1e-4)
        with pytest.raises(ServerError, match="hidden_at must be -1 or a block boundary in \\[4, 6\\]"):
            run_on_loop(fresh_pass(model.swarm, hops, prefix, shape, hidden_at=3))
        _, final = run_on_loop(fresh_pass(model.swarm, hops, prefix, shape))
        torch.testing.assert_close(final, want[-1][0], rtol=1e-4, atol=1e-4)
