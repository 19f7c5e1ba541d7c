"""The health dashboard: its pure fold from events, its JSON API and metrics against a real local
swarm of two models (one fully covered, one with a gap), and its page in real headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from protocol.records import ServerInfo, ServerState
from swarm import lifeline, warm_start
from swarm.dashboard.events import ModelSnapshot, PeerProbed, PollFailed, SwarmPolled
from swarm.dashboard.state import Limits, State, apply, fold
from swarm.dashboard.views import Paging, state_view
from swarm.local import free_port
from tests.kit.browser import Chromium, Page, find_or_install_chromium
from tests.kit.checkpoints import build_tiny_llama
from tests.kit.swarms import TINY_SERVERS
from tests.kit.waiting import wait_until

LIMITS = Limits(forget_after=30, history_interval=10, history_points=5, max_errors=3, max_uptime_records=4)


def server(peer: str, start: int, end: int, model: str = "m", **fields: Any) -> ServerInfo:
    return ServerInfo(peer_id=peer, model=model, start_block=start, end_block=end, **fields)


def polled(at: float, *models: tuple[str, int, list[ServerInfo]]) -> SwarmPolled:
    return SwarmPolled(at, tuple(ModelSnapshot(name, n, tuple(servers)) for name, n, servers in models))


# ---- the pure fold ----------------------------------------------------------------------------


def test_covered_model_is_healthy_and_gap_model_broken():
    a, b = server("A", 0, 3, throughput=10), server("B", 2, 6, throughput=4)
    gap = server("G", 0, 2, model="g", throughput=7)
    state = fold([polled(100, ("m", 6, [a, b]), ("g", 6, [gap]))], State(LIMITS))
    m, g = state.models["m"], state.models["g"]
    assert m.healthy and not g.healthy
    assert [c.servers for c in m.coverage] == [1, 1, 2, 1, 1, 1]
    assert [c.throughput for c in m.coverage] == [10, 10, 14, 4, 4, 4]
    assert m.max_flow == pytest.approx(4.0)  # B alone carries blocks 3..5
    assert g.missing_blocks == [2, 3, 4, 5] and g.max_flow == 0
    assert m.history[-1].coverage == 1.0 and g.history[-1].coverage == pytest.approx(2 / 6)


def test_fold_does_not_touch_the_old_state():
    before = fold([polled(100, ("m", 2, [server("A", 0, 2)]))], State(LIMITS))
    after = apply(before, polled(110, ("m", 2, [])))
    assert before.models["m"].servers["A"].state == ServerState.ONLINE
    assert after.models["m"].servers["A"].state == ServerState.OFFLINE


def test_stopped_server_shows_offline_then_is_forgotten():
    a, b = server("A", 0, 2), server("B", 0, 2)
    events = [polled(100, ("m", 2, [a, b])), polled(105, ("m", 2, [a, server("B", 0, 2, state=ServerState.OFFLINE)]))]
    state = fold(events, State(LIMITS))
    assert state.models["m"].servers["B"].state == ServerState.OFFLINE  # it said so itself
    state = apply(state, polled(120, ("m", 2, [a])))  # its record expired: still listed, offline
    assert state.models["m"].servers["B"].state == ServerState.OFFLINE
    assert state.models["m"].healthy
    state = apply(state, polled(105 + LIMITS.forget_after + 1, ("m", 2, [a])))
    assert list(state.models["m"].servers) == ["A"]
    assert state.uptime["B"].online_polls == 1 and state.uptime["B"].polls == 3


def test_unlisted_model_goes_broken_then_away():
    state = fold([polled(100, ("m", 2, [server("A", 0, 2)])), polled(110)], State(LIMITS))
    assert not state.models["m"].healthy and state.models["m"].num_blocks == 2
    assert state.models["m"].servers["A"].state == ServerState.OFFLINE
    state = apply(state, polled(100 + LIMITS.forget_after + 1))
    assert state.models == {}


def test_history_keeps_one_point_per_interval_and_is_bounded():
    a = server("A", 0, 2, throughput=5)
    events = [polled(100 + 3 * i, ("m", 2, [a] if i % 4 else [])) for i in range(40)]
    state = fold(events, State(LIMITS))
    history = state.models["m"].history
    assert len(history) == LIMITS.history_points
    assert [p.at for p in history] == sorted({p.at for p in history})
    assert all(p.at % LIMITS.history_interval == 0 for p in history)
    assert history[-1].servers == 1 and history[-1].throughput == 5  # the last poll of its interval
    timeline = state.uptime["A"].timeline
    assert len(timeline) == LIMITS.history_points
    assert ServerState.OFFLINE in {s for _, s in timeline}  # the worst state of an interval shows


def test_uptime_records_are_bounded():
    events = [polled(100 + i, ("m", 2, [server(f"P{i}", 0, 2)])) for i in range(10)]
    state = fold(events, State(Limits(forget_after=0, max_uptime_records=4)))
    assert sorted(state.uptime) == ["P6", "P7", "P8", "P9"]


def test_poll_failure_keeps_the_last_state_and_shows_an_error():
    state = fold([polled(100, ("m", 2, [server("A", 0, 2)])), PollFailed(105, "DHT timed out")], State(LIMITS))
    view = state_view(state, now=106, refresh_seconds=5)
    assert view["error"] == "DHT timed out" and view["updated_at"] == 100
    assert view["models"][0]["healthy"]
    assert apply(state, polled(110, ("m", 2, []))).poll_error is None


def test_reachability_errors_are_deduplicated_and_bounded():
    state = fold([polled(100, ("m", 2, [server(p, 0, 2) for p in "ABCD"]))], State(LIMITS))
    events = [PeerProbed(101, "m", "A", 0.01)]
    events += [PeerProbed(102 + i, "m", "B", None, "connection refused") for i in range(3)]
    events += [PeerProbed(110, "m", peer, None, "timeout") for peer in "CD"]
    state = fold(events, state)
    assert state.models["m"].servers["A"].rtt == 0.01
    assert state.models["m"].servers["B"].probe_error == "connection refused"
    assert [(e.peer_id, e.count) for e in state.errors] == [("B", 3), ("C", 1), ("D", 1)]
    state = apply(state, PeerProbed(111, "m", "A", None, "timeout"))
    assert [e.peer_id for e in state.errors] == ["C", "D", "A"]  # bounded: the oldest goes


def test_views_speculation_and_contributors():
    tail = server("T", 2, 4, public_name="ann", laps_served=10, accepted_tokens=35, cancelled_runs=2, throughput=3)
    head = server("H", 0, 2, public_name="bob", throughput=9)
    other = server("O", 0, 4, public_name="ann", throughput=1)
    view = state_view(fold([polled(100, ("m", 4, [tail, head, other]))], State(LIMITS)), now=160, refresh_seconds=5)
    spec = view["models"][0]["speculation"]
    assert (spec["tail_servers"], spec["laps_served"], spec["tokens_per_lap"], spec["cancelled_runs"]) == (
        2,
        10,
        3.5,
        2,
    )
    assert [(r["public_name"], r["servers"], r["blocks"]) for r in view["top_contributors"]] == [
        ("ann", 2, 6),
        ("bob", 1, 2),
    ]
    json.dumps(view)  # plain JSON types only


def test_paged_view_carries_one_page_of_servers_in_block_order_and_bad_pages_are_refused():
    servers = [server(f"P{i:03d}", i % 7, i % 7 + 2, public_name=f"n{i}") for i in range(250)]
    state = fold([polled(100, ("m", 9, servers))], State(LIMITS))
    pages = [state_view(state, now=160, refresh_seconds=5, paging=Paging(p, 100)) for p in (1, 2, 3, 4)]
    rows = [[s["peer_id"] for s in view["models"][0]["servers"]] for view in pages]
    assert [len(r) for r in rows] == [100, 100, 50, 50]  # past the last page: the last page
    assert [view["models"][0]["servers_page"]["page"] for view in pages] == [1, 2, 3, 3]
    assert pages[0]["models"][0]["servers_page"] == {"page": 1, "per_page": 100, "pages": 3, "total": 250}
    everyone = rows[0] + rows[1] + rows[2]
    by_peer = {s.peer_id: s for s in servers}
    assert sorted(everyone) == sorted(by_peer)  # every server on exactly one page
    assert everyone == sorted(everyone, key=lambda p: (by_peer[p].start_block, p))
    assert len(pages[0]["top_contributors"]) == 25 and pages[0]["contributors_total"] == 250
    full = state_view(state, now=160, refresh_seconds=5)  # no paging: every row, as before
    assert len(full["models"][0]["servers"]) == 250 and "servers_page" not in full["models"][0]
    assert len(full["top_contributors"]) == 250
    for page, per_page in ((0, 100), (1, 0), (1, 5000)):
        with pytest.raises(ValueError, match="page"):
            Paging(page, per_page)


def test_unknown_event_is_a_type_error():
    with pytest.raises(TypeError, match="not a dashboard event"):
        apply(State(), "hello")  # type: ignore[arg-type]


def test_bad_command_line_is_a_clear_error():
    done = subprocess.run(
        [sys.executable, "-m", "swarm.dashboard", "--initial-peers", "localhost:31337"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--initial-peers takes multiaddrs" in done.stderr and "Traceback" not in done.stderr


def test_initial_peers_come_from_the_environment_or_a_clear_error(tmp_path):
    """Like a server, the dashboard takes $SPECSWARM_INITIAL_PEERS (or the config file) when the
    flag is left out, and says where else to put them when none is set anywhere."""
    import os

    from protocol.config import ENV_INITIAL_PEERS

    env = {k: v for k, v in os.environ.items() if k != ENV_INITIAL_PEERS}
    env["XDG_CONFIG_HOME"], env["HOME"] = str(tmp_path), str(tmp_path)  # no config file either
    done = subprocess.run(
        [sys.executable, "-m", "swarm.dashboard"], capture_output=True, text=True, timeout=60, env=env
    )
    assert (
        done.returncode == 2 and "no initial peers to watch a swarm" in done.stderr and ENV_INITIAL_PEERS in done.stderr
    )
    env[ENV_INITIAL_PEERS] = "localhost:31337"
    done = subprocess.run(
        [sys.executable, "-m", "swarm.dashboard"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2 and f"{ENV_INITIAL_PEERS}: 'localhost:31337' is not a multiaddr" in done.stderr


# ---- against a real swarm ---------------------------------------------------------------------

GAP_MODEL = "tiny-llama-gap"
DASHBOARD_ARGS = [
    "--refresh-seconds",
    "1",
    "--probe-seconds",
    "2",
    "--probe-timeout",
    "3",
    "--forget-after",
    "6",
    "--history-interval",
    "2",
    "--log-level",
    "INFO",
]


def _popen(args: list[str], log: Path, stdout=None) -> warm_start.Started:
    """``python -m args...`` in its own session, forked from the warm forkserver (swarm/warm_start.py:
    no 5-10 s of torch and transformers imports per server); stderr to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as stderr:
        return warm_start.start(args[0], args[1:], env=lifeline.child_env(), stdout=stdout, stderr=stderr)


