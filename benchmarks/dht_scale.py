"""The DHT at scale, for real: N hivemind DHT peers on loopback holding 1,000 server records.

    python -m benchmarks.dht_scale --peers 20                  # quick
    python -m benchmarks.dht_scale --peers 50 --servers 1000   # make bench-dht-scale

What runs: ``--peers`` hivemind ``DHTNode``s, each with its own libp2p daemon (p2pd) on
127.0.0.1, all in this one Python process (one asyncio loop in a thread: the fewest processes
hivemind allows, since every node needs its own p2pd), plus one client-mode ``DHTNode`` reading
them. The records are ``benchmarks/synthetic_swarm.py``'s (10% hostile), each signed by its own
server's RSA identity exactly as a server signs (``protocol.validation.PeerIdSignatureValidator``
over ``protocol.dht_records.announce``): a real swarm has one DHT peer per server, here each DHT
peer announces for ``servers / peers`` servers, refreshing them every ``--update-period`` seconds
(a server's default, 15 s; records live 3 periods). Hostile records are stored once, for an hour,
as their authors would, under every block key they claim.

Figures: memory per peer (its p2pd's RSS plus its share of this process's growth), the time of
one ``protocol.dht_records.fetch_servers`` of all 61 block keys (p50/p95) and the servers it
returns, bytes written per peer per minute (``wchar`` of the peers' p2pd processes while they
refresh: socket writes to other peers and to this process's control socket, so an upper bound),
how long until a new server is visible to the client and until a server that stopped refreshing
is gone, and what the client reads after 20% of the peers vanish at once (their p2pd killed).

The client's ``fetch_servers`` and the hosts' ``announce`` are the real functions; they reach
their ``DHTNode`` through :class:`LoopDHT`, which runs their coroutines on the nodes' loop as
``hivemind.DHT.run_coroutine`` runs them in its own process.

RSA keys for the servers take ~0.1-0.3 s each to make, so they are made once and kept in
``~/.cache/specswarm/dht_scale_identities.msgpack``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import msgpack
import psutil
from hivemind.dht.node import DHTNode
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.synthetic_swarm import MODEL, SyntheticSwarm, make_swarm
from protocol.dht_records import _store_many, announce, fetch_servers
from protocol.identity import Identity
from protocol.records import MODELS_KEY, ServerInfo, block_key
from protocol.validation import PeerIdSignatureValidator

KEYS_PATH = os.path.expanduser("~/.cache/specswarm/dht_scale_identities.msgpack")
UPDATE_PERIOD = 15.0  # server.server_config.ServerConfig's default
LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]
NODE_OPTIONS = dict(wait_timeout=30.0, startup_timeout=90.0)  # hivemind: pings time out after 3 s, p2pd start after 15 s: too short on a loaded machine


def identities(count: int, path: str = KEYS_PATH) -> list[Identity]:
    """``count`` RSA identities, made once and kept in ``path`` (0o600)."""
    keys: list[bytes] = []
    if os.path.exists(path):
        with open(path, "rb") as f:
            keys = msgpack.unpackb(f.read())
    if len(keys) < count:
        while len(keys) < count:
            pb = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
            keys.append(pb.SerializeToString())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(msgpack.packb(keys))
        os.replace(path + ".tmp", path)
    return [Identity(f"{path}[{i}]", raw) for i, raw in enumerate(keys[:count])]


class ServersSigner(PeerIdSignatureValidator):
    """Validates like every peer and signs for the servers this DHT peer announces for (a real
    server's validator signs for its one identity; the signature is the same)."""

    def __init__(self, servers: Sequence[Identity] = ()):
        super().__init__(None)
        self._signers = {}
        for identity in servers:
            signer = PeerIdSignatureValidator(identity)
            self._signers[signer._local_subkey] = signer

    def sign_value(self, record) -> bytes:
        signer = self._signers.get(record.subkey)
        return record.value if signer is None else signer.sign_value(record)


class LoopDHT:
    """``run_coroutine`` as ``hivemind.DHT`` offers it, for a ``DHTNode`` on the loop in ``loop``."""

    def __init__(self, node: DHTNode, loop: asyncio.AbstractEventLoop):
        self.node, self.loop = node, loop

    def run_coroutine(self, coro: Callable, return_future: bool = False) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro(self, self.node), self.loop)
        return future if return_future else future.result()

    def get(self, key: str, latest: bool = False) -> Any:
        return asyncio.run_coroutine_threadsafe(self.node.get(key, latest=latest), self.loop).result()


