"""Synthetic but realistic server records for a swarm of any size, honest and hostile.

Used by ``benchmarks/scale.py`` (routing, placement and max-flow at up to thousands of servers),
``benchmarks/dht_scale.py`` (the same records announced in a real DHT) and ``tests/network/test_scale.py``.
Everything is drawn from one seeded ``random.Random``, so a seed names a swarm.

The distributions (stated here because every figure depends on them):

* **spans**: length uniform in 1..12 blocks. The first honest servers tile the model from block 0
  (each starts where the previous ended), so a swarm with enough servers covers every block, as
  block selection would make it; the rest start uniformly at random (``0..num_blocks - length``).
  If fewer honest servers than needed remain to finish the tiling, they take 12 blocks.
* **throughput** (tokens/s for the whole span): log-normal, median 20, sigma 0.8 (about 5 to 80
  for the middle 90%: consumer to datacenter GPUs decoding a span one position at a time),
  clipped to the record bounds.
* **where a server is**: a point in the unit square; the RTT between two points is
  ``5 ms + 150 ms x distance`` times a log-normal jitter (sigma 0.2), so RTTs run from a few ms
  (same city) to ~220 ms (antipodes). The client sits at a random point too.
* **next_pings**: like a real server (``server.upkeep.MAX_PINGED``), each honest server measures
  at most 8 of the servers holding the block after its span, at random.
* **state**: 5% of the honest servers not needed to tile the model are ``joining``, the rest
  ``online``.

Hostile records (``hostile_fraction``, default 10%), in the ways issue 15 listed; each kind in
turn, so every kind appears once there are enough servers:

* rejected by the readers' validation (``ServerInfo.from_dict`` against the model's own number
  of blocks): a span past the model (``end_block`` 10**9), infinite, NaN or above-the-cap
  throughput, negative cache, 65 next_pings (above ``MAX_NEXT_PINGS``), a 60 KB public name
  (what fits under the DHT's 64 KiB record cap), an unknown state;
* rejected by ``protocol.dht_records._parse``: a record stored under one peer id (subkey)
  that claims another peer's id, and a record for another model under this model's key.

Records are made as the raw dicts a DHT read returns, keyed by subkey, so a reader validates them
exactly as ``fetch_servers`` does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.dht_records import _parse
from protocol.records import MAX_NEXT_PINGS, MAX_THROUGHPUT, MIN_THROUGHPUT, ServerInfo, ServerState

MODEL = "synthetic-61"
MAX_SPAN = 12
MAX_PINGED = 8  # as server.upkeep.MAX_PINGED (server/ is not imported from here)
HOSTILE_KINDS = (
    "end_block 10**9",
    "throughput inf",
    "throughput nan",
    "throughput above the cap",
    "negative cache",
    "too many next_pings",
    "60 KB public name",
    "unknown state",
    "claims another peer id",
    "another model",
)


@dataclass
class SyntheticSwarm:
    """Raw records (subkey -> dict, as a DHT read gives them) and where everyone is."""

    num_blocks: int
    raw: dict[str, dict[str, Any]]
    hostile: dict[str, str]  # subkey -> hostile kind
    places: dict[str, tuple[float, float]]  # peer id -> point in the unit square
    client: tuple[float, float]

    def parsed(self) -> list[ServerInfo]:
        """What a client reading these records keeps: validated as ``fetch_servers`` does."""
        found = (_parse(subkey, raw, MODEL, self.num_blocks) for subkey, raw in self.raw.items())
        return [info for info in found if info is not None]

    def client_rtts(self, servers: list[ServerInfo]) -> dict[str, float]:
        """The client's RTT to each server that can be a head or a tail (what the client pings)."""
        return {
            s.peer_id: _rtt(self.client, self.places[s.peer_id], 1.0)
            for s in servers
            if s.peer_id in self.places and (s.start_block == 0 or s.end_block == self.num_blocks)
        }