def _stop(process: warm_start.Started) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _start_gap_server(path: Path, swarm, blocks: str, name: str, log_dir: Path) -> warm_start.Started:
    args = [
        "swarm.server",
        "--model",
        str(path),
        "--blocks",
        blocks,
        "--initial-peers",
        *swarm.initial_peers,
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--public-name",
        name,
        "--update-period",
        "2",
        "--torch-threads",
        "1",
        "--log-level",
        "INFO",
        "--dht-prefix",
        GAP_MODEL,
    ]
    return _popen(args, log_dir / f"{name}.log")  # named by --dht-prefix (a folder's own name carries a hash)


@pytest.fixture(scope="module")
def dashboard(tiny_swarm, tmp_path_factory, artifacts_dir):
    """The tiny swarm (fully covered), one server of a second model holding blocks 0:2 of 6
    (a gap), and a dashboard over both; yields ``(url, gap checkpoint path, swarm)``."""
    log_dir = artifacts_dir / "dashboard"
    gap_path = build_tiny_llama(tmp_path_factory.mktemp("gap") / GAP_MODEL, seed=1)
    gap_server = _start_gap_server(gap_path, tiny_swarm, "0:2", "gap-head", log_dir)
    process = _popen(
        [
            "swarm.dashboard",
            "--initial-peers",
            *tiny_swarm.initial_peers,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *DASHBOARD_ARGS,
        ],
        log_dir / "dashboard.log",
        subprocess.PIPE,
    )
    try:
        line = process.stdout.readline().decode().strip()
        assert line.startswith("Dashboard: http://127.0.0.1:"), f"dashboard did not start: {line!r}"
        url = line.removeprefix("Dashboard: ")
        wait_until(
            lambda: _online(url, tiny_swarm.dht_name) == 5 and _online(url, GAP_MODEL) == 1, "both models online"
        )
        yield url, gap_path, tiny_swarm
    finally:
        _stop(process)
        _stop(gap_server)


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _model(url: str, name: str) -> dict | None:
    status, body = get_json(f"{url}api/v1/models/{name}")
    return body if status == 200 else None