class Swarm:
    """DHT peers on one loop in a background thread; servers' records refreshed by their hosts."""

    def __init__(self, signer: ServersSigner):
        self.signer = signer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.peers: list[DHTNode] = []
        self.clients: list[DHTNode] = []
        self.maddrs: list[str] = []
        self.refreshing: dict[str, tuple[int, Any]] = {}  # server peer id -> (host index, record or raw dict)
        self._refresher: Optional[Future] = None

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def start_peers(self, count: int, batch: int = 4) -> None:
        async def first() -> None:
            node = await DHTNode.create(record_validator=self.signer, host_maddrs=LOCALHOST, **NODE_OPTIONS)
            self.peers.append(node)
            self.maddrs = [str(m) for m in await node.get_visible_maddrs()]

        async def more(n: int) -> None:
            nodes = await asyncio.gather(*(
                DHTNode.create(initial_peers=self.maddrs, record_validator=self.signer, host_maddrs=LOCALHOST, **NODE_OPTIONS)
                for _ in range(n)
            ))  # fmt: skip
            self.peers.extend(nodes)

        self.run(first())
        while len(self.peers) < count:
            self.run(more(min(batch, count - len(self.peers))))

    def client(self) -> LoopDHT:
        node = self.run(DHTNode.create(initial_peers=self.maddrs, record_validator=ServersSigner(), client_mode=True, **NODE_OPTIONS))
        self.clients.append(node)
        return LoopDHT(node, self.loop)

    def host(self, server: str, host: int, record: Any) -> None:
        """``peers[host]`` announces ``record`` (a ServerInfo, or a hostile raw dict) every period."""
        self.refreshing[server] = (host, record)

    def announce_all(self, num_blocks: int, expiration: float, hostile_expiration: Optional[float] = None) -> None:
        """One refresh round of every hosted record, the hosts in parallel; the hostile records only
        with ``hostile_expiration`` (stored once for long: refreshing them all at the update period
        would cost this one process 61 signatures each per period, which no real attacker's
        signing slows down for anyone else)."""
        by_host: dict[int, list[Any]] = {}
        for host, record in list(self.refreshing.values()):
            if isinstance(record, ServerInfo) or hostile_expiration is not None:
                by_host.setdefault(host, []).append(record)
        futures = [self._announce(host, records, num_blocks, expiration, hostile_expiration or expiration)
                   for host, records in by_host.items()]  # fmt: skip
        for future in futures:
            future.result()

    def _announce(self, host: int, records: list[Any], num_blocks: int, expiration: float, hostile_expiration: float) -> Future:
        dht = LoopDHT(self.peers[host], self.loop)
        honest = [r for r in records if isinstance(r, ServerInfo)]
        hostile = [r for r in records if not isinstance(r, ServerInfo)]

        async def go() -> None:
            stores = [asyncio.wrap_future(announce(dht, info, expiration, wait=False, num_blocks=num_blocks))
                      for info in honest]  # fmt: skip
            for raw in hostile:  # under every block key the record claims (at most the model's)
                blocks = range(max(0, int(raw["start_block"])), min(int(raw["end_block"]), num_blocks))
                keys = [block_key(MODEL, b) for b in blocks] + [MODELS_KEY]
                subkeys = [raw["_subkey"]] * len(blocks) + [MODEL]
                values = [_without_subkey(raw)] * len(blocks) + [{"num_blocks": num_blocks}]
                stores.append(_store_many(None, self.peers[host], keys, subkeys, values, hostile_expiration))
            await asyncio.gather(*stores)

        return asyncio.run_coroutine_threadsafe(go(), self.loop)

    def keep_refreshing(self, num_blocks: int, period: float) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    self.announce_all(num_blocks, 3 * period)
                except Exception as e:  # a vanished host; the others go on
                    print(f"refresh round: {e!r}", flush=True)
                self._stop.wait(max(0.0, period - (time.monotonic() - began)))

        self._stop = threading.Event()
        self._refresh_thread = threading.Thread(target=loop, daemon=True)
        self._refresh_thread.start()

    def vanish(self, indices: Sequence[int]) -> None:
        """Kill these peers' p2pd at once (as a machine that loses power), then drop the nodes."""
        for i in indices:
            self.peers[i].p2p._child.kill()
        for server, (host, _) in list(self.refreshing.items()):
            if host in indices:
                del self.refreshing[server]

    def p2pd_processes(self, indices: Optional[Sequence[int]] = None) -> list[psutil.Process]:
        chosen = range(len(self.peers)) if indices is None else indices
        return [psutil.Process(self.peers[i].p2p._child.pid) for i in chosen]

    def shutdown(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self._refresh_thread.join(timeout=60)
        for node in self.clients + self.peers:
            try:
                self.run(asyncio.wait_for(node.shutdown(), 10))
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _without_subkey(raw: dict) -> dict:
    return {k: v for k, v in raw.items() if k != "_subkey"}


def real_ids(swarm: SyntheticSwarm, ids: list[Identity]) -> tuple[list[ServerInfo], list[dict], dict[str, str]]:
    """The synthetic records with each synthetic peer id replaced by a real identity's."""
    names = sorted(set(swarm.raw) | set(swarm.places))
    real = {name: ids[i].peer_id.to_base58() for i, name in enumerate(names)}
    honest, hostile = [], []
    for subkey, raw in swarm.raw.items():
        raw = dict(raw)
        raw["peer_id"] = real.get(raw["peer_id"], raw["peer_id"])
        if isinstance(raw.get("next_pings"), dict):
            raw["next_pings"] = {real.get(p, p): rtt for p, rtt in raw["next_pings"].items()}
        if subkey in swarm.hostile:
            raw["_subkey"] = real[subkey]
            hostile.append(raw)
        else:
            honest.append(ServerInfo.from_dict(raw, swarm.num_blocks))
    return honest, hostile, real


def measure(peers: int, servers: int, blocks: int, fetches: int, period: float, seed: int, refresh: bool = True) -> dict:
    """Every figure of the module docstring; with ``refresh=False`` the records are stored once
    (for an hour) and the figures that need refreshing (bytes per minute, a dead server) are
    left out."""
    rng = random.Random(seed)
    synthetic = make_swarm(servers, blocks, seed=seed)
    ids = identities(servers + 1)
    honest, hostile, _ = real_ids(synthetic, ids[:servers])
    signer = ServersSigner(ids)
    me = psutil.Process()
    rss_before = me.memory_info().rss
    swarm = Swarm(signer)
    result: dict[str, Any] = {"peers": peers, "servers": servers, "blocks": blocks, "update_period_s": period if refresh else None}
    try:
        began = time.monotonic()
        swarm.start_peers(peers)
        result["start_s"] = round(time.monotonic() - began, 1)
        _progress(result)
        p2pd_rss = [p.memory_info().rss for p in swarm.p2pd_processes()]
        result["p2pd_rss_mib_mean"] = round(statistics.mean(p2pd_rss) / 2**20, 1)
        result["python_mib_per_peer"] = round((me.memory_info().rss - rss_before) / peers / 2**20, 1)
        for i, info in enumerate(honest):
            swarm.host(info.peer_id, i % peers, info)
        for i, raw in enumerate(hostile):
            swarm.host(raw["_subkey"], (len(honest) + i) % peers, raw)
        began = time.monotonic()
        swarm.announce_all(blocks, 3 * period if refresh else 3600.0, hostile_expiration=3600.0)
        result["first_announce_s"] = round(time.monotonic() - began, 1)
        _progress(result)
        if refresh:
            swarm.keep_refreshing(blocks, period)
        client = swarm.client()
        online = {s.peer_id for s in honest}
        times, seen = _fetch_times(client, blocks, fetches)
        result.update(_figures("fetch", times))
        result["fetch_servers_seen"] = len(seen)
        result["fetch_honest_announced"] = len(online)
        result["fetch_hostile_seen"] = len(seen - online)
        _progress(result)
        result.update(_poll_times(client, blocks))
        result["memory_per_peer_mib"] = round(result["p2pd_rss_mib_mean"] + (me.memory_info().rss - rss_before) / peers / 2**20, 1)
        if refresh:
            result["bytes_per_peer_per_min"] = _bytes_per_minute(swarm, period)
            _progress(result)
        result["new_server_visible_s"] = _new_server(swarm, client, ids[servers], blocks, period)
        _progress(result)
        if refresh:
            result["dead_server_gone_s"] = _dead_server(swarm, client, honest, blocks)
            _progress(result)
        result.update(_vanish(swarm, client, blocks, rng, fetches, period, refresh))
        result["load_average"] = round(os.getloadavg()[0], 1)
        result["commit"] = _commit()
    finally:
        swarm.shutdown()
    return result


def _fetch_times(client: LoopDHT, blocks: int, count: int) -> tuple[list[float], set[str]]:
    times, seen = [], set()
    for _ in range(count):
        began = time.monotonic()
        found = fetch_servers(client, MODEL, blocks)
        times.append(time.monotonic() - began)
        seen = {s.peer_id for s in found}
    return times, seen


def _poll_times(client: LoopDHT, blocks: int, count: int = 3) -> dict:
    """The dashboard's poll (registry, every block key, spot-check reports) against this DHT."""
    from swarm.dashboard.events import SwarmPolled
    from swarm.dashboard.poller import SwarmReader

    reader, times, servers = SwarmReader(client, known_blocks={MODEL: blocks}), [], 0
    for _ in range(count):
        began = time.monotonic()
        event = reader.poll()
        times.append(time.monotonic() - began)
        if isinstance(event, SwarmPolled):
            servers = sum(len(m.servers) for m in event.models)
    return {**_figures("dashboard_poll", times), "dashboard_poll_servers": servers}


def _bytes_per_minute(swarm: Swarm, period: float) -> int:
    """Bytes the peers' p2pd write per peer per minute, over whole refresh rounds (>= 60 s)."""
    procs = swarm.p2pd_processes()
    before = sum(p.io_counters().write_chars for p in procs)
    rounds = max(1, round(60 / period))
    time.sleep(rounds * period)
    after = sum(p.io_counters().write_chars for p in procs)
    return round((after - before) / len(procs) / (rounds * period / 60))


def _new_server(swarm: Swarm, client: LoopDHT, identity: Identity, blocks: int, period: float) -> float:
    """Seconds from a new server's first announcement until the client's fetch lists it."""
    peer = identity.peer_id.to_base58()
    swarm.signer._signers.update(ServersSigner([identity])._signers)
    info = ServerInfo(peer_id=peer, model=MODEL, start_block=0, end_block=4, throughput=20.0)
    began = time.monotonic()
    swarm.host(peer, 0, info)
    announce(LoopDHT(swarm.peers[0], swarm.loop), info, 3 * period, num_blocks=blocks)
    return _until(lambda: peer in {s.peer_id for s in fetch_servers(client, MODEL, blocks)}, began)


def _dead_server(swarm: Swarm, client: LoopDHT, honest: list[ServerInfo], blocks: int) -> float:
    """Seconds from a server's last refresh (it died) until the client's fetch no longer lists it."""
    victim = honest[0].peer_id
    del swarm.refreshing[victim]
    began = time.monotonic()  # it may have refreshed up to a period ago: this is an upper bound
    return _until(lambda: victim not in {s.peer_id for s in fetch_servers(client, MODEL, blocks)}, began)


def _vanish(swarm: Swarm, client: LoopDHT, blocks: int, rng: random.Random, fetches: int, period: float, refresh: bool) -> dict:
    """20% of the peers (never the first, the client's entry point) vanish at once."""
    victims = rng.sample(range(1, len(swarm.peers)), max(1, len(swarm.peers) // 5))
    alive = {s for s, (host, record) in swarm.refreshing.items() if host not in victims and isinstance(record, ServerInfo)}
    swarm.vanish(victims)
    times, seen = _fetch_times(client, blocks, fetches)
    out = {f"vanished_{k}": v for k, v in _figures("fetch", times).items()}
    out["vanished_peers"] = len(victims)
    out["vanished_live_servers_seen"] = len(alive & seen)
    out["vanished_live_servers"] = len(alive)
    if not refresh:
        return out
    time.sleep(period * 3)  # the vanished hosts' records expire; the survivors refresh theirs
    _, seen = _fetch_times(client, blocks, 1)
    out["vanished_after_expiry_live_seen"] = len(alive & seen)
    out["vanished_after_expiry_dead_seen"] = len(seen - alive)
    return out


def _progress(result: dict) -> None:
    print(f"  ... {json.dumps(result)}", file=sys.stderr, flush=True)


def _until(condition: Callable[[], bool], began: float, timeout: float = 180.0) -> float:
    while not condition():
        if time.monotonic() - began > timeout:
            return float("inf")
        time.sleep(0.5)
    return round(time.monotonic() - began, 1)


def _figures(name: str, times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        f"{name}_s_p50": round(statistics.median(ordered), 3),
        f"{name}_s_p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
    }


def _commit() -> str:
    from benchmarks.wan import _commit as commit

    return commit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=20)
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=61)
    parser.add_argument("--fetches", type=int, default=10)
    parser.add_argument("--update-period", type=float, default=UPDATE_PERIOD)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-refresh", action="store_true", help="store the records once (for an hour)")
    parser.add_argument("--out", help="also write the JSON object to this file")
    args = parser.parse_args()
    result = measure(args.peers, args.servers, args.blocks, args.fetches, args.update_period, args.seed, not args.no_refresh)
    for key, value in result.items():
        print(f"  {key}: {value}")
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
