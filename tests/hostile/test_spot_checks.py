"""Spot-checks of activations (client/_spot_checks.py; docs/reliability.md, "Spot-checks").

Unit: the tolerance rule, the choice of the audited hop and its substitutes, the majority vote.
Live: a tiny-model swarm with two lying servers (``tests.kit.faulty_server --corrupt noise`` on blocks 0:3 and
``--corrupt offset`` on 3:6) beside honest ones, which the client trusts (``trusted_peers``); routes
pinned through a liar, every verdict audited (``spot_check_rate=1.0``): the liar is caught by a
trusted server, excluded, reported in the DHT (the dashboard counts it), and the output is
token-identical to an honest run. A second swarm has a head that lies in the live session alone (honest
in every session that repeats an open one's prompt, as audits do): the spot-checks' replays agree with
each other, not with the live lap, and the route is avoided (client/_live_agreement.py).
"""

from __future__ import annotations

import contextlib
import math
import re
import time

import pytest
import torch

from client._spot_checks import (
    SpotChecker,
    alternatives,
    check_rate,
    minority,
    pick_hop,
    relative_difference,
    route_tolerance,
    substituted,
    tolerance,
)
from protocol.messages import Hop
from protocol.records import ServerInfo, ServerState
from swarm.local import LocalSwarm
from tests.kit.faulty_server import faulty
from tests.kit.routes import PreferredRoutes
from tests.kit.swarms import SERVER_ARGS, servers_by_name

# ---- unit: the tolerance rule ------------------------------------------------------------------


def test_relative_difference_and_dtype_tolerances():
    x = torch.tensor([10.0, -20.0, 5.0])
    assert relative_difference(x, x.clone()) == 0.0
    assert relative_difference(x, x + torch.tensor([0.0, 0.1, 0.0])) == pytest.approx(0.1 / 20, rel=1e-4)
    small = torch.tensor([0.1, -0.2])  # max|x| < 1: the difference is taken as absolute
    assert relative_difference(small, small + 0.01) == pytest.approx(0.01, rel=1e-4)
    assert relative_difference(x, x[:2]) == math.inf  # another shape: a disagreement
    assert relative_difference(x, torch.tensor([10.0, float("nan"), 5.0])) == math.inf
    assert tolerance("float32", "none") == 1e-3 and tolerance("float32", None) == 1e-3
    assert tolerance("bfloat16", "none") == tolerance("float16", "none") == 3e-2
    assert tolerance("bfloat16", "int8") == tolerance("float16", "nf4") == 0.1
    assert tolerance("float8_e4m3fn", "none") == 0.1  # unknown: loose
    honest = x * (1 + 1e-6)  # float32 rounding across kernels
    assert relative_difference(x, honest) < tolerance("float32", "none")
    assert relative_difference(x, x + 0.05 * 20) > tolerance("bfloat16", "none")


def _info(peer: str, start: int, end: int, dtype: str = "float32", quant: str = "none", **fields) -> ServerInfo:
    fields.setdefault("free_cache_tokens", 10_000)
    return ServerInfo(
        peer_id=peer, model="m", start_block=start, end_block=end, dtype=dtype, quantization=quant, **fields
    )


