"""What a volunteer meets: the memory plan on real model shapes, ``--plan-only`` offline, blocks
that do not fit refused before anything is announced, and moves that never leave a server broken.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from protocol.models import shipped_config_dir
from server.memory import GiB, plan_blocks
from server.quantization import Quant
from swarm import warm_start

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def v4_pro_config():
    return AutoConfig.from_pretrained(shipped_config_dir("deepseek-v4-pro"))


@pytest.mark.parametrize("free_gib, at_least", [(22, 1), (44, 3), (76, 5)], ids=["24GB", "48GB", "80GB"])
def test_v4_pro_nf4_plan_on_consumer_and_datacenter_cards(v4_pro_config, free_gib, at_least):
    """The published V4-Pro shapes on the meta device: a 24 GB card (22 GiB free) holds one nf4
    block with no flag besides --model, a 48 GB card three, an 80 GB card five. Only a span at an
    end holds the embeddings or the LM head (1.73 GiB each), so those may take fewer."""
    plan = plan_blocks(v4_pro_config, torch.bfloat16, "cuda", 61, free_bytes=free_gib * GiB, quant=Quant.NF4)
    assert plan.blocks >= at_least, plan.describe("cuda")
    assert plan.fits(1, 1 + plan.blocks) and plan.most_blocks() == plan.blocks
    ends = plan.sizes.embed_bytes + plan.headroom_bytes + plan.cache_bytes(plan.blocks)
    assert plan.head_blocks == min(plan.blocks, (plan.free_bytes - ends) // plan.sizes.block_bytes)
    # the old plan reserved both ends for every server: 22 GiB then held no block at all
    both = plan.ends_bytes(True, True) + plan.headroom_bytes + int(0.25 * plan.free_bytes)
    assert free_gib != 22 or plan.free_bytes - both < plan.sizes.block_bytes


def run_server(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m swarm.server args`` (forked warm, swarm/warm_start.py; a fresh interpreter when
    ``env`` changes a variable that libraries read at import, such as HF_HOME)."""
    return warm_start.run("swarm.server", args, timeout=timeout, cwd=str(ROOT), env={**os.environ, **(env or {})})


