"""Forward passes audited on a second route (issue 35; docs/reliability.md, "Forward passes and log-probs").

Live: a tiny-model swarm of two heads H, G (blocks 0:3) and two tails T, U (3:6), honest, and a
tail L (3:6) run through tests/kit/faulty_server.py with ``--lie-in-outputs``: the logits it returns
carry +3 on each row's second choice (its verdicts stay honest). Every client audits every pass
(``output_audit_rate=1.0``) and prefers routes through L while it runs.

- honest: every pass confirmed by an independent route, no dispute; logits equal local transformers;
- L, nobody trusted: the dispute is narrowed to the tail hop, L and the audit's tail are avoided, the
  pass recomputed on H + the third tail: logits equal local transformers, flagged unconfirmed (a
  warning), and ``audit="required"`` raises; nobody convicted;
- L, with G, T and U trusted: the trusted route settles it, L alone is convicted;
- through the gateway: ``echo`` log-probs equal local transformers', and "required" is a 502.

Every server listens on 127.0.0.1, which the client treats as the user's own machine, one group per
peer id (client/_witnesses.py), so each is independent of the others.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from client._logprob_audits import entries_agree, logprob_tolerance, verdict_difference
from client._output_audits import OutputAuditor, check_output_audit_rate, output_tolerance
from client._swarm import ExclusionList
from client.errors import UnconfirmedOutputsError, UnconfirmedOutputsWarning
from protocol.messages import Hop, StepResult, TokenLogprobs
from protocol.records import ServerInfo
from swarm.api.prompt_logprobs import score_tokens
from swarm.local import LocalSwarm
from tests.hostile.test_sybils import _post, client, stop
from tests.kit.faulty_server import faulty
from tests.kit.machine_groups import on_one_machine
from tests.kit.reference import PROMPT
from tests.kit.routes import PreferredRoutes
from tests.kit.swarms import SERVER_ARGS

HONEST = {"H": (0, 3), "G": (0, 3), "T": (3, 6), "U": (3, 6)}
LIAR_SHIFT = "3"


def start_liar(swarm, name: str) -> list:
    """A tail of blocks 3:6 whose returned logits lie (its verdicts stay honest). Each test names its
    own: a convicted one is reported in the DHT, and later clients route around its name's peer id."""
    return [swarm.start_server(3, 6, name=name, launcher=faulty("--lie-in-outputs", LIAR_SHIFT))]


def route(head: str, tail: str) -> list[tuple[str, int, int]]:
    return [(head, 0, 3), (tail, 3, 6)]


def test_rates_and_bounds():
    assert check_output_audit_rate(0.1) == 0.1 and check_output_audit_rate(1) == 1.0
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="output_audit_rate"):
            check_output_audit_rate(bad)

    def info(peer, dtype="float32", quant="none"):
        return ServerInfo(peer_id=peer, model="m", start_block=0, end_block=6, dtype=dtype, quantization=quant)

    records = {"a": info("a"), "b": info("b", "bfloat16"), "q": info("q", quant="int8")}
    hops = [Hop("a", 0, 3), Hop("b", 3, 6)]
    assert output_tolerance(hops[:1], records) == 1e-3 and output_tolerance(hops, records) == 0.08
    assert output_tolerance([Hop("q", 0, 6)], records) == output_tolerance([Hop("gone", 0, 6)], records) == 0.15
    assert logprob_tolerance([records["a"]]) == 1e-3 and logprob_tolerance([records["a"], records["b"]]) == 0.64
    assert logprob_tolerance([None]) == 1.0