def test_alternatives_same_precision_sub_ranges_and_round_robin():
    records = {
        r.peer_id: r
        for r in [
            _info("h", 0, 3),
            _info("t", 3, 6),
            _info("full", 0, 6),  # covers either hop as a sub-range of its span
            _info("head16", 0, 3, dtype="bfloat16"),
            _info("head8", 0, 3, quant="int8"),  # other precisions: never
            _info("short", 0, 2),  # does not cover [0, 3)
            _info("joining", 0, 3, state=ServerState.JOINING),
            _info("full-cache", 3, 6, free_cache_tokens=5),
            _info("t2", 3, 6),
            _info("gone", 3, 6),
        ]
    }
    route = [Hop("h", 0, 3), Hop("t", 3, 6)]
    names = lambda infos: [i.peer_id for i in infos]  # noqa: E731
    assert names(alternatives(route, 0, records, exclude={"gone"}, length=100)) == ["full"]
    assert names(alternatives(route, 1, records, exclude={"gone"}, length=100)) == ["full", "t2"]
    assert alternatives([Hop("unknown", 0, 6)], 0, records, (), 100) == []  # no record: no precision known
    # a hop that is a sub-range of its server's span: substitutes must cover just that range
    sub = [Hop("full", 0, 2), Hop("t", 2, 6)]
    assert names(alternatives(sub, 0, records, (), 100)) == ["h", "short"]
    assert names(alternatives(sub, 1, records, (), 100)) == []  # nobody else covers 2:6
    # round robin: the next hop at or after `first` that has an alternative
    assert pick_hop(route, 0, records, {"gone"}, 100)[0] == 0
    assert pick_hop(route, 1, records, {"gone"}, 100)[0] == 1
    assert pick_hop(route, 2, records, {"gone"}, 100)[0] == 0
    assert pick_hop(sub, 1, records, (), 100)[0] == 0  # hop 1 has none: on to hop 0
    assert pick_hop(route, 0, records, {"full", "t2", "gone"}, 100) is None  # nothing left: skipped
    # the substitute computes exactly the hop's blocks, the rest of the route unchanged
    assert substituted(route, 1, "t2") == [Hop("h", 0, 3), Hop("t2", 3, 6)]
    # the route's loosest precision sets the tolerance (16-bit hops after a hop amplify its rounding)
    mixed = {**records, "t": _info("t", 3, 6, dtype="bfloat16")}
    assert route_tolerance(route, records) == 1e-3 and route_tolerance(route, mixed) == 3e-2


def test_majority_vote():
    assert minority(True, False, False) is None  # no dispute: nobody
    assert minority(False, False, True) == "orig"  # the third agrees with the substitute
    assert minority(False, True, False) == "alt"  # ... with the route's own server
    assert minority(False, False, False) is None  # three different answers: undecided
    assert minority(False, True, True) is None  # agrees with both (each within tolerance): undecided


def test_rate_is_checked():
    assert check_rate(0) == 0.0 and check_rate(1) == 1.0 and check_rate(0.02) == 0.02
    for bad in (-0.1, 1.5, float("nan"), True, "0.1", None):
        with pytest.raises(ValueError, match="spot_check_rate must be a number in"):
            check_rate(bad)


class LiarThenHonestSwarm:
    """An oracle swarm (tests/kit/oracle.py) whose first route goes through a liar that answers
    ``wrong``; after ``catch_after`` verdicts the liar is convicted, and every later session is
    honest. The decoder must leave the liar and re-verify what it generated through it."""

    def __init__(self, honest: list[int], wrong: list[int], catch_after: int, max_positions_per_step: int):
        from tests.kit.oracle import OracleSession

        self.honest, self.wrong, self.catch_after = honest, wrong, catch_after
        self.max_positions_per_step = max_positions_per_step
        self.liars: frozenset = frozenset()
        self.sessions: list = []
        self._session = OracleSession
        self.verdicts = 0

    async def open_session(self, max_length: int, avoid=()):
        lying = not self.liars
        session = self._session(self.wrong if lying else self.honest, eos=-1)
        session.route = [Hop("liar" if lying else "honest", 0, 6)]
        session.max_positions_per_step = self.max_positions_per_step  # the route's limit (SwarmClient.route_step_limit)
        read = session.next_result

        async def next_result(min_run_id, timeout=None):
            result = await read(min_run_id, timeout)
            self.verdicts += 1
            if self.verdicts >= self.catch_after:
                self.liars = frozenset({"liar"})
            return result

        session.next_result = next_result
        self.sessions.append(session)
        return session

    async def close_session(self, session) -> None:
        pass

    def observe_lap(self, route, seconds: float, positions: int, looped: bool = False) -> None:
        pass


