"""Trust against sybils (issue 35; docs/reliability.md, "Disputes" and "What is confirmed").

Live: a tiny-model swarm H (blocks 0:2), M (2:4) and tails T, U (4:6), honest, and two sybil tails
S1, S2 (4:6) run through tests/kit/faulty_server.py:
- framing (``--frame``): honest in live-looking laps, on audit-looking Steps they would reject the
  first draft and name the second choice, so each confirms the other against T. Audits are shaped
  like live laps, so no Step looks like an audit to them: no dispute, nobody convicted or reported;
  the output equals local transformers. What a tail sees of live and audit Steps is recorded and
  compared (``--record-steps``), and the adaptive liar (``--lie-when-live``) lies to audits too.
- colluding (``--lie-in-verdicts 1 --lie-after 32``): the same lie in every verdict past position
  32. With T trusted the output equals local transformers; with nobody trusted, and the two sybils
  on one machine as far as the client can tell, the dispute is settled by evidence the client checks
  itself (client/_evidence.py: both tails' final hidden state and the two tokens' LM-head rows): the
  liar is refuted, never T; the same in seeded sampling with a temperature alone (the draw is an argmax
  of logits / T plus noise fixed by the seed: protocol/sampling.py ``draw_noise``). Without the LM-head
  rows the dispute avoids the sybils' whole machine
  group (client/_avoidance.py), the generation falls back on T: the output equals local
  transformers, T is not convicted, and its tokens past the dispute are flagged unconfirmed
  (``audit="required"`` raises). As framers (T live, the sybils its shadows) they are refuted by
  the same evidence, and convicted when the hops before the tail are trusted.
- rejection sampling on the honest tails: the shadow replays the live runs' drafts, q and seed, every
  token confirmed, nobody disputed; a tail lying in rejection verdicts is disputed, or convicted when
  T is trusted.

Same-host peers: every server here listens on 127.0.0.1, which the client treats as the user's own
machine, one group per peer id (client/_witnesses.py says why); the colluding test puts S1 and S2
on one public /24 by patching ``machine_group``, as two sybils of one operator would be.
tests/network/test_sybils_netns.py runs sybils on one address in network namespaces, nothing patched.
"""

from __future__ import annotations

import asyncio
import json
import random
import types
import urllib.error
import urllib.request
import warnings

import pytest
import torch

from client import _shadow_turns, _verdict_audits
from client._audit_shape import LiveShape
from client.errors import UnconfirmedTokensError, UnconfirmedTokensWarning
from protocol.messages import Hop, SamplingParams, StepResult
from swarm.local import LocalSwarm, kill_group
from tests.kit import faults
from tests.kit.faulty_server import faulty
from tests.kit.machine_groups import on_one_machine
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.routes import routed_client
from tests.kit.swarms import SERVER_ARGS

NEW_TOKENS = 40
HONEST = {"H": (0, 2), "M": (2, 4), "T": (4, 6), "U": (4, 6)}


def route(tail: str) -> list[tuple[str, int, int]]:
    return [("H", 0, 2), ("M", 2, 4), (tail, 4, 6)]


def start(swarm, *fault: str, names=("S1", "S2")) -> list:
    """Start tails of blocks 4:6 with ``fault``; the client waits until they are online."""
    return [swarm.start_server(4, 6, name=name, launcher=faulty(*fault)) for name in names]


def stop(swarm, processes) -> None:
    for process in processes:
        kill_group(process)
        swarm.servers.remove(process)  # later tests' wait_ready must not take it for a crash


@pytest.fixture(scope="module")
def sybil_swarm(tiny_llama_path, artifacts_dir):
    with LocalSwarm(
        str(tiny_llama_path),
        spans=list(HONEST.values()),
        names=list(HONEST),
        server_args=SERVER_ARGS,
        log_dir=str(artifacts_dir / "sybil-swarm"),
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def greedy_reference(tiny_reference):
    with torch.no_grad():
        out = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT[0]) :].tolist()


client = routed_client  # a client routed by name, blind to the hidden servers (tests/kit/routes.py)


def generate(model, **kwargs) -> list[int]:
    out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0, **kwargs)
    return out[0, len(PROMPT[0]) :].tolist()


def _run(coro):
    from client import _loop

    return _loop.run(coro)


def test_two_framing_sybils_convict_nobody_and_the_output_stays_exact(sybil_swarm, tiny_llama_path, greedy_reference):
    """S1 and S2 frame whoever they audit on any Step that looks like an audit's. Audits are shaped
    like live laps (test_audits_look_like_live_laps_to_the_tail), so they never find one: no
    dispute, nobody convicted or reported, every token confirmed by an independent shadow."""
    processes = start(sybil_swarm, "--frame")
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("S1"), route("S2"), hidden=["U"]) as model:
            for attempt in range(2):
                out = generate(model, audit="required")
                stats = model.last_generation_stats
                print(f"\nframing {attempt}: {stats.spot_check_events}; route {stats.route}")
                assert out == greedy_reference, stats.spot_check_events
                assert stats.liars_excluded == [] and not model.swarm.liars
                assert stats.disputed_peers == [], stats.spot_check_events  # no Step looked like an audit
                _run(model.swarm.flush_reports())
                assert not model.swarm.reports  # nothing reported in the DHT
                assert model.peers["T"] not in model.swarm.excluded.current()
                assert stats.verdict_audits >= 2 and stats.tokens_unconfirmed == 0
                assert stats.tokens_confirmed_untrusted == len(out)  # T's tokens, re-verified by S1 or S2
            # with T trusted: the same, every token confirmed by T itself
            out = generate(model, trusted_peers=[model.peers["T"]], audit="required")
            stats = model.last_generation_stats
            assert out == greedy_reference
            assert stats.liars_excluded == [] and stats.disputed_peers == []
            assert stats.tokens_confirmed_trusted == len(out) and stats.tokens_unconfirmed == 0
    finally:
        stop(sybil_swarm, processes)