def make_swarm(num_servers: int, num_blocks: int = 61, hostile_fraction: float = 0.1, seed: int = 0) -> SyntheticSwarm:
    rng = random.Random(seed)
    num_hostile = round(num_servers * hostile_fraction)
    honest = _honest_spans(rng, num_servers - num_hostile, num_blocks)
    peers = [f"peer-{i:05d}" for i in range(num_servers)]
    places = {p: (rng.random(), rng.random()) for p in peers}
    infos = [_honest(rng, peer, start, end, tiling) for peer, (start, end, tiling) in zip(peers, honest)]
    infos = [_with_pings(rng, info, infos, places) for info in infos]
    raw = {info.peer_id: info.to_dict() for info in infos}
    hostile = {}
    for i, peer in enumerate(peers[len(honest) :]):
        kind = HOSTILE_KINDS[i % len(HOSTILE_KINDS)]
        subkey, raw[subkey] = _hostile(kind, peer, peers, num_blocks)
        hostile[subkey] = kind
    return SyntheticSwarm(num_blocks, raw, hostile, places, (rng.random(), rng.random()))


def _honest_spans(rng: random.Random, count: int, num_blocks: int) -> list[tuple[int, int, bool]]:
    """``(start, end, tiling)`` per honest server; ``tiling``: one of those covering the model."""
    spans, covered = [], 0
    for i in range(count):
        length, tiling = min(rng.randint(1, MAX_SPAN), num_blocks), covered < num_blocks
        if tiling:  # still tiling the model from block 0
            if (num_blocks - covered) > MAX_SPAN * (count - i - 1):
                length = min(MAX_SPAN, num_blocks)  # few servers left: each takes the most it may
            start = min(covered, num_blocks - length)
            covered = start + length
        else:
            start = rng.randint(0, num_blocks - length)
        spans.append((start, start + length, tiling))
    return spans


def _honest(rng: random.Random, peer: str, start: int, end: int, tiling: bool) -> ServerInfo:
    throughput = min(MAX_THROUGHPUT, max(MIN_THROUGHPUT, rng.lognormvariate(math.log(20.0), 0.8)))
    joining = rng.random() < 0.05 and not tiling  # the servers tiling the model are online
    state = ServerState.JOINING if joining else ServerState.ONLINE
    return ServerInfo(
        peer_id=peer,
        model=MODEL,
        start_block=start,
        end_block=end,
        state=state,
        throughput=throughput,
        cache_tokens=65536,
        free_cache_tokens=rng.choice([65536, 32768, 8192, 1024]),
        public_name=f"volunteer {peer}",
        version="1.0",
    )


def _with_pings(rng: random.Random, me: ServerInfo, infos: list[ServerInfo], places: dict) -> ServerInfo:
    nexts = [s.peer_id for s in infos if s.peer_id != me.peer_id and s.start_block <= me.end_block < s.end_block]
    measured = rng.sample(nexts, min(MAX_PINGED, len(nexts)))
    pings = {p: round(_rtt(places[me.peer_id], places[p], rng.lognormvariate(0.0, 0.2)), 6) for p in measured}
    return msgspec.structs.replace(me, next_pings=pings)


def _rtt(a: tuple[float, float], b: tuple[float, float], jitter: float) -> float:
    return (0.005 + 0.150 * math.dist(a, b)) * jitter


def _hostile(kind: str, peer: str, peers: list[str], num_blocks: int) -> tuple[str, dict]:
    """``(subkey, raw record)`` for one hostile kind; the span looks attractive (the whole model)."""
    base = ServerInfo(
        peer_id=peer,
        model=MODEL,
        start_block=0,
        end_block=num_blocks,
        throughput=MAX_THROUGHPUT,
        cache_tokens=65536,
        free_cache_tokens=65536,
    ).to_dict()
    changes: dict[str, Any] = {
        "end_block 10**9": {"end_block": 10**9},
        "throughput inf": {"throughput": math.inf},
        "throughput nan": {"throughput": math.nan},
        "throughput above the cap": {"throughput": MAX_THROUGHPUT * 10},
        "negative cache": {"free_cache_tokens": -1},
        "too many next_pings": {"next_pings": {f"p{i}": 0.0 for i in range(MAX_NEXT_PINGS + 1)}},
        "60 KB public name": {"public_name": "n" * 60_000},
        "unknown state": {"state": "leader"},
        "claims another peer id": {"peer_id": peers[0] if peer != peers[0] else peers[-1]},
        "another model": {"model": "another-model"},
    }[kind]
    return peer, {**base, **changes}
