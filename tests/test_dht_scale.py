"""Twenty real hivemind DHT peers on loopback (one p2pd each) holding signed server records: a
client reads every valid record and none of the hostile ones, and still reads the live servers'
records after a fifth of the peers vanish at once (``benchmarks/dht_scale.py`` measures the same
swarm at larger sizes)."""

from __future__ import annotations

import time

import pytest

from benchmarks.dht_scale import ServersSigner, Swarm, identities, real_ids
from benchmarks.synthetic_swarm import MODEL, make_swarm
from protocol.dht_records import fetch_servers

pytestmark = pytest.mark.timeout(600)

PEERS, SERVERS, BLOCKS = 20, 40, 61


def seen(client) -> set[str]:
    return {s.peer_id for s in fetch_servers(client, MODEL, BLOCKS)}


def test_twenty_dht_peers_serve_every_record_and_survive_a_fifth_vanishing(tmp_path):
    ids = identities(SERVERS, str(tmp_path / "identities.msgpack"))
    honest, hostile, _ = real_ids(make_swarm(SERVERS, BLOCKS, seed=3), ids)
    swarm = Swarm(ServersSigner(ids))
    try:
        swarm.start_peers(PEERS)
        for i, info in enumerate(honest):
            swarm.host(info.peer_id, i % PEERS, info)
        for i, raw in enumerate(hostile):
            swarm.host(raw["_subkey"], i % PEERS, raw)
        swarm.announce_all(BLOCKS, expiration=120.0)
        client = swarm.client()
        assert seen(client) == {info.peer_id for info in honest}  # every valid record, no hostile one

        victims = list(range(PEERS - PEERS // 5, PEERS))  # 4 peers, never the client's entry point
        alive = {info.peer_id for i, info in enumerate(honest) if i % PEERS not in victims}
        swarm.vanish(victims)
        deadline = time.monotonic() + 120
        while not alive <= (found := seen(client)) and time.monotonic() < deadline:
            time.sleep(1)
        assert alive <= found, f"{len(alive - found)} live servers missing after {len(victims)} peers vanished"
        assert not found - {info.peer_id for info in honest}
    finally:
        swarm.shutdown()
