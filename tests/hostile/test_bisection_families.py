"""The bisection beyond one family and one span (issue 35; client/_replay_layers.py, client/_tail_bisection.py;
docs/reliability.md, "Bisection over the span's blocks").

Unit: the client's replay of every block and the final norm of each served family's tiny random checkpoint
(tests/kit/checkpoints.py; Llama's is in tests/hostile/test_bisection.py) equals transformers' hidden states,
over 13 positions (past the 8-position sliding windows of Mistral, Qwen2 and gpt-oss); DeepSeek-V4 and an
unserved family are refused by name, a mixture of experts with a 16-bit tail by its routing.

Live, on a tiny Qwen3 (4 blocks, q/k norms): honest H, G (0:2) and T (2:4), and tails whose block 3 adds 5.0
to its output (tests/kit/block_faults.py): FB (2:4, T's span) and FS (0:4, a span starting elsewhere).
- a verdict dispute between T (live) and FB (its shadow) is bisected to block 3 and FB refuted, never T;
- the bisection of H + T against FS alone (its span 0:4; client/_tail_bisection.py on the real servers): over
  blocks 2:4, the blocks both hold (T's input against FS's own state entering block 2), FS refuted;
- a forward pass on H + FB, audited on G + T: the tails' h differ, the forward-logit dispute is bisected to
  block 3 and FB refuted; the logits returned are T's, equal to local transformers'.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from client._block_replay import BlockReplay
from client._output_audits import OutputAuditor, fresh_pass
from client._replay_layers import FAMILIES
from client._tail_bisection import bisect_tails
from protocol.messages import Hop
from swarm.local import LocalSwarm
from tests.hostile.test_sybils import _run as run_on_loop
from tests.hostile.test_sybils import stop
from tests.kit.checkpoints import DENSE_FAMILIES, MOE_FAMILIES
from tests.kit.families import family_paths, references
from tests.kit.faulty_server import faulty
from tests.kit.reference import PROMPT
from tests.kit.routes import routed_client
from tests.kit.swarms import SERVER_ARGS

__all__ = ["family_paths", "references"]  # the family fixtures, a module's own here

NEW_TOKENS = 24
HONEST = {"H": (0, 2), "G": (0, 2), "T": (2, 4)}


@pytest.mark.parametrize("model_type", [*DENSE_FAMILIES, *MOE_FAMILIES])
def test_the_client_replays_each_served_familys_blocks_as_transformers_computes_them(
    model_type, family_paths, references
):
    path = family_paths(model_type)
    config = AutoConfig.from_pretrained(path)
    replay = BlockReplay(str(path), config)
    assert model_type in FAMILIES and replay.refusal() is None
    ids = torch.randint(0, 2000, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = references(model_type)(ids, output_hidden_states=True).hidden_states
    blocks = config.num_hidden_layers
    for k in range(blocks - 1):
        torch.testing.assert_close(replay.replay(k, states[k][0]), states[k + 1][0], rtol=1e-5, atol=2e-5)
    pre_norm = replay.replay(blocks - 1, states[-2][0])
    torch.testing.assert_close(replay.replay(blocks, pre_norm), states[-1][0], rtol=1e-5, atol=2e-5)
    other = states[1][0] + 0.5  # another input: another output (the replay reads its input)
    assert not torch.allclose(replay.replay(1, other), states[2][0], atol=1e-2)


def test_deepseek_v4_unserved_families_and_16_bit_mixtures_of_experts_are_refused(tiny_llama_path):
    config = AutoConfig.from_pretrained(tiny_llama_path)
    for model_type, why in (("deepseek_v4", "DeepSeek-V4's decoder layer is its own code"), ("gemma3", "rebuilds no")):
        config.model_type = model_type
        assert why in BlockReplay(str(tiny_llama_path), config).refusal()
    tails = [SimpleNamespace(dtype=dtype, quantization="none") for dtype in ("float32", "bfloat16")]
    for model_type, refused in (("llama", None), ("mixtral", "routing")):  # a 16-bit tail of a mixture of experts
        config.model_type = model_type
        replay = BlockReplay(str(tiny_llama_path), config)
        assert replay.refusal(tails[:1]) is None
        got = replay.refusal(tails)
        assert got is None if refused is None else refused in got


@pytest.fixture(scope="module")
def qwen3_swarm(family_paths, artifacts_dir):
    with LocalSwarm(
        str(family_paths("qwen3")),
        spans=list(HONEST.values()),
        names=list(HONEST),
        server_args=SERVER_ARGS,
        log_dir=str(artifacts_dir / "qwen3-bisection-swarm"),
    ) as swarm:
        liars = [
            swarm.start_server(a, b, name=name, launcher=faulty("--corrupt-block", "3"))
            for name, a, b in (("FB", 2, 4), ("FS", 0, 4))
        ]
        try:
            yield swarm
        finally:
            stop(swarm, liars)


@pytest.fixture(scope="module")
def qwen3_greedy(references):
    with torch.no_grad():
        out = references("qwen3").generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT[0]) :].tolist()


LIVE = [("H", 0, 2), ("T", 2, 4)]


def test_a_verdict_dispute_on_qwen3_is_bisected_to_the_wrong_block(qwen3_swarm, family_paths, qwen3_greedy):
    """T live, FB its only shadow: the tails' states differ, the bisection ends in block 3, the client
    replays Qwen3's layer, FB is refuted, never T; the output is exact."""
    shadow = [("H", 0, 2), ("FB", 2, 4)]
    with routed_client(qwen3_swarm, family_paths("qwen3"), LIVE, shadow, hidden=["FS", "G"]) as model:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tokens after the refutation have no shadow left
            out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0)
        stats = model.last_generation_stats
        print(f"\nFB: {stats.spot_check_events}")
        assert out[0, len(PROMPT[0]) :].tolist() == qwen3_greedy, stats.spot_check_events
        assert stats.verdict_audits_by_evidence >= 1 and stats.disputed_peers == [model.peers["FB"]]
        refuted = [e for e in stats.spot_check_events if "bisection to block 3" in e and "refuted (not conv" in e]
        assert refuted, stats.spot_check_events
        assert model.peers["T"] not in model.swarm.liars and stats.route[-1][0] == model.peers["T"]