def test_passes_are_audited_at_the_stated_rate_and_every_one_under_required(monkeypatch):
    """The first pass through a server the model has not audited is audited; after that the default
    rate (0.1) draws about one pass in ten; audit="required" audits every pass; a route of trusted
    servers only is confirmed as it is, unaudited."""
    import asyncio
    import random
    from types import SimpleNamespace as ns

    auditor = OutputAuditor(ns(), rng=random.Random(0), trusted=["t"])
    assert auditor.rate == 0.1

    async def confirmed(row, shape, live):
        return live, "untrusted", ""

    monkeypatch.setattr(auditor, "_audit", confirmed)
    route, logits = [Hop("a", 0, 6)], torch.zeros(1, 4)

    def check(audit: str, hops=route) -> str:
        return asyncio.run(auditor.check([1], hops, logits, None, (1, 4, 0, False), audit))[1]

    first, drawn = check("warn"), [check("warn") for _ in range(2000)]
    assert first == "untrusted" and auditor.stats.first_use == 1  # "a" met for the first time
    assert 150 <= drawn.count("untrusted") <= 250 and drawn.count("unaudited") == 2000 - drawn.count("untrusted")
    assert all(check("required") == "untrusted" for _ in range(20))
    assert check("required", [Hop("t", 0, 6)]) == "trusted"
    assert check("warn", [Hop("t", 0, 3), Hop("b", 3, 6)]) == "untrusted"  # "b" is new, "t" trusted
    assert auditor.stats.first_use == 2
    assert auditor.stats.audited == 1 + drawn.count("untrusted") + 20 + 1
    off = OutputAuditor(ns(), 0.0)  # rate 0: audits off, first passes too
    assert asyncio.run(off.check([1], route, logits, None, (1, 4, 0, False), "warn"))[1] == "unaudited"


def test_a_tail_refuted_by_evidence_confirms_nothing_for_the_other_side(monkeypatch):
    """Two colluding tails: one lies in the pass, the other lies in the evidence to get itself refuted.
    The pass returned is confirmed only by a third tail independent of both that agrees with it."""
    import asyncio
    from types import SimpleNamespace as ns

    from client._output_audits import Pass

    auditor = OutputAuditor(ns(records={}, p2p=None, convict=None), 1.0)

    async def refresh(p2p):
        return None

    monkeypatch.setattr(auditor.witnesses, "refresh", refresh)
    kept = Pass([Hop("h", 0, 3), Hop("partner", 3, 6)], torch.zeros(2, 4), None)
    live = [Hop("h", 0, 3), Hop("sacrificed", 3, 6)]

    def settle(third_tail: str, third_logits: torch.Tensor) -> tuple[str, str]:
        async def substitute(route, length, exclude, independent_of, only=None):
            assert set(independent_of) == {"partner", "sacrificed"} and exclude == {"sacrificed"}
            return [route[0], Hop(third_tail, 3, 6)]

        async def one_pass(route, row, shape):
            return Pass(route, third_logits, None)

        monkeypatch.setattr(auditor, "_substitute", substitute)
        monkeypatch.setattr(auditor, "_pass", one_pass)
        _, how, why = asyncio.run(auditor._settled("sacrificed", kept, live, "w", True, [1, 2], (2, 4, 0, False)))
        return how, why

    how, why = settle("honest", torch.full((2, 4), 5.0))  # the third disagrees: the partner's lie is flagged
    assert how == "unconfirmed" and "disagrees" in why
    assert settle("partner", torch.zeros(2, 4))[0] == "unconfirmed"  # no third tail independent of both
    assert settle("honest", torch.zeros(2, 4)) == ("untrusted", "")  # a third that agrees confirms it
    assert auditor.avoid == {"sacrificed"} and auditor.stats.by_evidence == 3


def test_a_response_reports_its_weakest_prompt_confirmation():
    from types import SimpleNamespace as ns

    from swarm.api.responses import with_prompt_confirmation

    assert with_prompt_confirmation({}, [ns(prompt_confirmed="")]) == {}  # nothing scored: no field
    scored = [ns(prompt_confirmed="trusted"), ns(prompt_confirmed="untrusted"), ns(prompt_confirmed="")]
    assert with_prompt_confirmation({"laps": 0}, scored) == {"laps": 0, "prompt_logprobs": "untrusted"}