@pytest.mark.parametrize("limit", [512, 4])
def test_re_verification_keeps_the_honest_prefix_and_chunks(limit):
    """The liar's answer agrees with the honest one for 3 tokens, then differs. Caught after 9
    verdicts: the prompt goes up as committed ids, the generated tokens as drafts (with a
    4-position limit: prefill chunks first, then the drafts over several laps), the first 3 are
    re-confirmed, the rest retracted, and the output is the honest answer; a streaming caller
    that drops ``retracted`` tokens before appending each lap's ends with it too."""
    from client import _loop
    from client._generation import SessionState, SpeculativeDecoder
    from protocol.messages import GREEDY

    prompt = [1, 2, 3, 4, 5, 6]
    answer = list(range(100, 130))
    wrong = answer[:3] + list(range(200, 227))
    swarm = LiarThenHonestSwarm(prompt + answer, prompt + wrong, catch_after=9, max_positions_per_step=limit)
    streamed, seen = [], [0]

    def on_tokens(new):
        gone, seen[0] = decoder.stats.tokens_retracted - seen[0], decoder.stats.tokens_retracted
        streamed[len(streamed) - gone :] = []
        streamed.extend(new)

    decoder = SpeculativeDecoder(swarm, SessionState(max_length=64), GREEDY, on_tokens=on_tokens)
    out = _loop.run(decoder.generate(prompt, 20))
    assert out == answer[:20] and streamed == answer[:20]
    (event,) = decoder.stats.spot_check_events
    caught = int(re.search(r"re-verifying (\d+) generated tokens", event).group(1))
    assert caught == (9 if limit == 512 else 8)  # 9 verdicts; with chunking the prompt's prefill chunk is one of them
    assert decoder.stats.tokens_retracted == caught - 3
    assert [s.route[0].peer_id for s in swarm.sessions] == ["liar", "honest"]
    replay = [step for step in swarm.sessions[1].steps.values() if step.n_draft]
    assert replay[0].token_ids[-replay[0].n_draft :] == wrong[: replay[0].n_draft]  # generated tokens as drafts
    assert all(len(step.token_ids) <= limit for s in swarm.sessions for step in s.steps.values())
    if limit == 4:  # 6 prompt ids: one prefill chunk, then 2 committed + 2 drafts, then 1 + 3 ...
        assert len(replay) >= 2


# ---- live: a swarm with liars ------------------------------------------------------------------

# name -> (blocks, corruption: tests/kit/faults.py); N and O lie, A, B and F are honest (F holds every block)
SERVERS = {"N": (0, 3, "noise"), "O": (3, 6, "offset"), "A": (0, 3, None), "B": (3, 6, None), "F": (0, 6, None)}
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def liar_swarm(tiny_llama_path, artifacts_dir):
    log_dir = str(artifacts_dir / "spot-checks")
    swarm = LocalSwarm(str(tiny_llama_path), spans=[], server_args=SERVER_ARGS, log_dir=log_dir)
    with swarm:
        for name, (start, end, corrupt) in SERVERS.items():
            swarm.start_server(
                start, end, name=name, launcher=faulty("--corrupt", corrupt) if corrupt else ["swarm.server"]
            )
        swarm.wait_ready(len(SERVERS))
        yield swarm


@contextlib.contextmanager
def client(swarm, path, *routes, **kwargs):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers, **kwargs)
    try:
        model.swarm.router = PreferredRoutes(*routes)
        model.peers = {name: info.peer_id for name, info in servers_by_name(model, 6).items()}
        yield model
    finally:
        model.shutdown()


def trusted(model) -> dict:
    """The honest servers as ``trusted_peers``: a dispute settled by one of them convicts (a stranger's
    vote settles nothing: tests/test_sybils.py)."""
    return {"trusted_peers": [model.peers[name] for name in ("A", "B", "F")]}