def test_tails_of_different_spans_are_bisected_over_the_blocks_both_hold(qwen3_swarm, family_paths):
    """Routes H + T (T's span 2:4) and FS alone (0:4), each tail's final hidden state over the prompt
    read as a dispute's evidence: bisected over blocks 2:4 (T's input against FS's own state entering
    block 2), ended in block 3, FS refuted whichever side it is. The auditors' shadows today keep the tail hop's span
    (client/_tail_bisection.py), so this is bisect_tails itself on real servers."""
    with routed_client(qwen3_swarm, family_paths("qwen3"), LIVE, [("FS", 0, 4)], hidden=["FB"]) as model:
        hops = {name: Hop(model.peers[name], a, b) for name, a, b in (*LIVE, ("FS", 0, 4))}
        live, other = [hops["H"], hops["T"]], [hops["FS"]]
        model(torch.tensor(PROMPT))  # a route planned: the client holds every server's record (their dtypes)
        prefix = PROMPT[0]
        shape = (1, model.config.vocab_size, model.config.hidden_size, True)
        finals = [run_on_loop(fresh_pass(model.swarm, r, prefix, shape))[1] for r in (live, other)]

        def settle(routes, finals):
            no = lambda n: None  # noqa: E731
            return run_on_loop(
                bisect_tails(model.swarm, model.lm_head_rows, routes, prefix, finals, 1e-3, no, fresh_pass)
            )

        for routes, both, refuted in (((live, other), finals, "shadow"), ((other, live), finals[::-1], "tail")):
            settled = settle(routes, both)
            print(f"\n{settled}")
            assert settled.refuted == refuted and "bisection to block 3" in settled.detail, settled.detail
            assert "over blocks 2:4, which both tails hold" in settled.detail


def test_a_forward_logit_dispute_whose_hidden_states_differ_is_bisected(qwen3_swarm, family_paths, references):
    """A forward pass on H + FB, audited on G + T (every pass, the LM head read): the dispute is the tail
    hop's, the two h differ, the bisection ends in block 3 and FB is refuted (avoided: H is a stranger);
    the audit route's logits are returned, equal to local transformers'."""
    with routed_client(qwen3_swarm, family_paths("qwen3"), [("H", 0, 2), ("FB", 2, 4)], hidden=["FS"]) as model:
        audits = model.output_audits = OutputAuditor(model.swarm, 1.0, (), model.lm_head_rows)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no third tail independent of both: the pass returned is unconfirmed
            logits = model(torch.tensor(PROMPT)).logits[0]
        print(f"\nforward-logit bisection: {audits.stats.events}")
        with torch.no_grad():
            want = references("qwen3")(torch.tensor(PROMPT)).logits[0]
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        assert audits.stats.by_evidence == 1 and audits.stats.disputed_peers == [model.peers["FB"]]
        assert any("bisection to block 3" in e and "refuted" in e for e in audits.stats.events), audits.stats.events
        assert model.peers["T"] not in audits.avoid and not model.swarm.liars