def test_log_prob_entries_agree_within_the_bound_and_near_ties_may_swap():
    honest = TokenLogprobs(7, -0.5, [7, 3, 9], [-0.5, -1.2, -3.0])
    assert entries_agree(honest, TokenLogprobs(7, -0.5004, [7, 3, 9], [-0.5004, -1.2, -3.0]), 1e-3)
    assert not entries_agree(honest, TokenLogprobs(7, 0.0, [7, 3, 9], [0.0, -0.7, -2.5]), 1e-3)  # shifted
    assert not entries_agree(honest, TokenLogprobs(8, -0.5, [7, 3, 9], [-0.5, -1.2, -3.0]), 1e-3)  # another token
    assert entries_agree(honest, TokenLogprobs(7, -0.5, [7, 3, 4], [-0.5, -1.2, -3.0]), 1e-3)  # a tie at the K-th
    assert not entries_agree(honest, TokenLogprobs(7, -0.5, [7, 4, 9], [-0.5, -1.2, -3.0]), 1e-3)  # 3 vanished
    a = StepResult(session_id="s", run_id=0, accepted=2, next_token=5, logprobs=[honest])
    assert verdict_difference(a, a, 1e-3) == 0.0
    other = StepResult(session_id="s", run_id=0, accepted=1, next_token=5, logprobs=[honest])
    assert verdict_difference(a, other, 1e-3) == float("inf")