def test_plan_only_answers_offline_without_weights(tmp_path):
    """The card's model, no hub, an empty cache: the shipped config answers, nothing is downloaded."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = run_server(
        "--model", "deepseek-v4-pro", "--plan-only", "--assume-free-memory", "44GiB", "--device", "cuda", env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("3 of 61 blocks fit: 44.0 GiB free on cuda (assumed free memory)"), done.stdout
    assert "nf4 weights" in done.stdout and "cache budget of" in done.stdout and "embeddings" in done.stdout
    assert not any((tmp_path / "hf").rglob("*.safetensors"))
    too_many = run_server(
        "--model",
        "deepseek-v4-pro",
        "--plan-only",
        "--assume-free-memory",
        "22GiB",
        "--device",
        "cuda",
        "--num-blocks",
        "2",
        env=env,
    )
    assert too_many.returncode == 2 and "Traceback" not in too_many.stderr, too_many.stderr
    assert (
        "--num-blocks 2: blocks 1:3 do not fit: they need" in too_many.stderr
        and "22.00 GiB is free on cuda" in too_many.stderr
    )


def test_blocks_that_do_not_fit_stop_before_announcing(tiny_llama_path):
    """--num-blocks beyond the memory: one line naming what is needed and what is free, exit 2,
    and the server never got as far as joining the DHT or claiming a span."""
    done = run_server(
        "--model",
        str(tiny_llama_path),
        "--new-swarm",
        "--host",
        "127.0.0.1",
        "--num-blocks",
        "6",
        "--assume-free-memory",
        "1MiB",
        "--torch-threads",
        "1",
    )
    log = done.stdout + done.stderr
    assert done.returncode == 2, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "--num-blocks 6: blocks 0:6 do not fit: they need" in errors[0], log
    assert "0.00 GiB is free on cpu" in errors[0], errors[0]
    assert "Serving blocks" not in log and "joining" not in log and "Traceback" not in log, log


def test_the_cards_command_on_a_machine_with_no_room_stops_with_one_line(tiny_llama_path):
    """The card's command (``--model`` alone, no --blocks/--num-blocks) where the weights are
    reachable (a local checkpoint) but the device has no memory to spare: exit 2 with one line
    saying not even one block fits and why, before joining the DHT or loading any weights."""
    done = run_server(
        "--model",
        str(tiny_llama_path),
        "--new-swarm",
        "--host",
        "127.0.0.1",
        "--assume-free-memory",
        "1KiB",
        "--torch-threads",
        "1",
    )
    log = done.stdout + done.stderr
    assert done.returncode == 2, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot serve here, not even one block fits: 0 of 6 blocks fit" in errors[0], log
    assert "0.0 GiB free on cpu" in errors[0], errors[0]
    for never in ("Serving blocks", "joining", "Listening on", "MiB of weights", "Traceback"):
        assert never not in log, log


# ---- moves -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def move_swarm(tiny_llama_path):
    from tests.kit.swarms import inprocess_servers

    yield from inprocess_servers(tiny_llama_path)


def still_serves(model, servers, tiny_reference, span=(0, 3)) -> None:
    """The first server holds ``span``, is announced online for it, accepts sessions, and the swarm
    generates what transformers does."""
    from protocol.dht_records import fetch_servers
    from protocol.records import ServerState
    from tests.kit.reference import PROMPT

    server = servers[0]
    assert (server.span.start, server.span.end) == span and server.handler.accepting
    deadline = time.monotonic() + 15  # the announcement is stored in the background
    while True:
        mine = {s.peer_id: s for s in fetch_servers(server.dht, server.info.model, 6)}.get(server.info.peer_id)
        seen = None if mine is None else (mine.start_block, mine.end_block, mine.state)
        if seen == (*span, ServerState.ONLINE) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert seen == (*span, ServerState.ONLINE)
    expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False)
    output = model.generate(torch.tensor(PROMPT), max_new_tokens=8, speculation=None)
    assert output[0].tolist() == expected[0].tolist()


def test_a_failed_move_keeps_the_old_span_serving(move_swarm, tiny_reference, monkeypatch):
    from client import _loop
    from server import moves

    model, servers = move_swarm
    server = servers[0]

    def broken_load(*args, **kwargs):
        raise RuntimeError("injected: the disk went away")

    monkeypatch.setattr(moves, "load_span", broken_load)
    assert server.plan is not None and server.plan.fits_beside((0, 3), (3, 6))
    assert _loop.run(server.move_to(3, 6), timeout=120) is False  # loads beside the old span, fails
    still_serves(model, servers, tiny_reference)


def test_a_failed_move_that_freed_the_old_span_loads_it_again(move_swarm, tiny_reference, monkeypatch):
    """Not room for both spans: the old one drains and is freed first; the new one fails to load,
    so the old one loads again and is announced online and accepting."""
    from client import _loop
    from server import moves
    from server.memory import MemoryPlan

    model, servers = move_swarm
    server = servers[0]
    plan = server.plan
    sizes = plan.sizes
    # room for one 3-block span with both ends, not for two
    cache = MemoryPlan(6, 0, sizes, cache_tokens=2048).cache_bytes(3)
    free = int((3 * sizes.block_bytes + sizes.embed_bytes + sizes.tail_bytes + cache) / 0.94)
    monkeypatch.setattr(server, "plan", MemoryPlan(6, free, sizes, plan.quant, 0, cache_tokens=2048))
    assert server.plan.fits(3, 6) and not server.plan.fits_beside((0, 3), (3, 6))
    real_load, calls = moves.load_span, []

    def fails_once(*args, **kwargs):
        calls.append(args[2:4])
        if len(calls) == 1:
            raise MemoryError("injected: out of memory while loading")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(moves, "load_span", fails_once)
    assert _loop.run(server.move_to(3, 6), timeout=240) is False
    assert calls == [(3, 6), (0, 3)]  # the target failed, the old span came back
    still_serves(model, servers, tiny_reference)


def test_a_target_too_large_for_the_memory_is_refused(move_swarm, tiny_reference, monkeypatch):
    from client import _loop
    from server import moves
    from server.memory import MemoryPlan

    model, servers = move_swarm
    server = servers[0]
    sizes = server.plan.sizes
    cache = MemoryPlan(6, 0, sizes, cache_tokens=2048).cache_bytes(3)
    free = int((3 * sizes.block_bytes + sizes.embed_bytes + cache) / 0.94)  # 0:3 fits, 0:6 not
    monkeypatch.setattr(server, "plan", MemoryPlan(6, free, sizes, server.plan.quant, cache_tokens=2048))
    assert server.plan.fits(0, 3) and not server.plan.fits(0, 6)
    monkeypatch.setattr(moves, "load_span", lambda *a, **k: pytest.fail("a move that does not fit must not load"))
    assert _loop.run(server.move_to(0, 6), timeout=60) is False
    still_serves(model, servers, tiny_reference)


# ---- announced limits and protocol versions --------------------------------------------------


def test_routers_skip_servers_of_another_protocol_version_and_say_so():
    from protocol.records import ServerInfo
    from protocol.route_errors import NoRouteError
    from protocol.routing import MaxFlowRouter
    from protocol.version import PROTOCOL_VERSION

    def server(peer: str, version: int) -> ServerInfo:
        return ServerInfo(
            peer_id=peer,
            model="m",
            start_block=0,
            end_block=4,
            throughput=10.0,
            free_cache_tokens=4096,
            protocol_version=version,
        )

    route = MaxFlowRouter().plan([server("old", PROTOCOL_VERSION - 1), server("new", PROTOCOL_VERSION)], 0, 4)
    assert [hop.peer_id for hop in route] == ["new"]
    with pytest.raises(
        NoRouteError, match=f"1 server is on protocol version {PROTOCOL_VERSION - 1}, not {PROTOCOL_VERSION}"
    ):
        MaxFlowRouter().plan([server("old", PROTOCOL_VERSION - 1)], 0, 4)


def test_records_bound_the_announced_step_limit():
    import msgspec

    from protocol.records import ServerInfo

    record = ServerInfo(peer_id="p", model="m", start_block=0, end_block=2).to_dict()
    assert ServerInfo.from_dict({**record, "max_positions_per_step": 16}).max_positions_per_step == 16
    del record["max_positions_per_step"]  # an older server: the default
    assert ServerInfo.from_dict(record).max_positions_per_step == 512
    for bad in (0, 7, 10**9, "16"):  # below the floor no record can make a client crawl a prompt
        with pytest.raises(msgspec.ValidationError):
            ServerInfo.from_dict({**record, "max_positions_per_step": bad})


def test_the_client_chunks_prefill_to_the_smallest_limit_on_its_route(tiny_llama_path, tiny_reference):
    """The tail takes at most 8 positions per Step, the head and the client 512: a 40-token prompt
    goes as chunks of 8 (not one Step the tail refuses with step_too_large), and the output is
    transformers' own."""
    from client import _loop
    from protocol.dht import make_dht
    from server.span_server import ServerConfig, SpanServer
    from swarm import AutoDistributedModelForCausalLM

    bootstrap = make_dht(host="127.0.0.1")
    peers = [str(m) for m in bootstrap.get_visible_maddrs()]
    common = dict(
        model=str(tiny_llama_path),
        initial_peers=peers,
        host="127.0.0.1",
        reachability="public",
        update_period=2.0,
        torch_threads=1,
    )

    async def start():
        return [
            await SpanServer.create(ServerConfig(blocks=(0, 3), **common)),
            await SpanServer.create(ServerConfig(blocks=(3, 6), max_positions_per_step=8, **common)),
        ]

    servers = _loop.run(start(), timeout=240)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=peers)
    try:
        prompt = torch.tensor([[(7 * i + 3) % 200 + 5 for i in range(40)]])
        expected = tiny_reference.generate(prompt, max_new_tokens=8, do_sample=False)
        output = model.generate(prompt, max_new_tokens=8, speculation=None)
        assert output[0].tolist() == expected[0].tolist()
        assert servers[1].handler.stats["runs"] >= 40 // 8  # the prompt went as chunks of at most 8
    finally:
        model.shutdown()
        for server in servers:
            _loop.run(server.shutdown(), timeout=60)
        bootstrap.shutdown()