def _online(url: str, name: str) -> int:
    model = _model(url, name)
    return model["servers_online"] if model else 0


def test_api_reports_covered_and_gap_models(dashboard):
    url, _, swarm = dashboard
    status, state = get_json(f"{url}api/v1/state")
    assert status == 200 and state["api_version"] == 1 and state["error"] is None
    models = {m["name"]: m for m in state["models"]}
    tiny, gap = models[swarm.dht_name], models[GAP_MODEL]
    assert tiny["healthy"] and tiny["num_blocks"] == 6 and tiny["missing_blocks"] == []
    expected = [sum(a <= block < b for a, b in TINY_SERVERS.values()) for block in range(6)]
    assert [b["servers"] for b in tiny["blocks"]] == expected == [2, 2, 3, 3, 2, 2]
    assert tiny["max_flow"] > 0
    assert {s["public_name"] for s in tiny["servers"]} == set("ABCDE")
    assert all(s["state"] == "online" and s["uptime_seconds"] >= 0 for s in tiny["servers"])
    assert {s["public_name"] for s in tiny["servers"] if s["is_tail"]} == {"B", "E"}
    assert not gap["healthy"] and gap["missing_blocks"] == [2, 3, 4, 5] and gap["max_flow"] == 0
    assert [b["servers"] for b in gap["blocks"]] == [1, 1, 0, 0, 0, 0]
    (head,) = gap["servers"]
    assert (head["public_name"], head["start_block"], head["end_block"], head["dtype"]) == ("gap-head", 0, 2, "float32")
    names = {row["public_name"] for row in state["top_contributors"]}
    assert names == set("ABCDE") | {"gap-head"}
    # the dashboard dials every server: all answer on loopback
    wait_until(lambda: all(s["rtt"] is not None for s in _model(url, swarm.dht_name)["servers"]), "probe RTTs")