@pytest.fixture(scope="module")
def pair_swarm(tiny_llama_path, artifacts_dir):
    with LocalSwarm(
        str(tiny_llama_path),
        spans=list(HONEST.values()),
        names=list(HONEST),
        server_args=SERVER_ARGS,
        log_dir=str(artifacts_dir / "output-audit-swarm"),
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference_logits(tiny_reference):
    with torch.no_grad():
        return tiny_reference(torch.tensor(PROMPT)).logits[0]


def audited(model, trusted=(), lm_head=None) -> OutputAuditor:
    """Every forward pass of ``model`` audited, with these servers (by name) trusted; with ``lm_head``
    (the checkpoint's rows) disputes are settled by evidence, without it only by trusted servers."""
    model.output_audits = OutputAuditor(model.swarm, 1.0, [model.peers[name] for name in trusted], lm_head)
    return model.output_audits


def test_honest_passes_are_confirmed_and_never_disputed(pair_swarm, tiny_llama_path, reference_logits):
    with client(pair_swarm, tiny_llama_path, route("H", "T"), route("G", "U")) as model:
        audits = audited(model)
        for _ in range(3):
            logits = model(torch.tensor(PROMPT), audit="required").logits[0]
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
        stats = audits.stats
        assert stats.passes == stats.audited == stats.confirmed_untrusted == 3, stats.events
        assert stats.disputes == 0 and stats.unconfirmed == 0 and stats.convicted == [] and stats.events == []


def test_a_logit_liar_is_flagged_and_recomputed_elsewhere_or_convicted_by_trusted_servers(
    pair_swarm, tiny_llama_path, reference_logits
):
    processes = start_liar(pair_swarm, "L")
    try:
        routes = (route("H", "L"), route("G", "T"), route("H", "U"))
        with client(pair_swarm, tiny_llama_path, *routes) as model:
            audits = audited(model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits = model(torch.tensor(PROMPT)).logits[0]
            print(f"\nlogit liar, nobody trusted: {audits.stats.events}")
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)  # recomputed on H + T or U
            assert any(issubclass(w.category, UnconfirmedOutputsWarning) for w in caught)
            stats = audits.stats
            assert stats.disputes == 1 and stats.unconfirmed == 1 and stats.convicted == []
            assert model.peers["L"] in stats.disputed_peers and len(stats.disputed_peers) == 2  # L and one tail
            assert not {model.peers["H"], model.peers["G"]} & set(stats.disputed_peers)  # narrowed to the tail hop
            assert not model.swarm.liars and audits.avoid == set(stats.disputed_peers)
            # the model's later passes route around both disputed tails: no new dispute, the logits exact
            logits = model(torch.tensor(PROMPT)).logits[0]
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
            assert stats.disputes == 1 and stats.passes == 2
            # a fresh auditor, L on the route again: audit="required" refuses the unsettled dispute
            audits = audited(model)
            with pytest.raises(UnconfirmedOutputsError, match="unconfirmed"):
                model(torch.tensor(PROMPT), audit="required")
            # G, T and U trusted: the audit route is trusted, the narrowing convicts L alone
            audits = audited(model, trusted=("G", "T", "U"))
            logits = model(torch.tensor(PROMPT), audit="required").logits[0]
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
            print(f"logit liar, G T U trusted: {audits.stats.events}")
            assert audits.stats.convicted == [model.peers["L"]] and audits.stats.confirmed_trusted == 1
            assert model.swarm.liars == {model.peers["L"]}
    finally:
        stop(pair_swarm, processes)


def test_a_dispute_avoids_the_liars_machine_group_and_falls_back_on_the_honest_tail(
    pair_swarm, tiny_llama_path, reference_logits, monkeypatch
):
    """Two logit liars L4, L5 on one machine group (one public /24, as one operator's sybils), the
    honest T on its own, U hidden. L4 is live; its audit (G + T: L5 is no independent witness for
    L4) disputes it at the tail hop and nobody settles it. Avoiding only L4 and T would recompute the
    pass on L5, which repeats L4's lie; the dispute avoids both machine groups instead, and with no
    tail left falls back on T's group (one identity against two): the logits returned are T's,
    exact, flagged unconfirmed, and the next pass routes on T. Nobody is convicted."""

    processes = [
        pair_swarm.start_server(3, 6, name=name, launcher=faulty("--lie-in-outputs", LIAR_SHIFT))
        for name in ("L4", "L5")
    ]
    try:
        routes = (route("H", "L4"), route("G", "T"), route("H", "L5"))
        with client(pair_swarm, tiny_llama_path, *routes, hidden=["U"]) as model:
            one_machine = {model.peers["L4"], model.peers["L5"]}
            on_one_machine(monkeypatch, one_machine)
            audits = audited(model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits = model(torch.tensor(PROMPT)).logits[0]
            stats = audits.stats
            print(f"\none-machine logit liars: {stats.events}")
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)  # T's, not L5's
            assert any(issubclass(w.category, UnconfirmedOutputsWarning) for w in caught)
            assert stats.disputes == 1 and stats.unconfirmed == 1 and stats.convicted == [] and not model.swarm.liars
            assert set(stats.disputed_peers) == {model.peers["L4"], model.peers["T"]}
            assert audits.avoid == one_machine | {model.peers["T"]}  # L5 avoided with its group-mate
            assert audits.route_avoid()[0] == model.peers["T"]  # the group to fall back on first
            assert any(_names_tail(model, "T") in e for e in stats.events), stats.events  # recomputed on T
            logits = model(torch.tensor(PROMPT)).logits[0]  # routed on T: exact, no new dispute
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
            assert stats.disputes == 1 and stats.passes == 2 and stats.convicted == []
    finally:
        stop(pair_swarm, processes)


def test_a_logit_liar_is_refuted_by_evidence_and_a_made_up_hidden_state_settles_nothing(
    pair_swarm, tiny_llama_path, reference_logits
):
    """The client reads the LM head (client/_output_evidence.py). LE lies in its logits (+3 on each
    row's second choice) but sends its true final hidden state: nobody trusted, its tail dispute is
    settled by evidence: LE refuted and avoided (not convicted: H, before it, is a stranger), the
    honest tail neither disputed nor avoided, the audit route's logits returned, exact and confirmed;
    through the gateway the same for ``echo`` log-probs, and ``"audit": "required"`` is served. LH
    lies the same and makes its h up: the states differ, nothing is settled, both tails avoided,
    nobody convicted. With H trusted, LE is convicted by the same evidence."""
    from swarm.api import Gateway, GatewayConfig
    from tests.api.test_api import GatewayThread

    processes = start_liar(pair_swarm, "LE")
    processes += [
        pair_swarm.start_server(3, 6, name="LH", launcher=faulty("--lie-in-outputs", "3", "--made-up-hidden", "0.5"))
    ]
    try:
        routes = (route("H", "LE"), route("G", "T"), route("H", "U"))
        with client(pair_swarm, tiny_llama_path, *routes, hidden=["LH"]) as model:  # two liars would agree
            head = model.lm_head_rows
            audits = audited(model, lm_head=head)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UnconfirmedOutputsWarning)  # settled: nothing flagged
                logits = model(torch.tensor(PROMPT)).logits[0]
            stats = audits.stats
            print(f"\nlogit liar, evidence: {stats.events}")
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)  # the audit route's
            assert stats.disputes == stats.by_evidence == 1 and stats.confirmed_untrusted == 1 and not stats.unconfirmed
            assert stats.disputed_peers == [model.peers["LE"]] and audits.avoid == {model.peers["LE"]}
            assert stats.convicted == [] and not model.swarm.liars and "refuted" in stats.events[-1]
            # echo log-probs through the gateway, LE on the route again (a fresh auditor): refuted, exact, served
            audits = audited(model, lm_head=head)
            honest = score_tokens(reference_logits[:-1], PROMPT[0][1:], 3)
            with GatewayThread(Gateway({"tiny": model}, GatewayConfig())) as served:
                body = {"model": "tiny", "prompt": PROMPT[0], "max_tokens": 0, "echo": True, "logprobs": 3}
                status, reply = _post(f"{served.url}/completions", {**body, "audit": "required"})
                assert status == 200, reply
                scored = reply["choices"][0]["logprobs"]["token_logprobs"]
                assert scored[1:] == pytest.approx([entry.logprob for entry in honest], abs=1e-4)
                assert reply["specswarm"]["prompt_logprobs"] == "untrusted", reply["specswarm"]
            assert audits.stats.by_evidence == 1 and audits.stats.disputed_peers == [model.peers["LE"]]
            # LH makes its h up: nothing settled, both tails avoided, the pass recomputed on the third
            audits = audited(model, lm_head=head)
            hide(model, "LE")
            model.swarm.router = PreferredRoutes(route("H", "LH"), route("G", "T"), route("H", "U"))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits = model(torch.tensor(PROMPT)).logits[0]
            stats = audits.stats
            print(f"made-up hidden state: {stats.events}")
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
            assert any(issubclass(w.category, UnconfirmedOutputsWarning) for w in caught)
            assert stats.by_evidence == 0 and "hidden states differ" in stats.events[-1]
            assert model.peers["LH"] in stats.disputed_peers and len(stats.disputed_peers) == 2
            assert stats.convicted == [] and not model.swarm.liars
            # H trusted: the hop before the tail is trusted, so the evidence convicts LE
            audits = audited(model, trusted=("H",), lm_head=head)
            hide(model, "LH")
            model.swarm.router = PreferredRoutes(route("H", "LE"), route("G", "T"), route("H", "U"))
            logits = model(torch.tensor(PROMPT), audit="required").logits[0]
            print(f"logit liar, H trusted: {audits.stats.events}")
            torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
            assert audits.stats.convicted == [model.peers["LE"]] and model.swarm.liars == {model.peers["LE"]}
            assert audits.stats.by_evidence == 1 and audits.stats.disputed_peers == []
    finally:
        stop(pair_swarm, processes)