# ---- model identity --------------------------------------------------------------------------


def test_same_model_keeps_one_config_and_one_revision():
    from protocol.records import ServerInfo
    from protocol.routing import same_model

    def server(peer: str, fingerprint: str, revision: str) -> ServerInfo:
        return ServerInfo(
            peer_id=peer, model="m", start_block=0, end_block=2, config_fingerprint=fingerprint, revision=revision
        )

    servers = [
        server("a", "f", "r1"),
        server("b", "f", "r2"),
        server("c", "f", "r2"),
        server("d", "g", "r1"),
        server("old", "", ""),
    ]
    assert [s.peer_id for s in same_model(servers, "f", "r1")] == ["a"]  # the client's own revision
    assert [s.peer_id for s in same_model(servers, "f", "r3")] == ["b", "c"]  # else the one most servers hold
    assert [s.peer_id for s in same_model(servers, "g", "")] == ["d"]
    assert same_model(servers, "h", "r1") == []


def test_two_folders_of_the_same_name_are_never_routed_together(tmp_path, single_thread_reference):
    """Two different checkpoints, both in folders called ``model`` with the same config: one DHT
    name, two weights revisions. Each client sees both servers in the DHT, routes only to the one
    holding its own weights, and generates what transformers does with them."""
    from client import _loop
    from protocol.dht import make_dht
    from protocol.dht_records import fetch_servers
    from protocol.models import resolve_model
    from server.span_server import ServerConfig, SpanServer
    from swarm import AutoDistributedModelForCausalLM
    from tests.kit.checkpoints import build_tiny_llama
    from tests.kit.reference import PROMPT

    paths = [build_tiny_llama(tmp_path / name / "model", seed=seed) for name, seed in (("a", 0), ("b", 1))]
    names = {resolve_model(str(p)).dht_name for p in paths}
    assert len(names) == 1 and names.pop().startswith("model-")  # base name + a hash of the config
    other = build_tiny_llama(tmp_path / "c" / "model", num_layers=4)
    assert resolve_model(str(other)).dht_name != resolve_model(str(paths[0])).dht_name  # another config: another name

    bootstrap = make_dht(host="127.0.0.1")
    peers = [str(m) for m in bootstrap.get_visible_maddrs()]

    async def start():
        return [
            await SpanServer.create(
                ServerConfig(
                    model=str(p),
                    initial_peers=peers,
                    host="127.0.0.1",
                    blocks=(0, 6),
                    reachability="public",
                    update_period=2.0,
                    torch_threads=1,
                )
            )
            for p in paths
        ]

    servers = _loop.run(start(), timeout=240)
    assert servers[0].info.revision != servers[1].info.revision
    models = []
    try:
        for path, server in zip(paths, servers):
            model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=peers)
            models.append(model)
            both, deadline = (
                {s.info.peer_id for s in servers},
                time.monotonic() + 30,
            )  # records are stored in the background
            while not both <= {s.peer_id for s in fetch_servers(model.swarm.dht, model.swarm.model, 6)}:
                assert time.monotonic() < deadline, "both servers should be listed under one name"
                time.sleep(0.5)
            route = _loop.run(model.swarm._plan(64), timeout=60)
            model.swarm.router.release(route)
            assert [hop.peer_id for hop in route] == [server.info.peer_id]
            expected = single_thread_reference(path).generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False)
            assert (
                model.generate(torch.tensor(PROMPT), max_new_tokens=8, speculation=None)[0].tolist()
                == expected[0].tolist()
            )
    finally:
        for model in models:
            model.shutdown()
        for server in servers:
            _loop.run(server.shutdown(), timeout=60)
        bootstrap.shutdown()


