"""Ten real hivemind DHT peers on loopback (one p2pd each) holding signed server records: a
client reads every valid record and none of the hostile ones, and still reads the live servers'
records after a fifth of the peers vanish at once (``benchmarks/dht_scale.py`` measures the same
swarm at larger sizes); and a lookup of many keys whose answers would pass p2pd's message limit
is still answered (the readers' ``KEYS_PER_LOOKUP``).

The peers run on an asyncio loop in a thread of their own process, started here with ``spawn``:
pytest's own process then keeps no DHT threads or daemons (CPython 3.11's AST check misfires
when pytest compiles a module late in a process with such threads). Both tests run in one such
child (a module fixture): its imports take seconds, each scenario starts and stops its own peers.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

pytestmark = pytest.mark.timeout(600)

PEERS, SERVERS, BLOCKS = 10, 20, 61  # benchmarks/dht_scale.py goes to hundreds


@pytest.fixture(scope="module")
def child():
    """One spawned worker process for the module's scenarios."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def scenario(keys_path: str) -> dict:
    """Runs in a child process: what the client saw before and after a fifth of the peers vanished."""
    from protocol.dht_records import fetch_servers
    from tests.kit.dht_swarm import ServersSigner, Swarm, identities, real_ids
    from tests.kit.synthetic_swarm import MODEL, make_swarm

    ids = identities(SERVERS, keys_path)
    honest, hostile, _ = real_ids(make_swarm(SERVERS, BLOCKS, seed=3), ids)
    swarm = Swarm(ServersSigner(ids))
    try:
        swarm.start_peers(PEERS)
        for i, info in enumerate(honest):
            swarm.host(info.peer_id, i % PEERS, info)
        for i, raw in enumerate(hostile):
            swarm.host(raw["_subkey"], i % PEERS, raw)
        swarm.announce_all(BLOCKS, expiration=300.0, hostile_expiration=300.0)
        client = swarm.client()
        seen = lambda: {s.peer_id for s in fetch_servers(client, MODEL, BLOCKS)}  # noqa: E731
        before = seen()
        victims = list(range(PEERS - PEERS // 5, PEERS))  # never the client's entry point
        alive = {info.peer_id for i, info in enumerate(honest) if i % PEERS not in victims}
        swarm.vanish(victims)
        deadline = time.monotonic() + 120
        while not alive <= (after := seen()) and time.monotonic() < deadline:
            time.sleep(1)
        return {
            "honest": {i.peer_id for i in honest},
            "hostile": {r["_subkey"] for r in hostile},
            "before": before,
            "alive": alive,
            "after": after,
            "victims": len(victims),
        }
    finally:
        swarm.shutdown()


def test_ten_dht_peers_serve_every_record_and_survive_a_fifth_vanishing(child, tmp_path):
    facts = child.submit(scenario, str(tmp_path / "identities.msgpack")).result(timeout=540)
    assert len(facts["hostile"]) == 2 and len(facts["honest"]) == 18  # make_swarm(20, 61, seed=3)
    assert facts["before"] == facts["honest"]  # every valid record, none of the hostile ones
    assert facts["victims"] == 2
    missing = facts["alive"] - facts["after"]
    assert not missing, (
        f"{len(missing)} live servers no longer listed after {facts['victims']} of {PEERS} peers vanished"
    )
    assert facts["after"] <= facts["honest"]


def big_answers(keys: int, subkeys: int, value_bytes: int) -> dict:
    """Runs in a child process: one DHT peer holds ``keys`` block keys, each with ``subkeys``
    values of ``value_bytes``; a client-mode peer reads them all with the readers' lookup."""
    import asyncio

    from hivemind.dht.node import DHTNode
    from hivemind.utils import get_dht_time

    from protocol.dht_records import _get_many
    from protocol.records import block_key

    async def run() -> dict:
        server = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await DHTNode.create(initial_peers=await server.protocol.p2p.get_visible_maddrs(), client_mode=True)
        try:
            names = [block_key("big-model", block) for block in range(keys)]
            for subkey in range(subkeys):
                await server.store_many(
                    names,
                    [b"x" * value_bytes] * keys,
                    expiration_time=get_dht_time() + 300,
                    subkeys=[f"server-{subkey}"] * keys,
                )
            began = time.monotonic()
            found = await _get_many(None, client, names, latest=True)
            took = time.monotonic() - began
            complete = sum(1 for n in names if found.get(n) is not None and len(found[n].value) == subkeys)
            return {"keys": keys, "complete": complete, "seconds": round(took, 2)}
        finally:
            await client.shutdown()
            await server.shutdown()

    return asyncio.run(run())


def test_every_key_of_a_large_lookup_is_read(child):
    """16 block keys of 20 values of 60 KB (as Sybils could store: each below the validators' 64 KB
    cap). hivemind asks a peer for sqrt(keys) keys a request, 4 here, and an answer of 4.8 MB is
    past p2pd's 4 MiB per message: it never comes, and those keys read as missing. The readers
    look keys up 8 at a time, so a request asks for 2 (2.4 MB an answer)."""
    facts = child.submit(big_answers, 16, 20, 60_000).result(timeout=240)
    assert facts["complete"] == 16, facts