def hide(model, name: str) -> None:
    """The client forgets its exclusions and excludes ``name`` alone."""
    model.swarm.excluded = ExclusionList(base_seconds=3600)
    model.swarm.excluded.add(model.peers[name])


def _names_tail(model, name: str) -> str:
    """How ``_names`` writes the tail hop of ``name`` in an event."""
    return f"{model.peers[name][-6:]}[3:6)"


def test_echo_logprobs_with_a_liar_among_the_tails_equal_the_honest_ones(pair_swarm, tiny_llama_path, reference_logits):
    from swarm.api import Gateway, GatewayConfig
    from tests.api.test_api import GatewayThread

    processes = start_liar(pair_swarm, "L2")
    try:
        with client(pair_swarm, tiny_llama_path, route("H", "L2"), route("G", "T"), route("H", "U")) as model:
            audited(model)
            honest = score_tokens(reference_logits[:-1], PROMPT[0][1:], 3)
            with GatewayThread(Gateway({"tiny": model}, GatewayConfig())) as served:
                body = {"model": "tiny", "prompt": PROMPT[0], "max_tokens": 0, "echo": True, "logprobs": 3}
                status, reply = _post(f"{served.url}/completions", body)
                assert status == 200, reply
                scored = reply["choices"][0]["logprobs"]["token_logprobs"]
                assert scored[0] is None and len(scored) == len(PROMPT[0])
                assert scored[1:] == pytest.approx([entry.logprob for entry in honest], abs=1e-4)
                assert reply["specswarm"]["prompt_logprobs"] == "unconfirmed", reply["specswarm"]  # the liar's pass
                status, reply = _post(f"{served.url}/completions", {**body, "audit": "required"})
                assert status == 502 and reply["error"]["code"] == "tokens_unconfirmed", reply
                assert "forward pass" in reply["error"]["message"]
    finally:
        stop(pair_swarm, processes)