def test_api_unknown_model_is_a_clear_404(dashboard):
    url, _, _ = dashboard
    status, body = get_json(f"{url}api/v1/models/no-such-model")
    assert status == 404 and "no model named 'no-such-model'" in body["error"]


def test_api_pages_server_rows_and_refuses_bad_pages_clearly(dashboard):
    url, _, swarm = dashboard
    status, state = get_json(f"{url}api/v1/state?page=2&per_page=2")
    tiny = next(m for m in state["models"] if m["name"] == swarm.dht_name)
    assert status == 200 and len(tiny["servers"]) == 2
    assert tiny["servers_page"] == {"page": 2, "per_page": 2, "pages": 3, "total": 5}
    for query, words in (
        ("page=two", "whole numbers"),
        ("page=0", "page must be"),
        ("per_page=100000", "per_page must be"),
    ):
        status, body = get_json(f"{url}api/v1/state?{query}")
        assert status == 400 and words in body["error"], (query, body)


def test_metrics_parse_with_prometheus_parser(dashboard):
    url, _, swarm = dashboard
    with urllib.request.urlopen(f"{url}metrics", timeout=10) as response:
        text = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    healthy = {s.labels["model"]: s.value for s in families["specswarm_model_healthy"].samples}
    assert healthy[swarm.dht_name] == 1.0 and healthy[GAP_MODEL] == 0.0
    blocks = {(s.labels["model"], s.labels["block"]): s.value for s in families["specswarm_block_servers"].samples}
    assert blocks[(GAP_MODEL, "0")] == 1.0 and blocks[(GAP_MODEL, "5")] == 0.0
    flows = {s.labels["model"]: s.value for s in families["specswarm_model_max_flow_tokens_per_second"].samples}
    assert flows[swarm.dht_name] > 0 and flows[GAP_MODEL] == 0
    assert "specswarm_server_laps_served" in families  # counters keep their family name


