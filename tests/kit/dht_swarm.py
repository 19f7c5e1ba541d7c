"""Real hivemind DHT peers on loopback, on one asyncio loop in a thread of this process, holding
signed server records (``tests/kit/synthetic_swarm.py``'s, with real RSA identities): what
``tests/network/test_dht_scale.py`` reads and ``benchmarks/dht_scale.py`` measures at larger sizes (its
worker processes each run one :class:`Swarm` of their share).

The client's ``fetch_servers`` and the hosts' ``announce`` are the real functions; they reach
their ``DHTNode`` through :class:`LoopDHT`, which runs their coroutines on the nodes' loop as
``hivemind.DHT.run_coroutine`` runs them in its own process. RSA keys take ~0.1-0.3 s each to
make, so they are made once and kept in ``KEYS_PATH``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from concurrent.futures import CancelledError, Future
from contextlib import suppress
from typing import Any, Callable, Optional, Sequence

import msgpack
import psutil
from hivemind.dht.node import DHTNode
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from protocol.dht_records import _store_many, announce
from protocol.identity import Identity
from protocol.records import MODELS_KEY, ServerInfo, block_key
from protocol.validation import PeerIdSignatureValidator
from tests.kit.synthetic_swarm import MODEL, SyntheticSwarm

KEYS_PATH = os.path.expanduser("~/.cache/specswarm/dht_scale_identities.msgpack")
LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]
NODE_OPTIONS = dict(
    wait_timeout=30.0, startup_timeout=90.0
)  # hivemind: pings time out after 3 s, p2pd start after 15 s: too short on a loaded machine


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
        self.add(servers)

    def add(self, servers: Sequence[Identity]) -> None:
        """Also sign for these servers (a worker learns the servers it hosts one by one)."""
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
        self._rss_before = psutil.Process().memory_info().rss  # before any node: what the peers add
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.peers: list[DHTNode] = []
        self.clients: list[DHTNode] = []
        self.maddrs: list[str] = []
        self.refreshing: dict[str, tuple[int, Any]] = {}  # server peer id -> (host index, record or raw dict)
        self._refresher: Optional[Future] = None
        self._vanished: set[int] = set()
        self._announcing: dict[int, set[Future]] = {}  # host index -> its announcements in flight
        self._hosts_lock = threading.Lock()  # between the refresh thread launching and vanish cancelling

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    @property
    def peer_count(self) -> int:
        return len(self.peers)

    def start_peers(self, count: int, batch: int = 4, initial_peers: Sequence[str] | None = None) -> None:
        """``count`` peers, ``batch`` at a time; the first bootstraps the rest, or (in a worker
        process) every one joins through ``initial_peers``, another process's first peer."""

        async def first() -> None:
            node = await DHTNode.create(record_validator=self.signer, host_maddrs=LOCALHOST, **NODE_OPTIONS)
            self.peers.append(node)
            self.maddrs = [str(m) for m in await node.get_visible_maddrs()]

        async def more(n: int) -> None:
            nodes = await asyncio.gather(
                *(
                    DHTNode.create(
                        initial_peers=self.maddrs, record_validator=self.signer, host_maddrs=LOCALHOST, **NODE_OPTIONS
                    )
                    for _ in range(n)
                )
            )
            self.peers.extend(nodes)

        if initial_peers is None:
            self.run(first())
        else:
            self.maddrs = list(initial_peers)
        while len(self.peers) < count:
            self.run(more(min(batch, count - len(self.peers))))

    def client(self) -> LoopDHT:
        node = self.run(
            DHTNode.create(
                initial_peers=self.maddrs, record_validator=ServersSigner(), client_mode=True, **NODE_OPTIONS
            )
        )
        self.clients.append(node)
        return LoopDHT(node, self.loop)

    def host(self, server: str, host: int, record: Any) -> None:
        """``peers[host]`` announces ``record`` (a ServerInfo, or a hostile raw dict) every period."""
        self.refreshing[server] = (host, record)

    def add_server(self, identity: Identity, host: int, info: ServerInfo, num_blocks: int, expiration: float) -> None:
        """A new server: ``peers[host]`` signs for it, announces it now (returning once stored) and
        then every period."""
        self.signer.add([identity])
        self.host(info.peer_id, host, info)
        announce(LoopDHT(self.peers[host], self.loop), info, expiration, num_blocks=num_blocks)

    def stop_hosting(self, server: str) -> None:
        """The server dies: its host no longer refreshes its record, which expires."""
        del self.refreshing[server]

    def announce_all(self, num_blocks: int, expiration: float, hostile_expiration: Optional[float] = None) -> None:
        """One refresh round of every hosted record, the hosts in parallel; the hostile records only
        with ``hostile_expiration`` (stored once for long: refreshing them all at the update period
        would cost this one process 61 signatures each per period, which no real attacker's
        signing slows down for anyone else)."""
        by_host: dict[int, list[Any]] = {}
        for host, record in list(self.refreshing.values()):
            if isinstance(record, ServerInfo) or hostile_expiration is not None:
                by_host.setdefault(host, []).append(record)
        futures = [
            self._announce(host, records, num_blocks, expiration, hostile_expiration or expiration)
            for host, records in by_host.items()
        ]
        for future in futures:
            with suppress(CancelledError):  # its host vanished mid-round (see vanish)
                future.result()

    def _announce(
        self, host: int, records: list[Any], num_blocks: int, expiration: float, hostile_expiration: float
    ) -> Future:
        """``peers[host]``'s stores of ``records``, launched on the loop (cancelled at once if the
        host has vanished since the round began)."""
        dht = LoopDHT(self.peers[host], self.loop)
        honest = [r for r in records if isinstance(r, ServerInfo)]
        hostile = [r for r in records if not isinstance(r, ServerInfo)]

        async def go() -> None:
            stores = [
                asyncio.wrap_future(announce(dht, info, expiration, wait=False, num_blocks=num_blocks))
                for info in honest
            ]
            for raw in hostile:  # under every block key the record claims (at most the model's)
                blocks = range(max(0, int(raw["start_block"])), min(int(raw["end_block"]), num_blocks))
                keys = [block_key(MODEL, b) for b in blocks] + [MODELS_KEY]
                subkeys = [raw["_subkey"]] * len(blocks) + [MODEL]
                values = [_without_subkey(raw)] * len(blocks) + [{"num_blocks": num_blocks}]
                stores.append(_store_many(None, self.peers[host], keys, subkeys, values, hostile_expiration))
            await asyncio.gather(*stores)

        with self._hosts_lock:
            future = asyncio.run_coroutine_threadsafe(go(), self.loop)
            if host in self._vanished:
                future.cancel()
            in_flight = self._announcing.setdefault(host, set())
            in_flight.add(future)
        future.add_done_callback(in_flight.discard)
        return future

    def keep_refreshing(self, num_blocks: int, period: float) -> None:
        """Every ``period``, a refresh round of every hosted record (as a server's upkeep does); a
        round slower than the period is reported, since records then expire between rounds."""

        def loop() -> None:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    self.announce_all(num_blocks, 3 * period)
                except Exception as e:  # a vanished host; the others go on
                    print(f"refresh round: {e!r}", file=sys.stderr, flush=True)
                took = time.monotonic() - began
                if took > period:
                    print(f"refresh round took {took:.1f} s, over the {period:g} s period", file=sys.stderr, flush=True)
                self._stop.wait(max(0.0, period - took))

        self._stop = threading.Event()
        self._refresh_thread = threading.Thread(target=loop, daemon=True)
        self._refresh_thread.start()

    def vanish(self, indices: Sequence[int]) -> None:
        """Kill these peers' p2pd at once (as a machine that loses power), then drop the nodes and
        cancel their announcements in flight: each of their RPCs would otherwise wait out
        ``wait_timeout`` on its dead daemon, and the refresh round waiting for them would let
        every live server's record of this process expire."""
        for i in indices:
            self.peers[i].p2p._child.kill()
        with self._hosts_lock:
            self._vanished.update(indices)
            for i in indices:
                for future in list(self._announcing.get(i, ())):
                    future.cancel()
        for server, (host, _) in list(self.refreshing.items()):
            if host in indices:
                del self.refreshing[server]

    def p2pd_processes(self, indices: Optional[Sequence[int]] = None) -> list[psutil.Process]:
        chosen = range(len(self.peers)) if indices is None else indices
        return [psutil.Process(self.peers[i].p2p._child.pid) for i in chosen]

    def python_growth(self) -> int:
        """Bytes this process grew by since before its first peer (the peers' Python share)."""
        return psutil.Process().memory_info().rss - self._rss_before

    def process_rss_mib(self) -> list[float]:
        """RSS of this process plus its peers' p2pds (MiB), as :meth:`ProcessSwarm.process_rss_mib`."""
        return [mib(psutil.Process().memory_info().rss + summed_rss(self.p2pd_processes()))]

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


def summed_rss(processes: Sequence[psutil.Process]) -> int:
    """Summed RSS of those of ``processes`` still running (a vanished peer's p2pd is not)."""
    total = 0
    for process in processes:
        with suppress(psutil.Error):
            total += process.memory_info().rss
    return total


def mib(size: float) -> float:
    return round(size / 2**20, 1)
