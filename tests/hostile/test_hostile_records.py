"""Hostile records: what a peer with a fresh identity can sign and store cannot stall, crash or
bloat anyone who reads the swarm (docs/reliability.md, "Hostile records").

Unit tests check each validation rule on fabricated records (no network); the live test stores
every attack into the session's tiny swarm and then runs a client, the router and the
dashboard's reader against it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import time
import tracemalloc
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import msgspec
import psutil
import pytest
import torch

from client._throughput import ThroughputMeter
from protocol.dht_records import _parse, fetch_model_registry, fetch_servers
from protocol.flow import swarm_max_flow
from protocol.messages import Hop
from protocol.placement import choose_best_span
from protocol.records import (
    MAX_MODEL_BLOCKS,
    MAX_NAME_CHARS,
    MAX_NEXT_PINGS,
    MAX_THROUGHPUT,
    MODELS_KEY,
    ServerInfo,
    block_key,
)
from protocol.routing import MaxFlowRouter, cap_throughput
from protocol.validation import MAX_RECORD_BYTES, PeerIdSignatureValidator
from tests.kit import records

pytestmark = pytest.mark.timeout(60)

MODEL = "m"
BLOCKS = 6
BIG = "x" * 2**20  # 1 MiB


srv = functools.partial(records.srv, model=MODEL, cache_tokens=8192)


def honest(**changes: Any) -> dict:
    raw = srv("peer", 0, 3, next_pings={"other": 0.01}, public_name="ok", version="1.0").to_dict()
    raw.update(changes)
    return raw


# ---- each validation rule ---------------------------------------------------------------------

HOSTILE_FIELDS = {
    "end past the model": {"end_block": BLOCKS + 1},
    "end 10**9": {"end_block": 10**9},
    "start negative": {"start_block": -1},
    "empty span": {"start_block": 3, "end_block": 3},
    "reversed span": {"start_block": 4, "end_block": 2},
    "throughput inf": {"throughput": math.inf},
    "throughput nan": {"throughput": math.nan},
    "throughput 1e300": {"throughput": 1e300},
    "throughput above the cap": {"throughput": MAX_THROUGHPUT * 2},
    "throughput zero": {"throughput": 0.0},
    "throughput negative": {"throughput": -5.0},
    "throughput a string": {"throughput": "fast"},
    "negative cache": {"cache_tokens": -1},
    "negative free cache": {"free_cache_tokens": -100},
    "cache 10**30": {"cache_tokens": 10**30},
    "free cache 10**13": {"free_cache_tokens": 10**13},
    "too many next_pings": {"next_pings": {f"p{i}": 0.01 for i in range(MAX_NEXT_PINGS + 1)}},
    "next_ping nan": {"next_pings": {"a": math.nan}},
    "next_ping negative": {"next_pings": {"a": -1.0}},
    "next_ping inf": {"next_pings": {"a": math.inf}},
    "next_ping key 1 MiB": {"next_pings": {BIG: 0.1}},
    "public_name 1 MiB": {"public_name": BIG},
    "public_name over the cap": {"public_name": "n" * (MAX_NAME_CHARS + 1)},
    "version 1 MiB": {"version": BIG},
    "dtype 1 MiB": {"dtype": BIG},
    "quantization 1 MiB": {"quantization": BIG},
    "started_at inf": {"started_at": math.inf},
    "negative counter": {"laps_served": -1},
    "counter 2**70": {"accepted_tokens": 2**70},
    "unknown state": {"state": "leader"},
    "empty peer id": {"peer_id": ""},
    "negative backward budget": {"max_backward_bytes": -1},
    "backward budget 2**60": {"max_backward_bytes": 2**60},
}


@pytest.mark.parametrize("changes", list(HOSTILE_FIELDS.values()), ids=list(HOSTILE_FIELDS))
def test_record_with_a_hostile_field_is_rejected(changes):
    with pytest.raises(msgspec.ValidationError):
        ServerInfo.from_dict(honest(**changes), BLOCKS)


def test_honest_record_passes_and_unknown_fields_are_ignored():
    info = ServerInfo.from_dict(honest(from_the_future=[1, 2, 3]), BLOCKS)
    assert (info.start_block, info.end_block, info.next_pings) == (0, 3, {"other": 0.01})
    assert ServerInfo.from_dict(honest(start_block=5, end_block=6), BLOCKS).span == range(5, 6)


def test_span_is_checked_against_the_given_model_not_the_record():
    raw = honest(start_block=0, end_block=40)
    assert ServerInfo.from_dict(raw, 40).end_block == 40
    with pytest.raises(msgspec.ValidationError, match="not inside the model's 0:6"):
        ServerInfo.from_dict(raw, BLOCKS)


def test_parse_drops_a_bad_record_with_a_debug_log(caplog):
    with caplog.at_level(logging.DEBUG, logger="protocol.dht_records"):
        assert _parse("peer", honest(throughput=math.inf), MODEL, BLOCKS) is None
        assert _parse("peer", honest(end_block=10**9), MODEL, BLOCKS) is None
        assert _parse("peer", honest(public_name=BIG), MODEL, BLOCKS) is None
    assert sum("Ignoring malformed record from peer" in r.message for r in caplog.records) == 3
    assert all(len(r.message) < 400 for r in caplog.records)  # a 1 MiB name is not copied into the log
    assert _parse("peer", honest(), MODEL, BLOCKS) is not None


def test_fetch_servers_refuses_an_unbounded_number_of_blocks():
    for bad in (0, -1, MAX_MODEL_BLOCKS + 1, 10**9):
        with pytest.raises(ValueError, match="num_blocks must be in"):
            fetch_servers(None, MODEL, bad)


def _fake_registry(entries: dict) -> Any:
    items = {name: SimpleNamespace(value=value) for name, value in entries.items()}
    return SimpleNamespace(get=lambda key, latest: SimpleNamespace(value=items) if key == MODELS_KEY else None)


def test_registry_entries_are_bounded_and_the_config_wins():
    dht = _fake_registry(
        {
            "tiny": {"num_blocks": 10**9},
            "other": {"num_blocks": 10**9},
            "fine": {"num_blocks": 30},
            "bool": {"num_blocks": True},
            "zero": {"num_blocks": 0},
            "n" * (MAX_NAME_CHARS + 1): {"num_blocks": 3},
            7: {"num_blocks": 3},
            "old": None,
            "capped": {"num_blocks": MAX_MODEL_BLOCKS},
        }
    )
    registry = fetch_model_registry(dht, known={"tiny": 6, "fine": 30})
    assert registry == {
        "tiny": 6,
        "other": None,
        "fine": 30,
        "bool": None,
        "zero": None,
        "old": None,
        "capped": MAX_MODEL_BLOCKS,
    }


class CountingDHT:
    """Answers the registry with ``entries`` and every block read with nothing; counts keys read."""

    def __init__(self, entries: dict):
        self.registry = _fake_registry(entries)
        self.keys_read: list[str] = []

    def get(self, key, latest):
        return self.registry.get(key, latest)

    def run_coroutine(self, fn, return_future=False):
        self.keys_read += fn.keywords["keys"]
        return {}


def test_dashboard_poll_reads_a_bounded_number_of_keys_known_models_first():
    from swarm.dashboard.events import SwarmPolled
    from swarm.dashboard.poller import MAX_KEYS_PER_POLL, SwarmReader

    flood = {f"0-junk-{i:03d}": {"num_blocks": 300} for i in range(100)}
    dht = CountingDHT({**flood, "tiny": {"num_blocks": 10**9}, "zz-old": None})
    event = SwarmReader(dht, known_blocks={"tiny": BLOCKS}).poll()
    assert isinstance(event, SwarmPolled)
    assert len(dht.keys_read) <= MAX_KEYS_PER_POLL
    assert {block_key("tiny", b) for b in range(BLOCKS)} <= set(dht.keys_read)
    assert next(s for s in event.models if s.name == "tiny").num_blocks == BLOCKS


def test_validator_refuses_oversized_values():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    validator = PeerIdSignatureValidator()
    key = DHTID.generate(source=MODELS_KEY).to_bytes()
    small = DHTRecord(key, MSGPackSerializer.dumps("m"), MSGPackSerializer.dumps({"num_blocks": 6}), 1e10)
    big = DHTRecord(key, MSGPackSerializer.dumps("m"), b"\0" * (MAX_RECORD_BYTES + 1), 1e10)
    assert validator.validate(small) and not validator.validate(big)


# ---- readers never allocate or loop by a claimed number -----------------------------------------


def test_router_ignores_non_finite_throughput_and_bounds_huge_spans():
    """Records built without decoding (so unchecked) still cannot make max-flow raise or the
    router allocate by a claimed span: peak allocation stays far below one set of 10**9 ints."""
    servers = [
        srv("a", 0, 3),
        srv("b", 3, 6),
        srv("inf", 0, 6, math.inf),
        srv("nan", 0, 6, math.nan),
        srv("huge", 0, 10**9, 1e300),
        srv("wide", 0, 10**9, 5.0),
    ]
    tracemalloc.start()
    try:
        route = MaxFlowRouter().plan(servers, 0, BLOCKS)
        flow = swarm_max_flow(servers, BLOCKS)
        span = choose_best_span(servers, BLOCKS, 2, 10.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20
    assert {hop.peer_id for hop in route} <= {"a", "b", "wide"}
    assert flow == pytest.approx(15.0)  # a+b in series (10) plus the wide one (5); inf/nan/1e300 ignored
    assert 0 <= span[0] < span[1] <= BLOCKS


# ---- throughput claims against what the client measured ------------------------------------------


def test_router_uses_measured_throughput_below_the_claim():
    """Two one-hop paths; "liar" claims 10x more than "steady", so it wins on claims alone, and
    loses once this client measured it at 2 tokens/s."""
    servers = [srv("liar", 0, BLOCKS, 100.0), srv("steady", 0, BLOCKS, 10.0)]
    assert [hop.peer_id for hop in MaxFlowRouter().plan(servers, 0, BLOCKS)] == ["liar"]
    capped = cap_throughput(servers, {"liar": 2.0, "steady": 50.0})  # measured above a claim: the claim stays
    assert [s.throughput for s in capped] == [2.0, 10.0]
    assert [hop.peer_id for hop in MaxFlowRouter().plan(capped, 0, BLOCKS)] == ["steady"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_meter_blames_the_slow_hop_and_forgets_after_ttl():
    """Claims: every server 1000 tokens/s (1 ms a step). "slow" really takes 100 ms: laps over
    slow+tail take ~101 ms, laps over fast+tail ~2 ms. After a few of each, "slow" is measured
    near 10 tokens/s, while the tail, charged too at first, recovers as "slow" explains its laps."""
    servers = {p: srv(p, *span, 1000.0) for p, span in {"slow": (0, 3), "fast": (0, 3), "tail": (3, 6)}.items()}
    clock = Clock()
    meter = ThroughputMeter(clock=clock, ttl=60.0)
    via_slow = [Hop("slow", 0, 3), Hop("tail", 3, 6)]
    via_fast = [Hop("fast", 0, 3), Hop("tail", 3, 6)]
    rtts = {"slow": 0.0, "fast": 0.0, "tail": 0.0}
    for _ in range(6):
        meter.observe(via_slow, servers, 0.101, 1, rtts)
        meter.observe(via_fast, servers, 0.002, 1, rtts)
    measured = meter.measured()
    assert measured["slow"] < 15 and measured["tail"] > 5 * measured["slow"]
    assert measured.get("fast", 1000.0) >= 1000.0  # never charged: the tail explains its short laps
    capped = cap_throughput(list(servers.values()), measured)
    assert [hop.peer_id for hop in MaxFlowRouter().plan(capped, 0, BLOCKS)] == ["fast", "tail"]
    meter.observe(via_slow, servers, 5.0, 400, rtts)  # a prefill lap: not a decode step, not counted
    assert meter.measured()["slow"] == pytest.approx(measured["slow"])
    clock.now = 61.0
    assert meter.measured() == {}


# ---- live: every attack stored into a running swarm ---------------------------------------------

EXPIRATION = 90.0  # seconds the hostile records live: well past the honest registry entry (15 s)
JUNK_MODELS = 40  # registry entries beyond MAX_MODELS_PER_POLL, named to sort before real models


def _attacks(peer_id: str, model: str, first: bool) -> list[tuple[int, dict]]:
    """(block, record) pairs for one hostile peer: one record per block key it may sign."""

    def rec(**fields: Any) -> dict:
        base = {
            "peer_id": peer_id,
            "model": model,
            "start_block": 0,
            "end_block": BLOCKS,
            "state": "online",
            "throughput": 1.0,
            "cache_tokens": 10**6,
            "free_cache_tokens": 10**6,
        }
        return {**base, **fields}

    if first:
        records = [
            rec(end_block=10**9, throughput=math.inf),
            rec(throughput=math.nan),
            rec(throughput=1e300),
            rec(cache_tokens=-5, free_cache_tokens=-5),
            rec(end_block=BLOCKS + 1),
            rec(start_block=-3, end_block=10**12),
        ]
    else:
        records = [
            rec(next_pings={f"Qm{i:044d}": 0.01 for i in range(20_000)}),
            rec(public_name=BIG),
            rec(version=BIG),
            rec(next_pings={"a": math.nan, "b": -1.0}),
            rec(start_block=4, end_block=2),
            rec(free_cache_tokens=2**63 - 1),
        ]
    return list(enumerate(records))


def _attack_records(peer_id: str, model: str, first: bool) -> tuple[list, list, list]:
    attacks = _attacks(peer_id, model, first)
    return [block_key(model, block) for block, _ in attacks], [peer_id] * len(attacks), [r for _, r in attacks]


def _registry_entries(model: str) -> tuple[list, list, list]:
    """Anyone may write the registry: one entry resizes the real model, the others flood it."""
    registry = {
        model: {"num_blocks": 10**9},
        "hostile-model": {"num_blocks": 10**9},
        **{f"0-junk-{i:02d}": {"num_blocks": MAX_MODEL_BLOCKS} for i in range(JUNK_MODELS)},
    }
    return [MODELS_KEY] * len(registry), list(registry), list(registry.values())


async def _store(dht, node, make: Callable[[], tuple[list, list, list]], expiration: float) -> dict:
    """Runs in the peer's DHT process; the values are made there (a megabyte does not cross the
    DHT's pipe)."""
    from hivemind.utils import get_dht_time

    keys, subkeys, values = make()
    return await node.store_many(keys, values, expiration_time=get_dht_time() + expiration, subkeys=subkeys)