def test_stopped_server_appears_offline_then_disappears(dashboard, artifacts_dir):
    url, gap_path, swarm = dashboard
    leaver = _start_gap_server(gap_path, swarm, "3:4", "leaver", artifacts_dir / "dashboard")
    try:
        peer = wait_until(lambda: _alive(leaver) and _peer_named(url, "leaver", "online"), "the new server online")
        _stop(leaver)  # SIGTERM: it announces itself offline and leaves
        wait_until(lambda: _peer_named(url, "leaver", "offline") == peer, "the stopped server shown offline")
        wait_until(lambda: _peer_named(url, "leaver", None) is None, "the stopped server gone")
    finally:
        _stop(leaver)
    assert _online(url, GAP_MODEL) == 1  # the other server of that model is untouched


def test_speculation_figures_come_from_tail_servers(dashboard, tiny_model):
    url, _, swarm = dashboard
    prompt = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]])
    tiny_model.generate(prompt, max_new_tokens=12, speculation="suffix")
    laps = tiny_model.last_generation_stats.laps
    spec = wait_until(lambda: _speculation(url, swarm.dht_name, laps), "the tails to report their laps")
    assert spec["tail_servers"] == 2 and spec["accepted_tokens"] >= spec["laps_served"]  # >= 1 token per lap
    assert spec["tokens_per_lap"] == pytest.approx(spec["accepted_tokens"] / spec["laps_served"])


def _speculation(url: str, model: str, laps: int) -> dict | None:
    spec = _model(url, model)["speculation"]
    return spec if spec["laps_served"] >= laps > 0 else None


def _alive(process: subprocess.Popen) -> bool:
    assert process.poll() is None, f"the server exited with code {process.returncode} (see its log)"
    return True


def _peer_named(url: str, name: str, state: str | None) -> str | None:
    """Peer id of the server called ``name`` (in ``state``, or in any state if None)."""
    model = _model(url, GAP_MODEL) or {"servers": []}
    for s in model["servers"]:
        if s["public_name"] == name and (state is None or s["state"] == state):
            return s["peer_id"]
    return None


# ---- the page in a real browser ---------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(artifacts_dir):
    binary, why = find_or_install_chromium()
    if binary is None:
        pytest.skip(f"Debian's chromium is not installed and could not be installed: {why}")
    with Chromium(binary, artifacts_dir / "dashboard" / "chromium.log") as chromium:
        yield chromium


PAGE_FACTS = """(() => {
  const models = {};
  for (const card of document.querySelectorAll("section.model")) {
    models[card.dataset.model] = {
      healthy: card.dataset.healthy === "true",
      blocks: [...card.querySelectorAll(".block")].map((b) => Number(b.dataset.servers)),
      peers: [...card.querySelectorAll("table.servers tbody tr")].map((r) => r.dataset.peer).sort(),
      names: [...card.querySelectorAll('td[data-col="name"]')].map((td) => td.textContent).sort(),
      badge: card.querySelector(".badge").textContent,
      charts: card.querySelectorAll(".chart svg").length,
    };
  }
  const tables = [...document.querySelectorAll("table.servers")]
    .map((t) => t.parentElement.scrollWidth - t.parentElement.clientWidth);
  return {models, banner: !document.getElementById("banner").hidden,
          overflow: document.documentElement.scrollWidth - window.innerWidth, tableOverflow: Math.max(0, ...tables)};
})()"""