def reference(tiny_reference, new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = tiny_reference.generate(torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def story(stats, peers) -> list[str]:
    """The audits and re-verifications of a generation, servers by name: "lap 1 hop 0 N/A convicted N",
    "lap 9 re-verify 9"."""
    names = {peer: name for name, peer in peers.items()}
    lines = []
    for event in stats.spot_check_events:
        if m := re.match(r"lap (\d+): hop (\d) \S+ (\S+) vs (\S+): (\w+)", event):
            lap, hop, orig, alt, verdict = m.groups()
            liar = re.search(r"; (\S+) is in the minority", event)
            lines.append(
                f"lap {lap} hop {hop} {names.get(orig)}/{names.get(alt)} {verdict}"
                + (f" {names.get(liar.group(1))}" if liar else "")
            )
        elif m := re.match(r"lap (\d+): re-verifying (\d+)", event):
            lines.append(f"lap {m.group(1)} re-verify {m.group(2)}")
    return lines


HONEST = [("A", 0, 3), ("B", 3, 6)]


@pytest.fixture(scope="module")
def noise_run(liar_swarm, tiny_llama_path, tiny_reference):
    """A greedy generation routed through the noise liar (head, blocks 0:3), every verdict audited."""
    with client(liar_swarm, tiny_llama_path, [("N", 0, 3), ("B", 3, 6)], HONEST) as model:
        began = time.monotonic()
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, speculation=None, spot_check_rate=1.0, **trusted(model)
        )
        seconds = time.monotonic() - began
        _run(model.swarm.flush_reports())
        yield model.peers, model.last_generation_stats, out[0, len(PROMPT) :].tolist(), seconds


def _run(coro):
    from client import _loop

    return _loop.run(coro)


def test_noise_liar_is_caught_excluded_and_the_output_is_exact(noise_run, tiny_reference):
    peers, stats, new, seconds = noise_run
    print(
        f"\nnoise liar: {stats.spot_checks} audits, {stats.tokens_retracted} tokens retracted, "
        f"{stats.spot_check_positions} audit positions for {stats.new_tokens} tokens, {seconds:.1f} s: "
        f"{story(stats, peers)}"
    )
    # the route's head is audited first (round robin from hop 0): its first audit, after the
    # first verdict, convicts it. Audits of B (blocks 3:6) on the new route may pick O as B's
    # substitute and convict it too
    assert stats.liars_excluded[0] == peers["N"] and set(stats.liars_excluded) <= {peers["N"], peers["O"]}
    assert story(stats, peers)[0].startswith("lap 1 hop 0 N/") and story(stats, peers)[0].endswith("convicted N")
    assert new == reference(tiny_reference)
    # the generated tokens were re-verified on the new route; those the noise had changed (often all
    # from the second on, sometimes none: a fresh draw each run) were replaced
    reverified = [int(line.split()[-1]) for line in story(stats, peers) if "re-verify" in line]
    # one re-verification per conviction (O, convicted after N, costs a second one)
    assert 1 <= len(reverified) <= len(stats.liars_excluded) and 0 <= stats.tokens_retracted <= sum(reverified)
    assert stats.route[0][0] == peers["A"] and stats.failovers == 0  # left the liar without a failure
    assert stats.spot_checks_failed == 0


def test_dashboard_counts_the_report(noise_run, liar_swarm):
    """The client that caught N stored a signed report; the dashboard's reader, on the live DHT,
    shows N disputed by one client (JSON and Prometheus), and nobody else."""
    from prometheus_client.parser import text_string_to_metric_families

    from protocol.dht import make_dht
    from swarm.dashboard import metrics
    from swarm.dashboard.events import SwarmPolled
    from swarm.dashboard.poller import SwarmReader
    from swarm.dashboard.state import fold
    from swarm.dashboard.views import state_view

    peers = noise_run[0]
    dht = make_dht(initial_peers=liar_swarm.initial_peers, client_mode=True)
    try:
        reader = SwarmReader(dht, known_blocks={liar_swarm.dht_name: 6})
        deadline = time.monotonic() + 60
        while True:
            event = reader.poll()
            assert isinstance(event, SwarmPolled), event
            (snapshot,) = [m for m in event.models if m.name == liar_swarm.dht_name]
            if snapshot.disputes or time.monotonic() > deadline:
                break
            time.sleep(1)
    finally:
        dht.shutdown()
    state = fold([event])
    (model,) = [m for m in state_view(state, time.time(), 5)["models"] if m["name"] == liar_swarm.dht_name]
    disputed = {s["public_name"]: s["disputed_by"] for s in model["servers"]}
    # one client (the noise run's) or more, if later tests' clients caught N too
    assert disputed["N"] >= 1 and disputed["A"] == disputed["B"] == disputed["F"] == 0, disputed
    text = metrics.render(metrics.make_registry(lambda: state)).decode()
    samples = {
        s.labels["public_name"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "specswarm_server_disputed_by_clients"
        for s in f.samples
    }
    assert samples["N"] == disputed["N"] and samples["A"] == 0.0
    assert peers["N"] in snapshot.disputes


def test_offset_liar_at_the_tail_is_caught_and_streaming_retracts(liar_swarm, tiny_llama_path, tiny_reference):
    """The tail lies (a constant offset on its final hidden states). Streamed through
    agenerate_stream: applying each chunk's ``retracted`` gives exactly the honest tokens."""
    with client(liar_swarm, tiny_llama_path, [("A", 0, 3), ("O", 3, 6)], HONEST) as model:

        async def stream():
            have, chunks = [], []
            async for chunk in model.agenerate_stream(
                PROMPT, max_new_tokens=48, speculation="suffix", spot_check_rate=1.0, **trusted(model)
            ):
                have = have[: len(have) - chunk.retracted] + chunk.token_ids
                chunks.append(chunk)
            return have, chunks[-1].stats

        have, stats = _run(stream())
        print(
            f"\noffset liar: {stats.spot_checks} audits, {stats.tokens_retracted} retracted: "
            f"{story(stats, model.peers)}"
        )
        assert model.peers["O"] in stats.liars_excluded
        assert set(stats.liars_excluded) <= {model.peers["O"], model.peers["N"]}  # N can be A's substitute: caught too
        assert len([e for e in stats.spot_check_events if ": hop " in e]) >= 1
        assert have == reference(tiny_reference, 48)  # long enough for two audits: hop 0's, then O's
        assert stats.tokens_retracted > 0


def test_seeded_sampling_through_a_liar_equals_an_honest_run(liar_swarm, tiny_llama_path):
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=7, max_new_tokens=24, speculation="suffix")
    with client(liar_swarm, tiny_llama_path, HONEST) as honest:
        expected = honest.generate(torch.tensor([PROMPT]), spot_check_rate=0, **sampling)[0].tolist()
        assert honest.last_generation_stats.spot_checks == 0
    with client(liar_swarm, tiny_llama_path, [("N", 0, 3), ("B", 3, 6)], HONEST) as model:
        out = model.generate(torch.tensor([PROMPT]), spot_check_rate=1.0, **sampling, **trusted(model))[0].tolist()
        stats = model.last_generation_stats
        assert stats.liars_excluded[0] == model.peers["N"]
        assert out == expected


def test_honest_servers_raise_no_false_alarm(liar_swarm, tiny_llama_path, tiny_reference):
    """Every verdict audited over honest servers only (the liars kept out of this client's view):
    audits agree, nobody is excluded, and the cost is what the stats say."""
    from client._swarm import ExclusionList

    with client(liar_swarm, tiny_llama_path, HONEST) as model:
        model.swarm.excluded = ExclusionList(base_seconds=3600)
        for liar in ("N", "O"):
            model.swarm.excluded.add(model.peers[liar])
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, speculation="suffix", spot_check_rate=1.0
        )
        stats = model.last_generation_stats
        print(
            f"\nhonest: {stats.spot_checks} audits over {stats.laps} laps, {stats.spot_check_positions} audit "
            "positions "
            f"for {stats.new_tokens} tokens: {story(stats, model.peers)}"
        )
        assert out[0, len(PROMPT) :].tolist() == reference(tiny_reference)
        assert stats.spot_checks >= 1 and stats.liars_excluded == [] and stats.tokens_retracted == 0
        assert stats.spot_checks_undecided == 0 and stats.spot_checks_failed == 0
        assert all(e.endswith(")") and ": agree (" in e for e in stats.spot_check_events)
        assert stats.spot_check_positions > 0
        with pytest.raises(ValueError, match="spot_check_rate"):
            model.generate(torch.tensor([PROMPT]), max_new_tokens=2, spot_check_rate=2.0)