@pytest.fixture
def single_thread_reference():
    from transformers import AutoModelForCausalLM

    return lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ---- the CLI ---------------------------------------------------------------------------------


def test_help_shows_defaults_and_every_alias_and_version_answers():
    from protocol.models import ALIASES
    from protocol.version import PROTOCOL_VERSION

    text = run_server("--help").stdout
    assert f"alias ({', '.join(ALIASES)}), hub repo id" in " ".join(text.split())  # all of them, no "..."
    assert "(default: auto)" in text and "(default: 0.0.0.0)" in text and "(default: None)" not in text
    version = run_server("--version")
    assert version.returncode == 0 and f"(protocol {PROTOCOL_VERSION})" in version.stdout


def test_listen_addresses_are_built_with_multiaddr():
    from protocol.dht import listen_maddr

    assert listen_maddr("::1", 31337) == "/ip6/::1/tcp/31337"
    assert listen_maddr("[::]", 0) == "/ip6/::/tcp/0"
    assert listen_maddr("127.0.0.1", 5) == "/ip4/127.0.0.1/tcp/5"
    with pytest.raises(ValueError, match="--host must be an IPv4 or IPv6 address"):
        listen_maddr("example.org", 5)


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_a_swarm_on_ipv6_loopback_generates(tiny_llama_path, tiny_reference):
    """Bootstrap, server and client on ::1 only: the server announces /ip6/ addresses and the
    client generates what transformers does."""
    from client import _loop
    from protocol.dht import make_dht
    from server.span_server import ServerConfig, SpanServer
    from swarm import AutoDistributedModelForCausalLM
    from tests.kit.reference import PROMPT

    bootstrap = make_dht(host="::1")
    peers = [str(m) for m in bootstrap.get_visible_maddrs() if str(m).startswith("/ip6/::1/")]
    assert peers, bootstrap.get_visible_maddrs()
    server = _loop.run(
        SpanServer.create(
            ServerConfig(
                model=str(tiny_llama_path),
                initial_peers=peers,
                host="::1",
                blocks=(0, 6),
                reachability="public",
                update_period=2.0,
                torch_threads=1,
            )
        ),
        timeout=240,
    )
    model = None
    try:
        assert all(str(m).startswith("/ip6/") for m in server.dht.get_visible_maddrs())
        model = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=peers)
        expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False)
        assert (
            model.generate(torch.tensor(PROMPT), max_new_tokens=8, speculation=None)[0].tolist() == expected[0].tolist()
        )
    finally:
        if model is not None:
            model.shutdown()
        _loop.run(server.shutdown(), timeout=60)
        bootstrap.shutdown()