def test_page_in_headless_chromium(dashboard, browser, artifacts_dir):
    url, _, swarm = dashboard
    wait_until(lambda: len(_model(url, swarm.dht_name)["history"]) >= 2, "two history points")
    facts, errors = asyncio.run(_visit(browser, url, artifacts_dir))
    assert errors == [], f"the page logged errors: {errors}"
    _, state = get_json(f"{url}api/v1/state")
    for model in state["models"]:
        shown = facts["models"][model["name"]]
        assert shown["blocks"] == [b["servers"] for b in model["blocks"]]
        assert shown["peers"] == sorted(s["peer_id"] for s in model["servers"])
        assert shown["names"] == sorted(s["public_name"] for s in model["servers"])
        assert shown["healthy"] == model["healthy"] and shown["charts"] == 3
    assert facts["models"][swarm.dht_name]["badge"] == "healthy"
    assert facts["models"][GAP_MODEL]["badge"] == "broken"
    assert not facts["banner"]
    assert facts["tableOverflow"] <= 0, "at 1280 px a servers table is cut off (it scrolls sideways)"
    assert facts["phone_overflow"] <= 0, "the page scrolls sideways on a phone"
    assert (artifacts_dir / "dashboard.png").stat().st_size > 10_000


async def _visit(browser: Chromium, url: str, artifacts_dir: Path) -> tuple[dict, list[str]]:
    page = await Page.open(browser)
    try:
        await page.navigate(url)
        await page.wait_for(
            "document.querySelectorAll('section.model').length >= 2 && "
            "document.querySelectorAll('table.servers tbody tr').length >= 6"
        )
        await page.call("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
        await asyncio.sleep(0.5)
        facts = await page.evaluate(PAGE_FACTS)
        await page.screenshot(artifacts_dir / "dashboard.png")
        await page.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=2, mobile=True)
        await asyncio.sleep(0.5)
        facts["phone_overflow"] = (await page.evaluate(PAGE_FACTS))["overflow"]
        await page.screenshot(artifacts_dir / "dashboard-phone.png", full_page=False)
        return facts, list(page.errors)
    finally:
        await page.close()


def test_page_shows_a_dht_failure_as_a_banner_and_names_as_text(browser):
    """The real app and page, fed the events a failing DHT read produces (no swarm needed)."""
    from aiohttp import web

    from swarm.dashboard.app import Dashboard, create_app

    hostile = "<img src=x onerror=alert(1)>"
    dashboard = Dashboard(reader=None)
    for event in (
        polled(time.time(), ("m", 2, [server("A", 0, 2, public_name=hostile, adapters=["tiny-lora", hostile])])),
        PollFailed(time.time(), "DHT timed out after 30 s"),
    ):
        dashboard.feed(event)

    async def visit() -> tuple[dict, list[str]]:
        runner = web.AppRunner(create_app(dashboard))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        page = await Page.open(browser)
        try:
            await page.navigate(f"http://127.0.0.1:{runner.addresses[0][1]}/")
            await page.wait_for("document.querySelector('section.model') !== null")
            facts = await page.evaluate(PAGE_FACTS)
            facts["banner_text"] = await page.evaluate("document.getElementById('banner').textContent")
            facts["images"] = await page.evaluate("document.querySelectorAll('img').length")
            facts["adapters"] = await page.evaluate(
                "document.querySelector('td[data-col=\"dtype\"] .adapters').textContent"
            )
            return facts, list(page.errors)
        finally:
            await page.close()
            await runner.cleanup()

    facts, errors = asyncio.run(visit())
    assert errors == [], f"the page logged errors: {errors}"
    assert facts["banner"] and "DHT timed out after 30 s" in facts["banner_text"]
    assert facts["models"]["m"]["names"] == [hostile] and facts["images"] == 0
    assert facts["adapters"] == f"LoRA: tiny-lora, {hostile}"  # the server's LoRA adapters, listed as text