NEW_TOKENS = 24


def honest_logprobs(tiny_reference, tokens: list[int], k: int) -> list[tuple[int, float, list[int]]]:
    """(token, its log-prob, the top-k ids) at each generated position, from local transformers."""
    ids = torch.tensor([PROMPT[0] + tokens])
    with torch.no_grad():
        rows = torch.log_softmax(tiny_reference(ids).logits[0].float(), dim=-1)[len(PROMPT[0]) - 1 : -1]
    return [(t, float(row[t]), row.topk(k).indices.tolist()) for t, row in zip(tokens, rows)]


def generate_with_logprobs(model, **kwargs) -> tuple[list[int], list]:
    out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, num_logprobs=3, spot_check_rate=0.0, **kwargs)
    return out[0, len(PROMPT[0]) :].tolist(), model.last_logprobs


def assert_honest(entries, tokens, tiny_reference) -> None:
    expected = honest_logprobs(tiny_reference, tokens, 3)
    assert len(entries) == len(tokens)
    for entry, (token, logprob, top) in zip(entries, expected):
        assert entry.token_id == token and entry.top_ids == top
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)


def test_verdict_logprobs_are_audited_by_the_shadow(pair_swarm, tiny_llama_path, tiny_reference):
    """A tail whose verdicts' log-probs carry +0.5 (its tokens honest): the shadow, asking for the
    same top-K, disputes it, and the evidence (both tails' h, the log-probs recomputed over the whole
    head) refutes it: nobody trusted, avoided, re-verified elsewhere, the log-probs returned honest;
    H (before the tail) trusted, or T and U: convicted. Honest tails never dispute over log-probs."""
    routes = (route("H", "T"), route("G", "U"))
    with client(pair_swarm, tiny_llama_path, *routes) as model:
        tokens, entries = generate_with_logprobs(model, audit="required")
        stats = model.last_generation_stats
        assert stats.verdict_audits >= 1 and stats.disputed_peers == [] and stats.liars_excluded == []
        assert_honest(entries, tokens, tiny_reference)
    processes = [pair_swarm.start_server(3, 6, name="LP", launcher=faulty("--lie-in-logprobs", "0.5"))]
    try:
        with client(pair_swarm, tiny_llama_path, route("H", "LP"), route("G", "T"), route("H", "U")) as model:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the re-verified tokens may be left without a second tail
                tokens, entries = generate_with_logprobs(model)
            stats = model.last_generation_stats
            print(f"\nlog-prob liar, nobody trusted: {stats.spot_check_events}")
            # refuted by evidence (client/_output_evidence.py), the honest shadow never disputed
            assert stats.disputed_peers == [model.peers["LP"]] and stats.liars_excluded == []
            assert stats.verdict_audits_by_evidence >= 1 and stats.verdict_audits_undecided == 0
            assert_honest(entries, tokens, tiny_reference)
            # H, the hop before the tail, trusted: the same evidence convicts LP
            tokens, entries = generate_with_logprobs(model, trusted_peers=[model.peers["H"]])
            stats = model.last_generation_stats
            print(f"log-prob liar, H trusted: {stats.spot_check_events}")
            assert stats.liars_excluded == [model.peers["LP"]] and stats.verdict_audits_by_evidence >= 1
            assert_honest(entries, tokens, tiny_reference)
            model.swarm.excluded = ExclusionList(base_seconds=3600)  # LP back, for the trusted shadows
            tokens, entries = generate_with_logprobs(model, trusted_peers=[model.peers["T"], model.peers["U"]])
            stats = model.last_generation_stats
            print(f"log-prob liar, T U trusted: {stats.spot_check_events}")
            assert stats.liars_excluded == [model.peers["LP"]]
            assert_honest(entries, tokens, tiny_reference)
    finally:
        stop(pair_swarm, processes)