def test_the_dashboard_shows_other_weights_apart_and_other_versions_as_such():
    """Under one DHT name, servers of another weights revision are another model on the dashboard,
    and a server of another protocol version is listed, marked, and covers no block."""
    from protocol.records import ServerInfo
    from protocol.version import PROTOCOL_VERSION
    from swarm.dashboard.events import ModelSnapshot, SwarmPolled
    from swarm.dashboard.poller import split_by_weights
    from swarm.dashboard.state import State, fold
    from swarm.dashboard.views import state_view

    def server(peer: str, start: int, end: int, revision: str = "r1", version: int = PROTOCOL_VERSION) -> ServerInfo:
        return ServerInfo(
            peer_id=peer,
            model="m",
            start_block=start,
            end_block=end,
            throughput=5.0,
            config_fingerprint="f",
            revision=revision,
            protocol_version=version,
            started_at=1.0,
        )

    snapshot = ModelSnapshot(
        "m",
        4,
        (
            server("a", 0, 2),
            server("b", 2, 4),
            server("c", 0, 4, revision="r2"),
            server("old", 0, 4, version=PROTOCOL_VERSION - 1),
        ),
    )
    parts = split_by_weights(snapshot)
    assert [(p.name, sorted(s.peer_id for s in p.servers)) for p in parts] == [
        ("m", ["a", "b", "old"]),
        ("m @r2", ["c"]),
    ]
    view = state_view(fold([SwarmPolled(10.0, tuple(parts))], State()), now=10.0, refresh_seconds=5.0)
    models = {m["name"]: m for m in view["models"]}
    assert set(models) == {"m", "m @r2"} and models["m"]["healthy"] and models["m @r2"]["healthy"]
    rows = {row["peer_id"]: row for row in models["m"]["servers"]}
    assert rows["old"]["compatible"] is False and rows["a"]["compatible"] is True
    assert [b["servers"] for b in models["m"]["blocks"]] == [1, 1, 1, 1]  # "old" covers nothing