def test_colluding_liars_are_refuted_by_a_trusted_tail_or_flagged(
    sybil_swarm, tiny_llama_path, greedy_reference, tiny_reference, monkeypatch
):
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", names=("L1", "L2"))
    try:
        with client(sybil_swarm, tiny_llama_path, route("L1"), route("T"), route("L2"), hidden=["U"]) as model:
            one_machine = {model.peers["L1"], model.peers["L2"]}
            on_one_machine(monkeypatch, one_machine)
            # nobody trusted, and no LM-head rows to settle it by evidence (as for a checkpoint the client
            # cannot read): L2 may not witness for L1 (one machine), so T shadows, disputes, and
            # nobody settles it; both machine groups are avoided, which leaves no tail: the generation
            # falls back on T's group (one identity, L1's has two) and re-verifies there. Nobody
            # independent that has not disagreed with T is left, so T's tokens are flagged
            rows, model.lm_head_rows = model.lm_head_rows, None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = generate(model)
            stats = model.last_generation_stats
            print(f"\ncolluding: {stats.spot_check_events}; out {out}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.liars_excluded == [] and not model.swarm.liars
            assert model.peers["T"] not in model.swarm.excluded.current()
            assert {model.peers["T"], model.peers["L1"]} <= set(stats.disputed_peers)
            assert stats.route[-1][0] == model.peers["T"]  # the route it ended on
            assert stats.tokens_unconfirmed > 0 and any(
                issubclass(w.category, UnconfirmedTokensWarning) for w in caught
            )
            with pytest.raises(UnconfirmedTokensError):
                generate(model, audit="required")
            # the LM-head rows read from the checkpoint (client/_evidence.py): T's and L1's final hidden
            # states agree and T's token wins, so L1 is refuted by evidence, T never disputed
            model.lm_head_rows = rows
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = generate(model)
            stats = model.last_generation_stats
            print(f"colluding, settled by evidence: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.verdict_audits_by_evidence >= 1 and stats.verdict_audits_undecided == 0
            assert model.peers["L1"] in stats.disputed_peers and set(stats.disputed_peers) <= one_machine
            assert stats.liars_excluded == [] and stats.route[-1][0] == model.peers["T"]
            # seeded sampling with a temperature alone: the draw is an argmax too (protocol/sampling.py
            # draw_noise), so L1's lie is refuted by the same evidence; the output is the seeded one
            params = SamplingParams(do_sample=True, temperature=0.8, seed=5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = generate(model, do_sample=True, temperature=0.8, seed=5)
            stats = model.last_generation_stats
            print(f"colluding, seeded, settled by evidence: {stats.spot_check_events}")
            assert out == reference_sample(tiny_reference, PROMPT[0], NEW_TOKENS, params), stats.spot_check_events
            assert stats.verdict_audits_by_evidence >= 1 and stats.verdict_audits_undecided == 0
            assert model.peers["L1"] in stats.disputed_peers and set(stats.disputed_peers) <= one_machine
            assert stats.liars_excluded == []
            # T trusted: T shadows L1, refutes it, and the generation re-verifies on T's route
            out = generate(model, trusted_peers=[model.peers["T"]], audit="required")
            stats = model.last_generation_stats
            assert out == greedy_reference, stats.spot_check_events
            # L1 refuted; L2 too where the generation moved on to it (both lie past 32, to T's shadow too)
            assert model.peers["L1"] in stats.liars_excluded
            assert set(stats.liars_excluded) <= {model.peers["L1"], model.peers["L2"]}
            assert stats.tokens_confirmed_trusted == len(out)
    finally:
        stop(sybil_swarm, processes)


def test_two_sybils_framing_the_honest_tail_are_refuted_by_evidence(
    sybil_swarm, tiny_llama_path, greedy_reference, monkeypatch
):
    """The issue's framing scenario, settled by evidence (client/_evidence.py): T is live, and F1, F2
    (one machine group) shadow it and reject its token from position 32 on, naming the second choice.
    The client asks both tails for their final hidden state at 31 and reads the two tokens' LM-head
    rows from the checkpoint: the states agree and T's token wins, so the framer is refuted, never T.
    With H and M strangers the framer is only avoided (with its group); with H and M trusted it is
    convicted. Either way T is never disputed, avoided or convicted, and the output is exact."""
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", names=("F1", "F2"))
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("F1"), route("F2"), hidden=["U"]) as model:
            framers = {model.peers["F1"], model.peers["F2"]}
            on_one_machine(monkeypatch, framers)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tokens after the framer's refutation have no shadow left
                out = generate(model)
            stats = model.last_generation_stats
            print(f"\nframed, strangers before the tail: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            # each framer that shadows T is refuted in turn (a refuted group's mate may still shadow, last)
            assert stats.verdict_audits_by_evidence >= 1 and stats.verdict_audits_undecided == 0
            assert stats.disputed_peers and set(stats.disputed_peers) <= framers  # the framers, never T
            assert any("refuted (not convicted" in e and "position 32" in e for e in stats.spot_check_events)
            assert stats.liars_excluded == [] and not model.swarm.liars
            assert model.peers["T"] not in model.swarm.excluded.current()
            assert stats.route[-1][0] == model.peers["T"]  # never left T
            # H and M trusted (not T): the evidence now convicts the framer (and its mate, if it shadows next)
            out = generate(model, trusted_peers=[model.peers["H"], model.peers["M"]])
            stats = model.last_generation_stats
            print(f"framed, H and M trusted: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.liars_excluded and set(stats.liars_excluded) <= framers
            assert any("refuted by evidence" in e for e in stats.spot_check_events)
            assert model.peers["T"] not in model.swarm.liars | set(stats.disputed_peers)
            assert stats.route[-1][0] == model.peers["T"]
    finally:
        stop(sybil_swarm, processes)


def test_colluding_liars_on_machine_groups_of_their_own_cannot_confirm_each_other(
    sybil_swarm, tiny_llama_path, greedy_reference, tiny_reference
):
    """L1 and L2 tell the same lie past position 32 and, on 127.0.0.1, are each a machine group of its own
    (k sybils on k groups), so each may witness for the other; L1 is live, nobody is trusted. A shadow
    kept for the generation was L2 half the time and confirmed L1's lies. Now every witness of the pool
    verifies the tokens before they are returned (client/_shadow_turns.py), so T disagrees, the evidence
    refutes the liar, and the output equals local transformers, greedy and seeded alike; T is never
    disputed, excluded or convicted."""
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", names=("G1", "G2"))
    try:
        with client(sybil_swarm, tiny_llama_path, route("G1"), route("G2"), route("T"), hidden=["U"]) as model:
            liars = {model.peers["G1"], model.peers["G2"]}
            params = SamplingParams(do_sample=True, temperature=0.8, seed=7)
            expected = [greedy_reference, reference_sample(tiny_reference, PROMPT[0], NEW_TOKENS, params)]
            for kwargs, wanted in zip([{}, dict(do_sample=True, temperature=0.8, seed=7)], expected):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # tokens after a refutation may have no witness left
                    out = generate(model, **kwargs)
                stats = model.last_generation_stats
                print(f"\ncolluding on groups of their own {kwargs}: {stats.spot_check_events}")
                assert out == wanted, stats.spot_check_events
                assert stats.disputed_peers and set(stats.disputed_peers) <= liars, stats.spot_check_events
                assert model.peers["T"] not in model.swarm.liars | model.swarm.excluded.current()
                assert stats.route[-1][0] == model.peers["T"]
    finally:
        stop(sybil_swarm, processes)


@pytest.fixture(scope="module")
def drafter(tiny_llama_path):
    """A draft model that disagrees with the target now and then (so the rule rejects drafts)."""
    from tests.kit.checkpoints import noisy_copy

    return noisy_copy(tiny_llama_path)


def sample(model, seed: int, **kwargs) -> list[int]:
    return generate(model, do_sample=True, temperature=0.8, seed=seed, verification="rejection", **kwargs)


def test_rejection_sampling_is_audited_and_convicts_no_honest_tail(sybil_swarm, tiny_llama_path, drafter):
    """Three honest tails (T, U and V); a local draft model with ``verification="rejection"``: the
    shadow replays the live runs' drafts with their q and seed (client/_rejection_audits.py), so
    every token is confirmed, nobody is disputed, and the output is the one without audits. Then a
    tail L that lies in rejection verdicts too (the top-K it sends names the lie) is disputed, and,
    with T trusted, convicted."""
    processes = start(sybil_swarm, names=("V",))  # a third honest tail
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("U"), route("V")) as model:
            corrections = 0
            for seed in range(3):
                model.verdict_audit_every = 0
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    unaudited = sample(model, seed, draft_model=drafter)
                assert model.last_generation_stats.verdict_audits == 0
                model.verdict_audit_every = _verdict_audits.DEFAULT_AUDIT_EVERY
                out = sample(model, seed, draft_model=drafter, audit="required")
                stats = model.last_generation_stats
                print(f"\nrejection {seed}: {stats.spot_check_events}; corrections {stats.corrections}")
                assert out == unaudited and len(out) == NEW_TOKENS
                assert stats.liars_excluded == [] and not model.swarm.liars and stats.disputed_peers == []
                assert stats.verdict_audits >= 2 and stats.tokens_unconfirmed == 0
                assert stats.tokens_confirmed_untrusted == NEW_TOKENS
                corrections += stats.corrections
            assert corrections > 0  # the rule rejected drafts: the shadow drew the same corrections
    finally:
        stop(sybil_swarm, processes)
    lie = ("--lie-in-verdicts", "1", "--lie-after", "32", "--lie-in-rejection")
    processes = start(sybil_swarm, *lie, names=("L",))
    try:
        with client(sybil_swarm, tiny_llama_path, route("L"), route("T"), route("U")) as model:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                sample(model, 7, draft_model=drafter)
            stats = model.last_generation_stats
            print(f"\nrejection, L lying: {stats.spot_check_events}")
            assert stats.liars_excluded == [] and model.peers["L"] in stats.disputed_peers
            assert not {model.peers["T"], model.peers["U"]} & model.swarm.excluded.current()
            assert stats.route[-1][0] != model.peers["L"]
            out = sample(model, 7, draft_model=drafter, trusted_peers=[model.peers["T"]])
            stats = model.last_generation_stats
            print(f"\nrejection, L lying, T trusted: {stats.spot_check_events}")
            assert stats.liars_excluded == [model.peers["L"]] and len(out) == NEW_TOKENS
            assert stats.tokens_unconfirmed == 0 or stats.disputed_peers  # re-verified on T or flagged
    finally:
        stop(sybil_swarm, processes)


def _features(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_framer_that_tells_audits_by_their_acceptance_finds_none(
    sybil_swarm, tiny_llama_path, greedy_reference, drafter, monkeypatch
):
    """F1 and F2 (one machine group) frame every session whose drafted Steps they fully accepted so far
    (``--frame-by-acceptance``: a shadow's drafts used to be the committed tokens, which an honest tail
    accepts in full, where a live lap's are guesses). T is live, with a local draft model that disagrees
    now and then, so T rejects some of the live laps' drafts. Audit runs replay the live laps' own
    drafts, the rejected ones too (client/_audit_shape.py ``drafts_at``): the framers accept as many as T
    did and never take a shadow's session for an audit. No dispute, nobody avoided or convicted, every
    token confirmed by an independent witness, the output equal to local transformers. (With committed
    tokens as drafts they framed at the first audit and were refuted by evidence: the test fails there.)"""
    processes = start(sybil_swarm, "--frame-by-acceptance", names=("F1", "F2"))
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("F1"), route("F2"), hidden=["U"]) as model:
            on_one_machine(monkeypatch, {model.peers["F1"], model.peers["F2"]})
            out = generate(model, draft_model=drafter, audit="required")
            stats = model.last_generation_stats
            print(f"\nframing by acceptance: {stats.accepted_lengths}, {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.drafted > sum(a * n for a, n in stats.accepted_lengths.items())  # T rejected drafts
            assert stats.verdict_audits >= 2 and stats.disputed_peers == [], stats.spot_check_events
            assert stats.tokens_unconfirmed == 0 and stats.tokens_confirmed_untrusted == NEW_TOKENS
            excluded = model.swarm.excluded.current()
            assert stats.liars_excluded == [] and not {model.peers[n] for n in ("T", "F1", "F2")} & excluded
            assert stats.route[-1][0] == model.peers["T"]
    finally:
        stop(sybil_swarm, processes)


def test_audits_look_like_live_laps_to_the_tail(sybil_swarm, tiny_llama_path, greedy_reference, tmp_path):
    """R records what it sees of every Step it verifies (tests/kit/faults.py ``record_verdicts``):
    first as the live route's tail (T shadows it), then as T's shadow and spot-check substitute
    (U is hidden, so R is the only other tail). Every audit Step passes the frame fault's detector
    as a live lap, with live-sized drafts, the live session's max_length and top log-probs, and no
    returned logits (spot-checks verify through verdicts)."""
    log = tmp_path / "steps.jsonl"
    processes = start(sybil_swarm, "--record-steps", str(log), names=("R",))
    try:
        with client(sybil_swarm, tiny_llama_path, route("R"), hidden=["U", "T"]) as model:
            assert generate(model) == greedy_reference  # no other tail: no shadow
        live = _features(log)
        log.unlink()
        with client(sybil_swarm, tiny_llama_path, route("T"), hidden=["U"]) as model:
            out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=1.0)
            assert out[0, len(PROMPT[0]) :].tolist() == greedy_reference
            stats = model.last_generation_stats
            assert stats.verdict_audits >= 2 and stats.spot_checks >= 1, stats.spot_check_events
            assert stats.liars_excluded == [] and stats.disputed_peers == []
        audits = _features(log)
        assert live and audits, (live, audits)
        print(f"\nlive: {live}\naudits: {audits}")
        assert not any(f["looks_like_an_audit"] for f in live + audits)
        # no Step asks for returned logits: spot-checks verify through verdicts, as the shadow does
        assert not any(f["return_logits"] for f in live + audits)
        assert {f["top_logprobs"] for f in audits} == {f["top_logprobs"] for f in live} == {1}
        # shadow and spot-check Steps carry draft counts the live laps carried (client/_audit_shape.py)
        assert {f["n_draft"] for f in audits} <= {f["n_draft"] for f in live} | {0}
        assert max(f["n_draft"] for f in audits) <= 8  # num_draft_tokens, the default
        assert {f["max_length"] for f in audits} == {f["max_length"] for f in live}
        # live and audit laps alike ask for loop_runs (the detector counts a lap without as an audit), as
        # does a session's first Step (the context, and the first lap's drafts), except at the
        # generation's last tokens (history + num_draft_tokens + 2 >= max_length), where live laps stop looping
        laps = [f for f in live + audits if f["positions"] - f["n_draft"] == 1 or f["start_pos"] == 0]
        assert any(f["loop_runs"] for f in live) and any(f["loop_runs"] for f in audits)
        near_end = [f["start_pos"] + f["positions"] - f["n_draft"] + 10 >= f["max_length"] for f in laps]
        assert all(f["loop_runs"] or end for f, end in zip(laps, near_end)), laps
    finally:
        stop(sybil_swarm, processes)


def test_a_third_opinion_looks_like_a_live_lap(monkeypatch):
    """The third opinion's session is as long as the generation's (not the disputed position + 1),
    and its one Step with a draft passes the frame fault's detector."""
    sent: list[tuple[int, object]] = []

    class Recording:
        def __init__(self, p2p, route, max_length, **kwargs):
            self.max_length, self.session_id, self.route = max_length, "s", route

        async def open(self):
            pass

        async def send_step(self, step):
            sent.append((self.max_length, step))

        async def next_result(self, run_id):
            return StepResult(session_id="s", run_id=run_id, accepted=1, next_token=0)

        async def cancel(self, run_id):
            pass

        async def close(self):
            pass

    monkeypatch.setattr(_shadow_turns, "RemoteSession", Recording)  # the audits' sessions (ShadowTurns._new_session)
    swarm = types.SimpleNamespace(
        p2p=None, request_timeout=1.0, prompts=None, active_adapter="", route_step_limit=lambda route: 16
    )
    auditor = _verdict_audits.VerdictAuditor(swarm, vocab_size=100)
    ids = list(range(1, 41))
    auditor.begin(ids[:11], 60, _verdict_audits.GREEDY, "match", LiveShape(8, loop_end=51))  # live laps loop
    stats = types.SimpleNamespace(verdict_audit_positions=0)
    token = asyncio.run(auditor._third_opinion([Hop(peer_id="x", start=0, end=2)], ids, 39, stats))
    assert token == ids[39]
    assert sent and all(length == 60 for length, _ in sent)  # the generation's, not t + 1
    for length, step in sent:
        assert not faults.looks_like_an_audit(types.SimpleNamespace(max_length=length), step), step


def test_the_adaptive_liar_that_lies_only_in_live_laps_lies_in_audits_too(
    sybil_swarm, tiny_llama_path, greedy_reference
):
    """A lies in every verdict from position 32 on that does not look like an audit. Audits look
    like live laps, so it lies to its shadow as well: with T trusted it is convicted at its first
    lie, and the output equals local transformers; with nobody trusted it is flagged (disputed) and
    every token it could have lied in is among the unconfirmed ones."""
    processes = start(
        sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", "--lie-when-live", names=("A",)
    )  # a name no earlier test used: a killed L's record may linger
    try:
        with client(sybil_swarm, tiny_llama_path, route("A"), route("T"), hidden=["U"]) as model:
            out = generate(model, trusted_peers=[model.peers["T"]])
            stats = model.last_generation_stats
            print(f"\nadaptive, T trusted: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.liars_excluded == [model.peers["A"]]
            assert any("position 32:" in e and "refuted" in e for e in stats.spot_check_events)
        with client(sybil_swarm, tiny_llama_path, route("A"), route("T"), hidden=["U"]) as model:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                out = generate(model)
            stats = model.last_generation_stats
            print(f"\nadaptive, nobody trusted: {stats.spot_check_events}")
            assert stats.liars_excluded == [] and model.peers["A"] in stats.disputed_peers
            confirmed = len(out) - stats.tokens_unconfirmed
            assert out[:confirmed] == greedy_reference[:confirmed]
    finally:
        stop(sybil_swarm, processes)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, method="POST", headers={"Content-Type": "application/json"}, data=json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_gateway_refuses_unconfirmed_tokens_under_audit_required(sybil_swarm, tiny_llama_path, greedy_reference):
    """Only T serves blocks 4:6 (U hidden, no sybil running): nobody can confirm T's tokens. The
    gateway's reply counts them unconfirmed; with ``"audit": "required"`` it is a 502 naming why."""
    from swarm.api import Gateway, GatewayConfig
    from tests.api.test_api import GatewayThread

    with client(sybil_swarm, tiny_llama_path, route("T"), hidden=["U"]) as model:
        with GatewayThread(Gateway({"tiny": model}, GatewayConfig())) as served:
            body = {"model": "tiny", "prompt": PROMPT[0], "max_tokens": 8, "temperature": 0}
            status, reply = _post(f"{served.url}/completions", body)
            assert status == 200, reply
            assert reply["specswarm"]["tokens_unconfirmed"] == 8 and reply["usage"]["completion_tokens"] == 8
            status, reply = _post(f"{served.url}/completions", {**body, "audit": "required"})
            assert status == 502, reply
            assert reply["error"]["code"] == "tokens_unconfirmed", reply
            assert "8 of 8 generated tokens are unconfirmed" in reply["error"]["message"]
            assert "no independent second server" in reply["error"]["message"]
            status, reply = _post(f"{served.url}/completions", {**body, "audit": "sometimes"})
            assert status == 400 and reply["error"]["param"] == "audit", reply


TOP_K_PENALTY = SamplingParams(do_sample=True, top_k=20, repetition_penalty=1.3, seed=5)


def test_a_sybil_pair_lying_about_a_top_k_penalised_draw_is_refuted_by_evidence(
    sybil_swarm,
    tiny_llama_path,
    tiny_reference,
    monkeypatch,
):
    """Evidence under any processing (client/_processed_evidence.py): T is live; P1 and P2 (one machine
    group) shadow it and, from position 32 on, name a random id instead of the seeded top-k draw. Such
    a dispute used to settle nothing (only plain greedy and temperature-only draws were evidence), so the
    pair could keep T disputed forever. Now the client bounds every logit from both h through the
    penalty, top-k and the draw's noise: the random id is outside every admissible top-20, so the shadow
    is refuted (strangers before the tail: avoided, not convicted), T never is, and the output is the
    seeded one."""
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie", "random", "--lie-after", "32", names=("P1", "P2"))
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("P1"), route("P2"), hidden=["U"]) as model:
            pair = {model.peers["P1"], model.peers["P2"]}
            on_one_machine(monkeypatch, pair)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tokens after the pair's refutation have no shadow left
                out = generate(model, do_sample=True, top_k=20, repetition_penalty=1.3, seed=5)
            stats = model.last_generation_stats
            print(f"\ntop-k + penalty, framed: {stats.spot_check_events}")
            assert out == reference_sample(tiny_reference, PROMPT[0], NEW_TOKENS, TOP_K_PENALTY), (
                stats.spot_check_events
            )
            assert stats.verdict_audits_by_evidence >= 1 and stats.verdict_audits_undecided == 0
            assert stats.disputed_peers and set(stats.disputed_peers) <= pair  # the pair, never T
            assert any("cannot win" in e and "refuted (not convicted" in e for e in stats.spot_check_events)
            assert stats.liars_excluded == [] and model.peers["T"] not in model.swarm.excluded.current()
            assert stats.route[-1][0] == model.peers["T"]
    finally:
        stop(sybil_swarm, processes)


def test_first_difference_names_the_position_and_both_tokens():
    """Two verdicts on the same ids, the last three as drafts (positions 3, 4, 5)."""
    from client._tail_disputes import first_difference

    ids = [10, 11, 12, 13, 14, 15]

    def verdict(accepted, next_token):
        return StepResult(session_id="s", run_id=0, accepted=accepted, next_token=next_token)

    assert first_difference(ids, 3, verdict(1, 7), verdict(3, 8)) == (4, 7, 14)  # one rejects draft 14
    assert first_difference(ids, 3, verdict(3, 8), verdict(1, 7)) == (4, 14, 7)
    assert first_difference(ids, 3, verdict(2, 7), verdict(2, 9)) == (5, 7, 9)  # the same count, other tokens
    assert first_difference(ids, 3, verdict(3, 8), verdict(3, 9)) == (6, 8, 9)  # past the last draft
    assert first_difference(ids, 3, verdict(2, 7), verdict(2, 7)) is None  # the same tokens: log-probs only
    assert first_difference(ids, 3, verdict(4, 7), verdict(2, 7)) is None  # more accepted than sent


def test_first_disagreeing_entry_pairs_the_log_probs_of_the_same_tokens():
    """Verdicts that name the same tokens: the first position whose entries disagree beyond the bound."""
    from client._tail_disputes import first_disagreeing_entry
    from protocol.messages import TokenLogprobs

    ids = [10, 11, 12, 13, 14, 15]

    def entry(token, logprob):
        return TokenLogprobs(token_id=token, logprob=logprob, top_ids=[token], top_logprobs=[logprob])

    def verdict(accepted, next_token, *logprobs):
        tokens = [*ids[3 : 3 + accepted], next_token]
        entries = [entry(t, lp) for t, lp in zip(tokens, logprobs)]
        return StepResult(session_id="s", run_id=0, accepted=accepted, next_token=next_token, logprobs=entries)

    honest, shifted = verdict(2, 7, -1.0, -2.0, -0.5), verdict(2, 7, -1.0, -1.5, -0.5)
    t, said, claim = first_disagreeing_entry(ids, 3, honest, shifted, 1e-3)
    assert (t, said.token_id, said.logprob, claim.logprob) == (4, 14, -2.0, -1.5)
    assert first_disagreeing_entry(ids, 3, honest, verdict(2, 7, -1.0, -2.0004, -0.5), 1e-3) is None  # within
    assert first_disagreeing_entry(ids, 3, honest, verdict(2, 9, -1.0, -2.0, -0.5), 1e-3) is None  # other tokens
    assert first_disagreeing_entry(ids, 3, honest, verdict(2, 7, -1.0, -2.0), 1e-3) is None  # unpaired entries


@pytest.mark.parametrize("every", [10_000, 0], ids=["final-verdict-audit", "no-verdict-audits"])
def test_a_spot_check_of_the_tail_is_settled_by_evidence(sybil_swarm, tiny_llama_path, greedy_reference, every):
    """L1 (live) lies past position 32 in every verdict; T is its only substitute. With verdict audits only
    at the end (``verdict_audit_every`` past the generation), a spot-check of the tail hop finds the two
    tails' verdicts naming different tokens. It used to stop there, undecided: L1 and T both avoided, and T
    barred from witnessing for anyone else. Now the verdict audits' evidence rule settles it: L1 is
    refuted (avoided with its group, not convicted: H and M are strangers), T is not disputed, and the
    generation re-verifies on T, equal to local transformers. The same with verdict audits off
    (``verdict_audit_every=0``): the spot-checks bring their own evidence rule (``TailEvidence``)."""
    liar = "K1" if every else "K1n"  # a name per case: a stopped server's record outlives it
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", names=(liar,))
    try:
        with client(sybil_swarm, tiny_llama_path, route(liar), route("T"), hidden=["U"]) as model:
            model.verdict_audit_every = every  # the final audit or none: the spot-checks meet the lie first
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tokens after the refutation have no other witness
                out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=1.0)
            out = out[0, len(PROMPT[0]) :].tolist()
            stats = model.last_generation_stats
            print(f"\nspot-check of the tail: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.spot_checks_by_evidence >= 1, stats.spot_check_events
            assert any(": refuted (" in e and "evidence at position" in e for e in stats.spot_check_events)
            assert stats.disputed_peers == [model.peers[liar]], stats.spot_check_events
            assert stats.spot_checks_undecided == 0 and stats.liars_excluded == [] and not model.swarm.liars
            assert stats.route[-1][0] == model.peers["T"]
    finally:
        stop(sybil_swarm, processes)


@pytest.mark.parametrize("every", [10_000, 0], ids=["final-verdict-audit", "no-verdict-audits"])
def test_a_spot_check_of_the_tail_settles_log_probs_by_evidence(
    sybil_swarm, tiny_llama_path, tiny_reference, greedy_reference, every
):
    """K2 (live) names the right tokens but adds 0.5 to every log-prob it returns; T is its only
    substitute. A spot-check of the tail hop finds the two verdicts naming the same tokens with other
    log-probs. It used to stop there, undecided: K2 and T both avoided. Now the two entries at the first
    position that disagrees are recomputed from each tail's final hidden state over the whole head
    (client/_tail_disputes.py): K2 is refuted (avoided, not convicted: H and M are strangers), T is not
    disputed, and the log-probs returned are local transformers' (within 1e-4)."""
    from tests.hostile.test_output_audits import honest_logprobs

    liar = "K2" if every else "K2n"  # a name per case: a stopped server's record outlives it
    processes = start(sybil_swarm, "--lie-in-logprobs", "0.5", names=(liar,))
    try:
        with client(sybil_swarm, tiny_llama_path, route(liar), route("T"), hidden=["U"]) as model:
            model.verdict_audit_every = every  # the final audit or none: the spot-checks meet the lie first
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tokens after the refutation have no other witness
                out = model.generate(torch.tensor(PROMPT), max_new_tokens=24, spot_check_rate=1.0, num_logprobs=3)
            tokens, entries = out[0, len(PROMPT[0]) :].tolist(), model.last_logprobs
            stats = model.last_generation_stats
            print(f"\nlog-prob spot-check of the tail: {stats.spot_check_events}")
            assert stats.spot_checks_by_evidence >= 1, stats.spot_check_events
            assert any("log-probs of token" in e and ": refuted (" in e for e in stats.spot_check_events)
            assert stats.disputed_peers == [model.peers[liar]], stats.spot_check_events
            assert stats.spot_checks_undecided == 0 and stats.liars_excluded == [] and not model.swarm.liars
            assert stats.route[-1][0] == model.peers["T"]
            expected = honest_logprobs(tiny_reference, tokens, 3)
            assert tokens == greedy_reference[:24] and [e.token_id for e in entries] == tokens
            for entry, (token, logprob, top) in zip(entries, expected):
                assert entry.top_ids == top and entry.logprob == pytest.approx(logprob, abs=1e-4)
    finally:
        stop(sybil_swarm, processes)


def test_audit_witnesses_reaches_the_generations_auditor(sybil_swarm, tiny_llama_path, greedy_reference, monkeypatch):
    """generate(audit_witnesses=N) sizes the verdict audits' pool of that generation (client/model.py ->
    client/_audits.py), and the output stays exact; a value that is no int >= 1 is refused before any session."""
    from client import model as model_module

    pools, make = [], model_module.make_audits

    def recording(*args):
        audits = make(*args)
        pools.append(audits.verdicts.pool)
        return audits

    monkeypatch.setattr(model_module, "make_audits", recording)
    with client(sybil_swarm, tiny_llama_path, route("T"), route("U")) as model:
        assert generate(model, audit_witnesses=1) == greedy_reference
        assert generate(model) == greedy_reference
        with pytest.raises(ValueError, match="audit_witnesses must be an int >= 1"):
            generate(model, audit_witnesses=0)
    assert pools == [1, _shadow_turns.SHADOW_POOL] == [1, 6]


def test_a_head_that_stalls_audits_is_detoured_and_every_token_confirmed(
    sybil_swarm, tiny_llama_path, greedy_reference
):
    """SH, a head of blocks 0:2 that drops the Steps of any session repeating an open one's first ids
    (``--shield``: to a hop, a second session with the generation's prompt is an audit), carries the live
    route SH, M, T. The first audit's shadow (SH, M, U) stalls and ends with no verdict after the request
    timeout; from then on the generation's shadows go around SH through H (client/_shadow_detour.py), and
    the audit before the output is returned confirms every token. Nobody is blamed for the stall. The
    client's next generation through SH detours from its first audit: no timeout, no failed audit."""
    processes = [sybil_swarm.start_server(0, 2, name="SH", launcher=faulty("--shield"))]
    try:
        live = [("SH", 0, 2), ("M", 2, 4), ("T", 4, 6)]
        with client(sybil_swarm, tiny_llama_path, live, request_timeout=10.0) as model:
            out = generate(model)
            stats = model.last_generation_stats
            print(f"\nshielding head: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.verdict_audits_failed >= 1 and stats.verdict_audit_detours == 1, stats.spot_check_events
            assert stats.tokens_unconfirmed == 0, stats.spot_check_events
            assert stats.liars_excluded == [] and stats.disputed_peers == []
            assert model.peers["SH"] not in model.swarm.excluded.current()
            # the client remembers the hops of the stalled audit: the next generation detours from the start
            out = generate(model)
            stats = model.last_generation_stats
            assert out == greedy_reference and stats.tokens_unconfirmed == 0, stats.spot_check_events
            assert stats.verdict_audits_failed == 0 and stats.verdict_audit_detours == 1, stats.spot_check_events
            assert "an earlier audit" in stats.spot_check_events[0], stats.spot_check_events
    finally:
        stop(sybil_swarm, processes)


@pytest.mark.parametrize(
    "shield, head, liar, event",
    [
        ("--shield", "SH2", "SL", "detour around the route's head"),
        ("--shield-evidence", "SE", "SL3", "evidence stalled"),
    ],
)
def test_a_shielded_liar_is_refuted_by_evidence_through_the_detour(
    sybil_swarm, tiny_llama_path, greedy_reference, shield, head, liar, event
):
    """The attack the shield is for: a head before a tail that lies in every verdict from position 32.
    ``--shield`` drops the shadows' Steps: the audits detour around it, a shadow disputes the lie, and
    both tails' evidence passes go through the detour's head (the shield would stall the live route's).
    ``--shield-evidence`` lets the shadows through and drops a repeated session's Steps once they ask for
    hidden states (a dispute's evidence): the evidence through it times out and is asked once more around
    it, through H (client/_shadow_detour.py). Either way the liar is refuted (avoided, not convicted:
    strangers fed both tails), T is not disputed, and the output equals local transformers."""
    processes = [sybil_swarm.start_server(0, 2, name=head, launcher=faulty(shield))]
    processes += start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", names=(liar,))
    try:
        routes = [[(head, 0, 2), ("M", 2, 4), (tail, 4, 6)] for tail in (liar, "T")]
        with client(sybil_swarm, tiny_llama_path, *routes, request_timeout=10.0) as model:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                out = generate(model)
            stats = model.last_generation_stats
            print(f"\n{shield}: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert any(event in e for e in stats.spot_check_events), stats.spot_check_events
            assert stats.verdict_audit_detours == 1 and stats.verdict_audits_by_evidence >= 1, stats.spot_check_events
            assert stats.disputed_peers == [model.peers[liar]] and stats.liars_excluded == [], stats.spot_check_events
    finally:
        stop(sybil_swarm, processes)


def test_the_last_audit_is_verified_by_every_candidate_past_the_pool(
    sybil_swarm, tiny_llama_path, greedy_reference, monkeypatch
):
    """A pool of one (``audit_witnesses=1``) and two candidate witnesses, U and V, for T's tokens: the first
    audit is verified by one of them, the second by the other (it rotates in and verifies from the first
    generated token), so the second window has one witness until the audit before the output is returned,
    which goes past the pool (``LAST_AUDIT_WITNESSES``): the witness the pool lost verifies every generated
    token at once with the pool's (``_verified_at_once``). So every returned token is confirmed by both.
    Before, the one past the pool verified the last window alone, and a window between the honest tail
    leaving the pool and the last audit was verified by the pool alone (docs/reliability.md, "Witnesses of
    the pool")."""
    from client import model as model_module

    auditors, make, prefilled = [], model_module.make_audits, []
    real_prefilled = _shadow_turns.ShadowTurns._prefilled

    async def counting(self, route, shadow_route, ids, window, stats):
        await real_prefilled(self, route, shadow_route, ids, window, stats)
        prefilled.append(shadow_route[-1].peer_id in self.parked)

    monkeypatch.setattr(_shadow_turns.ShadowTurns, "_prefilled", counting)

    def recording(*args, **kwargs):
        audits = make(*args, **kwargs)
        auditors.append(audits.verdicts)
        return audits

    monkeypatch.setattr(model_module, "make_audits", recording)
    processes = [sybil_swarm.start_server(4, 6, name="V")]
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("V"), route("U")) as model:  # T is live
            assert generate(model, audit_witnesses=1) == greedy_reference
            stats = model.last_generation_stats
            confirmers = auditors[-1].confirmers
            witnesses = {model.peers["U"], model.peers["V"]}
            last = len(PROMPT[0]) + NEW_TOKENS - 1
            assert all(confirmers[p] == witnesses for p in range(len(PROMPT[0]), last + 1)), confirmers
            assert stats.tokens_unconfirmed == 0 and stats.disputed_peers == [], stats.spot_check_events
            assert prefilled == [True], (prefilled, stats.spot_check_events)
    finally:
        stop(sybil_swarm, processes)


def first_witness_of_the_first_audit(monkeypatch) -> list[str]:
    """Patch the auditor so that the peer ids a test puts in the returned list witness first in the
    generation's first audit (drawn before any other), whatever the draw would have been."""
    real_order, chosen = _shadow_turns.ShadowTurns._turn_order, []

    def chosen_first(self, found, rotate=False):
        order = real_order(self, found, rotate)
        if not self.had_turn:
            order.sort(key=lambda candidate: candidate.peer_id not in chosen)
        return order

    monkeypatch.setattr(_shadow_turns.ShadowTurns, "_turn_order", chosen_first)
    return chosen


def test_a_witness_lying_only_between_the_pools_windows_is_caught_by_the_last_audit(
    sybil_swarm, tiny_llama_path, greedy_reference, monkeypatch
):
    """A pool of one, T live, and two candidate witnesses: F, which lies only at positions 38 and 39 (a
    window the pool's second witness verifies, not the first), drawn first, and U. F verifies the first
    audit honestly and leaves the pool when U rotates in; the audit before the output is returned (or, where
    an earlier audit covered the end, one with no token left, ``_past_the_pool``) has F verify every generated
    token again, at once with the pool (``_verified_at_once``): it disagrees at 38, its turn disputes, the
    evidence refutes it, never T, and the output is exact. Before, F verified the last window alone and
    never saw 38: a sybil lying only there was never asked about it (here an honest T's tokens, so nothing
    went wrong; with the live tail a sybil and F its mate, its lie stood confirmed)."""
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "38", "--lie-before", "40", names=("F",))
    framer = first_witness_of_the_first_audit(monkeypatch)  # F verifies the generation's first audit
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("F"), route("U")) as model:  # T is live
            framer.append(model.peers["F"])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tokens after F's refutation may have one witness left
                out = generate(model, audit_witnesses=1)
            stats = model.last_generation_stats
            print(f"\nlying between the windows: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert stats.disputed_peers == [model.peers["F"]], stats.spot_check_events
            assert any("position 38" in e and "refuted" in e for e in stats.spot_check_events), stats.spot_check_events
            assert stats.route[-1][0] == model.peers["T"] and model.peers["T"] not in model.swarm.excluded.current()
    finally:
        stop(sybil_swarm, processes)


def test_identities_on_one_group_cannot_crowd_the_honest_tail_out_of_the_last_audit(
    sybil_swarm, tiny_llama_path, greedy_reference, monkeypatch
):
    """L (live) and C1-C3 tell the same lie past position 32; C1-C3 share one /24 (one operator, three
    identities), so each may witness for L; T is honest, on a group of its own. One audit, the last, by a pool
    of one (C1, drawn first) and two witnesses past the pool (``LAST_AUDIT_WITNESSES`` 3 here), the
    candidates shuffled into the worst order for T (last). Taken in that order, the two were C2 and C3 and L's
    lies were returned confirmed; taken one of each machine group first (``Witnesses.choose``), they are C2
    and T: T disagrees, the evidence refutes L, never T, and the output equals local transformers."""
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", names=("L", "C1", "C2", "C3"))
    honest, real_shuffle = [], random.Random.shuffle

    def honest_last(self, items):
        real_shuffle(self, items)
        if honest and isinstance(items, list):
            items.sort(key=lambda c: getattr(c, "peer_id", None) == honest[0])

    monkeypatch.setattr(random.Random, "shuffle", honest_last)
    first = first_witness_of_the_first_audit(monkeypatch)
    monkeypatch.setattr(_shadow_turns, "LAST_AUDIT_WITNESSES", 3)
    try:
        routes = [route(name) for name in ("L", "T", "C1", "C2", "C3")]
        with client(sybil_swarm, tiny_llama_path, *routes, hidden=["U"], verdict_audit_every=NEW_TOKENS + 8) as model:
            on_one_machine(monkeypatch, {model.peers[name] for name in ("C1", "C2", "C3")})
            honest.append(model.peers["T"])
            first.append(model.peers["C1"])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tokens after L's refutation may have no witness left
                out = generate(model, audit_witnesses=1)
            stats = model.last_generation_stats
            print(f"\nthree identities on one group: {stats.spot_check_events}")
            assert out == greedy_reference, stats.spot_check_events
            assert model.peers["L"] in stats.disputed_peers, stats.spot_check_events
            assert model.peers["T"] not in stats.disputed_peers
            assert model.peers["T"] not in model.swarm.liars | model.swarm.excluded.current()
    finally:
        stop(sybil_swarm, processes)