def test_page_shows_disputed_servers(artifacts_dir):
    """The real app and page, fed a poll with reports (no swarm needed): a badge on the disputed
    server's state, none elsewhere, reports about peers the model does not list dropped, and the
    servers table still fits a 1280-pixel window."""
    import asyncio

    from aiohttp import web

    from swarm.dashboard.app import Dashboard, create_app
    from swarm.dashboard.events import ModelSnapshot, SwarmPolled
    from tests.kit.browser import Chromium, Page, find_or_install_chromium

    binary, why = find_or_install_chromium()
    if binary is None:
        pytest.skip(f"Debian's chromium is not installed and could not be installed: {why}")
    servers = tuple(
        ServerInfo(peer_id=p, model="m", start_block=a, end_block=b, public_name=p)
        for p, a, b in [("liar", 0, 3), ("honest", 0, 3), ("tail", 3, 6)]
    )
    (artifacts_dir / "spot-checks").mkdir(exist_ok=True)
    dashboard = Dashboard(reader=None)
    dashboard.feed(SwarmPolled(time.time(), (ModelSnapshot("m", 6, servers, disputes={"liar": 3, "stranger": 9}),)))
    assert dict(dashboard.state.models["m"].disputes) == {"liar": 3}

    facts_js = """(() => ({
      badges: Object.fromEntries([...document.querySelectorAll("table.servers tbody tr")].map(
        (r) => [r.dataset.peer, r.querySelector(".dispute") ? r.querySelector(".dispute").textContent : null])),
      overflow: Math.max(0, ...[...document.querySelectorAll("table.servers")].map(
        (t) => t.parentElement.scrollWidth - t.parentElement.clientWidth)),
    }))()"""

    async def visit():
        runner = web.AppRunner(create_app(dashboard))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        with Chromium(binary, artifacts_dir / "spot-checks" / "chromium.log") as chromium:
            page = await Page.open(chromium)
            try:
                await page.navigate(f"http://127.0.0.1:{runner.addresses[0][1]}/")
                await page.wait_for("document.querySelectorAll('table.servers tbody tr').length === 3")
                await page.call(
                    "Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False
                )
                await asyncio.sleep(0.5)
                return await page.evaluate(facts_js), list(page.errors)
            finally:
                await page.close()
                await runner.cleanup()

    facts, errors = asyncio.run(visit())
    assert errors == [], f"the page logged errors: {errors}"
    assert facts["badges"] == {"liar": "disputed by 3", "honest": None, "tail": None}
    assert facts["overflow"] <= 0, "at 1280 px the servers table is cut off"