class HostilePeer:
    """A client-mode DHT peer with a freshly made identity, signing whatever it is told to store."""

    def __init__(self, initial_peers: list[str]):
        from protocol.dht import make_dht
        from protocol.identity import load_or_create_identity

        self.identity = load_or_create_identity(None)
        self.peer_id = self.identity.peer_id.to_base58()
        self.dht = make_dht(initial_peers=initial_peers, identity=self.identity, client_mode=True)

    def store(self, make: Callable[[], tuple[list, list, list]]) -> dict:
        """Store ``make()``'s ``(keys, subkeys, values)``, each signed as this peer."""
        return self.dht.run_coroutine(partial(_store, make=make, expiration=EXPIRATION))


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its children (a server and its DHT process); for this
    test's own process, itself only (its children include the whole swarm)."""
    process = psutil.Process(pid)
    total = 0
    for p in [process, *(process.children(recursive=True) if pid != os.getpid() else [])]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


@pytest.fixture(scope="module")
def reader_dht(tiny_swarm):
    from protocol.dht import make_dht

    dht = make_dht(initial_peers=tiny_swarm.initial_peers, client_mode=True)
    yield dht
    dht.shutdown()


@pytest.fixture(scope="module")
def attacked(tiny_swarm, reader_dht):
    """Two hostile peers store every attack (records, registry entries) into the tiny swarm.
    Yields what each store returned, and the hostile peer ids."""
    model = tiny_swarm.dht_name
    hostile = [HostilePeer(tiny_swarm.initial_peers) for _ in range(2)]
    try:
        stored: dict[str, bool] = {}
        for index, peer in enumerate(hostile):
            result = peer.store(partial(_attack_records, peer.peer_id, model, index == 0))
            for block in range(BLOCKS):
                stored[f"{index}:{block}"] = bool(result.get((block_key(model, block), peer.peer_id)))
        hostile[0].store(partial(_registry_entries, model))
        yield SimpleNamespace(stored=stored, peers=[p.peer_id for p in hostile], model=model)
    finally:
        for peer in hostile:
            peer.dht.shutdown()


