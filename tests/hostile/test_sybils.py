"""Trust against sybils (issue 35; docs/reliability.md, "Disputes" and "What is confirmed").

Live: a tiny-model swarm H (blocks 0:2), M (2:4) and tails T, U (4:6), honest, and two sybil tails
S1, S2 (4:6) run through tests/kit/faulty_server.py:
- framing (``--frame``): honest in live-looking laps, on audit-looking Steps they reject the first
  draft and name the second choice, so each confirms the other against T. No honest server may be
  convicted or reported; the output equals local transformers.
- colluding (``--lie-in-verdicts 1 --lie-after 32``): the same lie in every verdict past position
  32. With T trusted the output equals local transformers; with nobody trusted, and the two sybils
  on one machine as far as the client can tell, the lied tokens are flagged unconfirmed (and
  ``audit="required"`` raises).
- rejection sampling on the honest tails: nobody convicted, the tokens flagged unconfirmed.

Same-host peers: every server here listens on 127.0.0.1, which the client treats as the user's own
machine, one group per peer id (client/_witnesses.py says why); the colluding test puts S1 and S2
on one public /24 by patching ``machine_group``, as two sybils of one operator would be.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch

from client import _witnesses
from client._swarm import ExclusionList
from client.errors import UnconfirmedTokensError, UnconfirmedTokensWarning
from swarm.local import LocalSwarm, kill_group
from tests.kit.faulty_server import faulty
from tests.kit.reference import PROMPT
from tests.kit.routes import PreferredRoutes
from tests.kit.swarms import SERVER_ARGS, servers_by_name

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


@contextlib.contextmanager
def client(swarm, path, *routes, hidden=(), **kwargs):
    """A client routed by ``routes`` (servers by name) that never sees the servers in ``hidden``."""
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers, **kwargs)
    try:
        names = {name for r in routes for name, _, _ in r}
        deadline = time.monotonic() + 120
        while not all(getattr(servers_by_name(model, 6).get(n), "state", None) == "online" for n in names):
            assert time.monotonic() < deadline, f"not all of {sorted(names)} came online"
            time.sleep(0.5)
        model.swarm.router = PreferredRoutes(*routes)
        model.peers = {name: info.peer_id for name, info in servers_by_name(model, 6).items()}
        model.swarm.excluded = ExclusionList(base_seconds=3600)
        for name in hidden:
            model.swarm.excluded.add(model.peers[name])
        yield model
    finally:
        model.shutdown()


def generate(model, **kwargs) -> list[int]:
    out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, spot_check_rate=0.0, **kwargs)
    return out[0, len(PROMPT[0]) :].tolist()


def _run(coro):
    from client import _loop

    return _loop.run(coro)


def test_two_framing_sybils_convict_nobody_and_the_output_stays_exact(sybil_swarm, tiny_llama_path, greedy_reference):
    processes = start(sybil_swarm, "--frame")
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("S1"), route("S2"), hidden=["U"]) as model:
            for attempt in range(2):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = generate(model)
                stats = model.last_generation_stats
                print(f"\nframing {attempt}: {stats.spot_check_events}; route {stats.route}")
                assert out == greedy_reference, stats.spot_check_events
                assert stats.liars_excluded == [] and not model.swarm.liars
                assert model.peers["T"] in stats.disputed_peers, stats.spot_check_events  # framed, not convicted
                _run(model.swarm.flush_reports())
                assert not model.swarm.reports  # nothing reported in the DHT
                assert model.peers["T"] not in model.swarm.excluded.current()
                # after the dispute the generation re-verified on the other sybil's route (honest in
                # live-looking laps, re-verifications included); nobody independent was
                # left to confirm what S2 committed, and the caller is told
                sybils = {model.peers["S1"], model.peers["S2"]}
                assert stats.route[-1][0] in sybils - set(stats.disputed_peers)
                assert stats.tokens_unconfirmed > 0
                total = stats.tokens_confirmed_trusted + stats.tokens_confirmed_untrusted + stats.tokens_unconfirmed
                assert total == len(out)
                assert any(issubclass(w.category, UnconfirmedTokensWarning) for w in caught)
            with pytest.raises(UnconfirmedTokensError, match=r"\d+ of 40 generated tokens are unconfirmed"):
                generate(model, audit="required")
            # with T trusted, the framer that disputes it is refuted by T itself and convicted
            out = generate(model, trusted_peers=[model.peers["T"]])
            stats = model.last_generation_stats
            assert out == greedy_reference
            assert set(stats.liars_excluded) <= {model.peers["S1"], model.peers["S2"]} and stats.liars_excluded
            assert stats.tokens_confirmed_trusted == len(out) and stats.tokens_unconfirmed == 0
    finally:
        stop(sybil_swarm, processes)


def test_colluding_liars_are_refuted_by_a_trusted_tail_or_flagged(
    sybil_swarm, tiny_llama_path, greedy_reference, monkeypatch
):
    processes = start(sybil_swarm, "--lie-in-verdicts", "1", "--lie-after", "32", names=("L1", "L2"))
    try:
        with client(sybil_swarm, tiny_llama_path, route("L1"), route("T"), route("L2"), hidden=["U"]) as model:
            one_machine = {model.peers["L1"], model.peers["L2"]}
            group = _witnesses.machine_group
            monkeypatch.setattr(
                _witnesses,
                "machine_group",
                lambda addr, peer_id: "net:203.0.113.0/24" if peer_id in one_machine else group(addr, peer_id),
            )
            # nobody trusted: L2 may not witness for L1 (one machine), so T shadows, disputes, and
            # nobody settles it; the generation moves to L2, whose lies nobody independent confirms
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = generate(model)
            stats = model.last_generation_stats
            print(f"\ncolluding: {stats.spot_check_events}; out {out}")
            assert stats.liars_excluded == [] and not model.swarm.liars
            assert stats.tokens_unconfirmed > 0 and any(
                issubclass(w.category, UnconfirmedTokensWarning) for w in caught
            )
            confirmed = len(out) - stats.tokens_unconfirmed
            assert out[:confirmed] == greedy_reference[:confirmed]  # every lie is among the flagged tokens
            assert out != greedy_reference  # L2 lied after the dispute: why the tokens are flagged
            with pytest.raises(UnconfirmedTokensError):
                generate(model, audit="required")
            # T trusted: T shadows L1, refutes it, and the generation re-verifies on T's route
            out = generate(model, trusted_peers=[model.peers["T"]], audit="required")
            stats = model.last_generation_stats
            assert out == greedy_reference, stats.spot_check_events
            assert stats.liars_excluded == [model.peers["L1"]]
            assert stats.tokens_confirmed_trusted == len(out)
    finally:
        stop(sybil_swarm, processes)


def test_rejection_sampling_on_honest_tails_convicts_nobody(sybil_swarm, tiny_llama_path, tiny_reference):
    """Three honest tails (T, U and S1, S2 are gone); a local draft model with
    ``verification="rejection"``: its committed tokens are not the seeded choice, so verdict audits
    do not run (a token-match shadow would dispute honest tails); the tokens are flagged."""
    processes = start(sybil_swarm, names=("V",))  # a third honest tail
    try:
        with client(sybil_swarm, tiny_llama_path, route("T"), route("U"), route("V")) as model:
            for seed in range(3):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = generate(
                        model,
                        do_sample=True,
                        temperature=0.8,
                        seed=seed,
                        draft_model=tiny_reference,
                        verification="rejection",
                    )
                stats = model.last_generation_stats
                assert len(out) == NEW_TOKENS
                assert stats.liars_excluded == [] and not model.swarm.liars and stats.disputed_peers == []
                assert stats.verdict_audits == 0 and stats.tokens_unconfirmed == NEW_TOKENS
                assert any(issubclass(w.category, UnconfirmedTokensWarning) for w in caught)
    finally:
        stop(sybil_swarm, processes)