def test_a_spot_check_replays_the_last_live_lap_its_rejected_drafts_too():
    """``SpotChecker._replayed``: the spot-check's sessions verify the committed ids before the last live lap
    recorded inside them, then that lap's own drafts (a rejected one too), cut to the Step's room, so both
    tails accept as many as the live tail did; with no lap recorded, a live lap's count of committed ids."""
    import random

    from client._audit_shape import LiveShape

    checker = SpotChecker.__new__(SpotChecker)  # only the live shape and the draw are read
    checker.live, checker.rng = LiveShape(8), random.Random(0)
    ids = list(range(100, 130))
    assert checker._replayed(ids, 7) == (ids, 7)  # nothing recorded: num_draft_tokens committed ids, at most the room
    checker.live.saw_lap(11, [111, 112, 999])  # two accepted, the third a wrong guess; the bonus at 13
    checker.live.saw_lap(14, [114, 998])
    assert checker._replayed(ids, 7) == ([*ids[:14], 114, 998], 2)
    assert checker._replayed(ids, 1) == ([*ids[:14], 114], 1)
    assert checker._replayed(ids[:14], 7) == ([*ids[:11], 111, 112, 999], 3)  # the last lap inside the ids


# ---- live: a hop honest only where it sees an audit ------------------------------------------------

# L lies in its activations in every session but those that repeat an open session's first ids (to a hop,
# an audit: tests/kit/hop_faults.py ``lie_unless_repeated``); A, B and C are honest
TWO_FACED = {"L": (0, 3), "A": (0, 3), "B": (3, 6), "C": (3, 6)}


@pytest.fixture(scope="module")
def two_faced_swarm(tiny_llama_path, artifacts_dir):
    log_dir = str(artifacts_dir / "two-faced")
    swarm = LocalSwarm(str(tiny_llama_path), spans=[], server_args=SERVER_ARGS, log_dir=log_dir)
    with swarm:
        for name, (start, end) in TWO_FACED.items():
            launcher = faulty("--lie-unless-repeated", "offset") if name == "L" else ["swarm.server"]
            swarm.start_server(start, end, name=name, launcher=launcher)
        swarm.wait_ready(len(TWO_FACED))
        yield swarm