@pytest.mark.timeout(600)  # includes starting the session's tiny swarm when this runs first
def test_hostile_records_leave_clients_router_dashboard_and_servers_working(
    tiny_swarm, tiny_model, tiny_reference, reader_dht, attacked
):
    from swarm.dashboard.app import Dashboard
    from swarm.dashboard.poller import MAX_MODELS_PER_POLL, SwarmReader
    from swarm.dashboard.views import state_view

    model, honest_names = attacked.model, {"A", "B", "C", "D", "E"}
    # the attacks are live: every record that fits the size cap sits in the DHT beside the honest
    # ones, the oversized ones were refused by the peers that would store them
    oversized = {"1:0", "1:1", "1:2"}
    assert {k for k, ok in attacked.stored.items() if not ok} == oversized
    first, second = attacked.peers
    for block in range(BLOCKS):
        entry = reader_dht.get(block_key(model, block), latest=True)
        assert first in entry.value and (second in entry.value) == (block >= 3)
    raw = fetch_model_registry(reader_dht)
    assert raw[model] is None and raw["hostile-model"] is None  # 10**9 does not pass the bound
    assert sum(name.startswith("0-junk-") for name in raw) == JUNK_MODELS

    alive = [p for p in tiny_swarm.servers if p.poll() is None]
    rss_before = {pid: _tree_rss(pid) for pid in [*(p.pid for p in alive), os.getpid(), reader_dht.pid]}

    # fetch_servers and the router see the honest servers only
    servers = fetch_servers(reader_dht, model, BLOCKS)
    assert {s.public_name for s in servers} == honest_names and not set(attacked.peers) & {s.peer_id for s in servers}
    route = MaxFlowRouter().plan(servers, 0, BLOCKS)
    assert {hop.peer_id for hop in route} <= {s.peer_id for s in servers}

    # a client generation (real router, records read through the client's own DHT) is exact
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 657, 506]])
    expected = tiny_reference.generate(prompt, max_new_tokens=16, do_sample=False)
    for speculation in (None, "suffix"):
        assert tiny_model.generate(prompt, max_new_tokens=16, speculation=speculation).tolist() == expected.tolist()
    assert not set(attacked.peers) & {peer for peer, _, _ in tiny_model.last_generation_stats.route}

    # the dashboard's reader and state: the config's 6 blocks, the honest servers, bounded polls
    dashboard = Dashboard(SwarmReader(reader_dht, probe_timeout=2.0, known_blocks={model: BLOCKS}))
    for _ in range(3):
        asyncio.run(dashboard.refresh())
    state = dashboard.state
    assert state.poll_error is None and len(state.models) <= MAX_MODELS_PER_POLL
    tiny = state.models[model]
    assert tiny.num_blocks == BLOCKS and tiny.healthy
    assert {e.info.public_name for e in tiny.servers.values()} == honest_names
    assert "hostile-model" not in state.models or not state.models["hostile-model"].servers
    json.dumps(state_view(state, time.time(), 5.0))  # the page's JSON renders

    # servers keep serving through their own refreshes (next_pings, rebalancing) of the records
    time.sleep(6)  # one --update-period of the tiny swarm's servers
    assert tiny_model.generate(prompt, max_new_tokens=16, speculation=None).tolist() == expected.tolist()
    assert all(p.poll() is None for p in alive)
    growth = {pid: _tree_rss(pid) - before for pid, before in rss_before.items()}
    shown = [round(g / 2**20, 1) for g in growth.values()]
    print(f"\nhostile records: RSS growth (MiB), servers then the test process and its reader DHT: {shown}")
    assert max(growth.values()) < 200 * 2**20, f"resident memory grew: {growth}"


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"dtype": "float64"}, "dtype 'float64' is not one of"),
        ({"dtype": "bfloat16-exact"}, "dtype 'bfloat16-exact' is not one of"),
        ({"quantization": "int4"}, "quantization 'int4' is not one of"),
        ({"quantization": ""}, "quantization '' is not one of"),
    ],
)
def test_a_record_of_a_precision_nobody_serves_is_dropped_with_the_reason(caplog, changes, reason):
    """A unique precision would opt its server out of every audit (audits compare one precision)."""
    with caplog.at_level(logging.DEBUG, logger="protocol.dht_records"):
        assert _parse("peer", honest(**changes), MODEL, BLOCKS) is None
    assert any(reason in r.message and "Ignoring record from peer" in r.message for r in caplog.records)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("quantization", [None, "none", "int8", "nf4"])
def test_every_precision_a_server_announces_passes(dtype, quantization):
    assert _parse("peer", honest(dtype=dtype, quantization=quantization), MODEL, BLOCKS) is not None