@pytest.mark.timeout(900)
def test_lm_eval_multiple_choice_through_the_gateway_is_unchanged_by_a_logit_liar(
    pair_swarm, tiny_llama_path, monkeypatch
):
    """lm-evaluation-harness's ``multiple_choice`` task (each choice scored by an echo + logprobs
    request) through the gateway, with a logit liar on the preferred route and the client's defaults
    (``output_audit_rate=0.1``, LM-head evidence): the liar's first pass is audited (first use), refuted
    and routed around, and the log-likelihoods (within 1e-4) and accuracy equal the ``hf`` backend's."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency: pip install -e '.[dev]'")
    from swarm.api import Gateway, GatewayConfig
    from tests.api.test_api import GatewayThread
    from tests.api.test_eval_harness import local_tasks, responses
    from tests.kit.threads import single_torch_thread

    # started before the environment below changes: a server asked for another HF_* value than the
    # forkserver's starts a fresh interpreter (swarm/warm_start.py), 5-10 s of CPU for nothing here
    processes = start_liar(pair_swarm, "L3")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    path, tasks = str(tiny_llama_path), [t for t in local_tasks() if t["task"] == "swarm_choice"]

    def evaluate(model: str, model_args: dict) -> dict:
        return lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=tasks, log_samples=True, bootstrap_iters=0, random_seed=0
        )

    try:
        with single_torch_thread():
            local = evaluate("hf", {"pretrained": path, "dtype": "float32", "device": "cpu"})
        with client(pair_swarm, tiny_llama_path, route("H", "L3"), route("G", "T"), route("H", "U")) as model:
            audits = model.output_audits  # as from_pretrained made it: the default rate, the checkpoint's LM head
            assert audits.rate == 0.1 and audits.lm_head is not None
            with GatewayThread(Gateway({path: model}, GatewayConfig())) as served:  # served under the path's name
                args = {"model": path, "base_url": f"{served.url}/completions", "tokenizer_backend": "huggingface"}
                args.update(tokenizer=path, num_concurrent=1, max_retries=1)
                remote = evaluate("local-completions", args)
            stats = audits.stats
            print(f"\nlm-eval with a logit liar: {stats.passes} passes, {stats.audited} audited, {stats.events[:2]}")
            assert stats.disputes >= 1 and model.peers["L3"] in stats.disputed_peers and stats.by_evidence >= 1
            assert stats.first_use >= 1 and stats.audited < stats.passes  # not every pass: the default rate
    finally:
        stop(pair_swarm, processes)
    got, want = responses(remote, "swarm_choice"), responses(local, "swarm_choice")
    assert len(got) == len(want) > 0
    for doc_got, doc_want in zip(got, want):
        for g, w in zip(doc_got, doc_want):
            g, w = (g[0], w[0]) if isinstance(g[0], (list, tuple)) else (g, w)
            assert abs(g[0] - w[0]) <= 1e-4 and g[1] == w[1], (g, w)
    for metric in ("acc,none", "acc_norm,none"):
        assert remote["results"]["swarm_choice"][metric] == local["results"]["swarm_choice"][metric]


def test_a_logit_liar_that_answers_the_evidence_honestly_has_no_pass_to_lie_in(
    pair_swarm, tiny_llama_path, reference_logits
):
    """LA lies in its logits (+3 on each row's second choice) only on passes that ask for no hidden
    states (``--lie-unless-hidden``): the evidence of a dispute must ask for them, so before every pass
    asked, LA lied live, answered the evidence honestly, and got itself and the honest tail of the audit
    avoided, never refuted. Every pass now asks for the states (client/_forward.py), so LA cannot tell a
    pass from the evidence: the logits equal local transformers, the audit confirms them, nobody is
    disputed; and what the caller gets is what it asked for (no states unless asked)."""
    processes = [
        pair_swarm.start_server(3, 6, name="LA", launcher=faulty("--lie-in-outputs", "3", "--lie-unless-hidden"))
    ]
    try:
        routes = (route("H", "LA"), route("G", "T"), route("H", "U"))
        with client(pair_swarm, tiny_llama_path, *routes) as model:
            audits = audited(model, lm_head=model.lm_head_rows)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UnconfirmedOutputsWarning)
                out = model(torch.tensor(PROMPT))
            stats = audits.stats
            print(f"\nlogit liar unless hidden: {stats.events}")
            torch.testing.assert_close(out.logits[0], reference_logits, rtol=1e-4, atol=1e-4)
            assert out.hidden_states is None
            assert stats.disputes == 0 and stats.confirmed_untrusted == 1 and stats.disputed_peers == []
    finally:
        stop(pair_swarm, processes)