@pytest.mark.parametrize("sampling,audit_every", [("greedy", 0), ("seeded", 0), ("greedy", 16)])
def test_a_hop_honest_only_in_audits_diverges_from_the_live_lap_and_is_avoided(
    two_faced_swarm, tiny_llama_path, sampling, audit_every
):
    """The live route's head L lies in the live session alone, so the spot-check's two sessions (through L,
    a repeat of the live prompt to it, and through A) agree with each other: compared only with each other,
    every spot-check agreed and the wrong output was returned. Compared with the live lap they replay, they
    contradict what it committed (its tokens or log-probs): the route's servers are avoided (nobody convicted:
    the comparison names no hop), the generation re-verifies on a route without L, and its output equals an
    honest run's. With verdict audits on too (``audit_every`` 16), a shadow through L and C sees the honest
    head: nobody is convicted either way."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, speculation="suffix")
    if sampling == "seeded":
        kwargs.update(do_sample=True, temperature=0.8, top_p=0.9, seed=7)
    with client(two_faced_swarm, tiny_llama_path, [("A", 0, 3), ("B", 3, 6)], verdict_audit_every=0) as honest:
        expected = honest.generate(torch.tensor([PROMPT]), spot_check_rate=0, **kwargs)[0, len(PROMPT) :].tolist()
    routes = [("L", 0, 3), ("B", 3, 6)], [("A", 0, 3), ("B", 3, 6)], [("A", 0, 3), ("C", 3, 6)]
    with client(two_faced_swarm, tiny_llama_path, *routes, verdict_audit_every=audit_every) as model:
        if not audit_every:  # L's lie changes the tokens (else this test shows nothing)
            lied = model.generate(torch.tensor([PROMPT]), spot_check_rate=0, **kwargs)[0, len(PROMPT) :].tolist()
            assert lied != expected
        out = model.generate(torch.tensor([PROMPT]), spot_check_rate=1.0, **kwargs)[0, len(PROMPT) :].tolist()
        stats = model.last_generation_stats
        print(f"\ntwo-faced head: {stats.spot_check_events}")
        assert out == expected
        assert stats.spot_checks_diverged >= 1 and any(": diverged (" in e for e in stats.spot_check_events)
        assert model.peers["L"] in stats.disputed_peers and stats.liars_excluded == []
        assert stats.route[0][0] == model.peers["A"]


def test_a_replay_contradicts_the_live_lap_by_token_or_log_prob_not_at_a_near_tie():
    """``live_contradiction``: the replayed verdict's claims against the committed ids and the live log-probs."""
    from client._live_agreement import live_contradiction, suspects
    from protocol.messages import StepResult, TokenLogprobs

    def entry(token, logprob, top=()):
        return TokenLogprobs(token, logprob, [token, *(t for t, _ in top)], [logprob, *(v for _, v in top)])

    committed = [1, 2, 3, 10, 11, 12]  # prompt of 3, then 10 11 12 generated
    live = [entry(10, -1.0), entry(11, -2.0), entry(12, -0.5)]
    replayed = [1, 2, 3, 10, 11]  # the last lap: drafts 10 11 from position 3

    def verdict(accepted, next_token, entries):
        return StepResult(session_id="s", run_id=0, accepted=accepted, next_token=next_token, logprobs=entries)

    agree = verdict(2, 12, [entry(10, -1.0), entry(11, -2.0), entry(12, -0.5)])
    assert live_contradiction(committed, replayed, 2, agree, live, 3, 1e-3) is None
    other = verdict(1, 13, [entry(10, -1.0), entry(13, -1.5)])
    assert "committed 11, the replays 13" in live_contradiction(committed, replayed, 2, other, live, 3, 1e-3)
    tie = verdict(1, 13, [entry(10, -1.0), entry(13, -1.5, [(11, -1.5005)])])  # 11 within the bound of 13
    assert live_contradiction(committed, replayed, 2, tie, live, 3, 1e-3) is None
    shifted = verdict(2, 12, [entry(10, -1.0), entry(11, -2.1), entry(12, -0.5)])
    assert "log-prob -2 of token 11 live, -2.1 in the replays" in live_contradiction(
        committed, replayed, 2, shifted, live, 3, 1e-3
    )
    assert live_contradiction(committed, replayed, 2, shifted, live[:2], 3, 1e-3) is None  # unpaired: not compared
    assert "accepted 3 of 2" in live_contradiction(committed, replayed, 2, verdict(3, 12, []), live, 3, 1e-3)
    beyond = verdict(2, 99, [entry(10, -1.0), entry(11, -2.0), entry(99, -0.1)])  # the bonus past what was committed
    assert live_contradiction(committed[:5], replayed, 2, beyond, live[:2], 3, 1e-3) is None
    # with no live lap recorded (a tree lap), the last committed ids go as drafts and may reach into the
    # prompt: the honest replay rejects a prompt id there (the model would not have said it), no contradiction
    into_prompt = verdict(0, 77, [entry(77, -0.3)])  # drafts 3 10 from position 2: 3 rejected, 77 said there
    assert live_contradiction(committed[:4], [1, 2, 3, 10], 2, into_prompt, live[:1], 3, 1e-3) is None
    entries = [entry(3, -0.2), entry(10, -1.5), entry(11, -2.0)]  # the prompt id accepted; 10's log-prob differs
    assert "position 3: log-prob -1 of token 10 live" in live_contradiction(
        committed[:4], [1, 2, 3, 10], 2, verdict(2, 11, entries), live[:1], 3, 1e-3
    )
    route = [Hop("h", 0, 3), Hop("m", 3, 4), Hop("t", 4, 6)]
    assert suspects(route, lambda p: p == "m") == ("h", "t")
