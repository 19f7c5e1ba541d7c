"""The DHT at scale, for real: N hivemind DHT peers on loopback holding 1,000 server records.

    python -m benchmarks.dht_scale --peers 20                  # quick
    python -m benchmarks.dht_scale --peers 50 --servers 1000   # make bench-dht-scale

What runs: ``--peers`` hivemind ``DHTNode``s, each with its own libp2p daemon (p2pd) on
127.0.0.1, spread over ``--processes`` Python processes (default: one per 10 peers), each running
its share of the nodes on one asyncio loop in a thread, plus one client-mode ``DHTNode`` in this
process reading them. One process is this one (:class:`Swarm`); more are spawned workers
(:class:`ProcessSwarm`): with refreshing on, every RSA signature and validation of a process's
peers runs on its one loop, and 12 peers saturated one loop (a fetch took 41 s and saw no
server); a real swarm has one process per host. The records are
``tests/kit/synthetic_swarm.py``'s (10% hostile), each signed by its own server's RSA identity
exactly as a server signs (``protocol.validation.PeerIdSignatureValidator`` over
``protocol.dht_records.announce``): a real swarm has one DHT peer per server, here each DHT peer
announces for ``servers / peers`` servers, refreshing them every ``--update-period`` seconds (a
server's default, 15 s; records live 3 periods). Hostile records are stored once, for an hour, as
their authors would, under every block key they claim.

Figures: memory per peer (its p2pd's RSS plus its share of the peers' Python processes' growth;
each process's RSS with its p2pds' is listed too), the time of one
``protocol.dht_records.fetch_servers`` of all 61 block keys (p50/p95) and the servers it
returns, bytes written per peer per minute (``wchar`` of the peers' p2pd processes while they
refresh: socket writes to other peers and to their process's control socket, so an upper bound),
how long until a new server is visible to the client and until a server that stopped refreshing
is gone, and what the client reads after 20% of the peers vanish at once (their p2pd killed).

The client's ``fetch_servers`` and the hosts' ``announce`` are the real functions; they reach
their ``DHTNode`` through :class:`LoopDHT`, which runs their coroutines on the nodes' loop as
``hivemind.DHT.run_coroutine`` runs them in its own process.

Each p2pd is a Go program of ~55 MiB at 12 peers, ~75 MiB at 100 and ~100 MiB at 200 (its
connections), so 200 do not fit in 23 GiB beside their workers (docs/scale.md). ``GOMEMLIMIT``
in the environment (the Go runtime's soft limit, inherited by every p2pd hivemind starts) trades
memory for collections; below the working set (64 MiB at 200 peers) the runtime collects without
pause and the daemons take the CPU. The JSON records the value (``gomemlimit``).

RSA keys for the servers take ~0.1-0.3 s each to make, so they are made once and kept in
``~/.cache/specswarm/dht_scale_identities.msgpack``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import os
import random
import signal
import statistics
import sys
import threading
import time
import traceback
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

import psutil

from protocol.dht_records import fetch_servers
from protocol.identity import Identity
from protocol.records import ServerInfo
from tests.kit.dht_swarm import LoopDHT, ServersSigner, Swarm, identities, mib, real_ids, summed_rss
from tests.kit.synthetic_swarm import MODEL, make_swarm

UPDATE_PERIOD = 15.0  # server.server_config.ServerConfig's default
PEERS_PER_PROCESS = 10  # the default --processes: about one worker process per this many peers
WORKER_TIMEOUT = 1800.0  # seconds a worker may take to answer a command (starting its peers on a loaded machine)


def default_processes(peers: int) -> int:
    """One process up to ``PEERS_PER_PROCESS`` peers, else about one per that many: one loop can
    sign and validate for about that many refreshing peers, and a real swarm has one per host."""
    return 1 if peers <= PEERS_PER_PROCESS else math.ceil(peers / PEERS_PER_PROCESS)


class ProcessSwarm:
    """The same swarm as :class:`Swarm`, its peers spread over worker processes (each a
    :class:`Swarm` of its share, refreshing its share of the records), so that no one loop signs
    and validates for every peer. This process keeps the client and every measurement; peers and
    hosts are numbered across the workers (worker 0 holds peers ``0..``, the entry point)."""

    def __init__(self, servers: Sequence[Identity], processes: int):
        self._identities = {identity.peer_id.to_base58(): identity for identity in servers}
        self._processes = processes
        self._client = Swarm(ServersSigner())  # no peers: the client's loop, here
        self.workers: list[_WorkerHandle] = []
        self._offsets: list[int] = []  # global index of each worker's first peer
        self._p2pd: list[list[psutil.Process]] = []  # per worker, per local peer
        self._rss_before: list[int] = []  # each worker's RSS before its first peer
        self.refreshing: dict[str, tuple[int, Any]] = {}  # server peer id -> (global host index, record)

    @property
    def peer_count(self) -> int:
        return sum(len(p2pds) for p2pds in self._p2pd)

    def start_peers(self, count: int, batch: int = 4) -> None:
        """Worker 0 starts first (its first peer is everyone's entry point), then the others at
        once, each fewer at a time so that about ``2 * batch`` p2pd start together."""
        sizes = _shares(count, min(self._processes, count))
        self._offsets = [sum(sizes[:w]) for w in range(len(sizes))]
        context = multiprocessing.get_context("spawn")  # never fork a process running hivemind
        self.workers = [_WorkerHandle(context, w) for w in range(len(sizes))]  # they import at once
        entry, pids, rss_before = self.workers[0].call("start", sizes[0], None, batch)
        self._started(pids, rss_before)
        self._client.maddrs = entry
        rest = self.workers[1:]
        for worker, size in zip(rest, sizes[1:]):
            worker.send("start", size, entry, max(1, 2 * batch // len(rest)))
        for worker in rest:
            _, pids, rss_before = worker.receive()
            self._started(pids, rss_before)

    def _started(self, pids: list[int], rss_before: int) -> None:
        self._p2pd.append([psutil.Process(pid) for pid in pids])
        self._rss_before.append(rss_before)

    def _locate(self, host: int) -> tuple[_WorkerHandle, int]:
        """The worker holding global peer ``host``, and its index there."""
        w = bisect.bisect_right(self._offsets, host) - 1
        return self.workers[w], host - self._offsets[w]

    def client(self) -> LoopDHT:
        return self._client.client()

    def host(self, server: str, host: int, record: Any) -> None:
        """Global peer ``host`` signs for ``server`` and announces ``record`` every period."""
        worker, local = self._locate(host)
        worker.call("host", server, local, record, self._identities.get(server))
        self.refreshing[server] = (host, record)

    def add_server(self, identity: Identity, host: int, info: ServerInfo, num_blocks: int, expiration: float) -> None:
        """As :meth:`Swarm.add_server`, on the worker holding ``host``; returns once stored."""
        worker, local = self._locate(host)
        self._identities[info.peer_id] = identity
        worker.call("add_server", identity, local, info, num_blocks, expiration)
        self.refreshing[info.peer_id] = (host, info)

    def stop_hosting(self, server: str) -> None:
        host, _ = self.refreshing.pop(server)
        worker, _ = self._locate(host)
        worker.call("stop_hosting", server)

    def announce_all(self, num_blocks: int, expiration: float, hostile_expiration: float | None = None) -> None:
        """One refresh round of every hosted record, every worker at once (see :meth:`Swarm.announce_all`)."""
        self._everywhere("announce_all", num_blocks, expiration, hostile_expiration)

    def keep_refreshing(self, num_blocks: int, period: float) -> None:
        self._everywhere("keep_refreshing", num_blocks, period)

    def _everywhere(self, command: str, *args: Any) -> None:
        for worker in self.workers:
            worker.send(command, *args)
        for worker in self.workers:
            worker.receive()

    def vanish(self, indices: Sequence[int]) -> None:
        """Kill these peers' p2pd at once (every worker told before any answers), drop their servers."""
        by_worker: dict[int, list[int]] = {}
        for host in indices:
            worker, local = self._locate(host)
            by_worker.setdefault(worker.index, []).append(local)
        for w, local in by_worker.items():
            self.workers[w].send("vanish", local)
        for w in by_worker:
            self.workers[w].receive()
        for server, (host, _) in list(self.refreshing.items()):
            if host in indices:
                del self.refreshing[server]

    def p2pd_processes(self, indices: Sequence[int] | None = None) -> list[psutil.Process]:
        every = [p for p2pds in self._p2pd for p in p2pds]
        return every if indices is None else [every[i] for i in indices]

    def python_growth(self) -> int:
        """Bytes the workers grew by since before their first peer (the peers' Python share)."""
        return sum(summed_rss([w.psutil]) - before for w, before in zip(self.workers, self._rss_before))

    def process_rss_mib(self) -> list[float]:
        """RSS of each worker plus its p2pds (MiB)."""
        return [mib(summed_rss([w.psutil] + p2pds)) for w, p2pds in zip(self.workers, self._p2pd)]

    def shutdown(self) -> None:
        """Ask every worker to shut its nodes down; then terminate (kill) the ones still there
        and kill any p2pd left behind (a worker that died leaves its p2pds to init)."""
        leftovers = [p for p2pds in self._p2pd for p in p2pds]
        try:
            for worker in self.workers:
                leftovers += worker.children()
                with suppress(OSError, ValueError):
                    worker.send("shutdown")
            for worker in self.workers:
                worker.process.join(timeout=120)
        finally:
            for worker in self.workers:
                worker.stop()
            for process in leftovers:
                with suppress(psutil.Error):
                    process.kill()
            self._client.shutdown()


def _shares(count: int, parts: int) -> list[int]:
    """``count`` split into ``parts`` near-equal shares, the larger first."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


class WorkerError(RuntimeError):
    """A worker process failed a command or exited."""


class _WorkerHandle:
    """One worker process and the pipe it takes commands on (one at a time, in order)."""

    def __init__(self, context: Any, index: int):
        self.index = index
        self.conn, theirs = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(theirs, os.getpid()), name=f"dht-worker-{index}", daemon=True
        )
        self.process.start()
        theirs.close()  # so that our recv sees EOF when the worker exits
        self.psutil = psutil.Process(self.process.pid)

    def send(self, command: str, *args: Any) -> None:
        self.conn.send((command, args))

    def receive(self, timeout: float = WORKER_TIMEOUT) -> Any:
        try:
            if not self.conn.poll(timeout):
                raise WorkerError(f"worker {self.index}: no answer within {timeout:.0f} s")
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerError(f"worker {self.index} exited ({self.process.exitcode})") from e
        if status != "ok":
            raise WorkerError(f"worker {self.index}: {value}")
        return value

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive()

    def children(self) -> list[psutil.Process]:
        """Its processes (its p2pds), to kill should it leave them behind."""
        with suppress(psutil.Error):
            return self.psutil.children(recursive=True)
        return []

    def stop(self) -> None:
        """Terminate the worker if it is still there (it kills its p2pds on SIGTERM), then kill it."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class _Worker:
    """What a worker process does on its parent's commands: a :class:`Swarm` of its share of the
    peers, signing for the servers it hosts (it learns them with each ``host``)."""

    COMMANDS = frozenset(
        {"start", "host", "add_server", "stop_hosting", "announce_all", "keep_refreshing", "vanish", "shutdown"}
    )

    def __init__(self) -> None:
        self.swarm = Swarm(ServersSigner())

    def start(self, count: int, initial_peers: list[str] | None, batch: int) -> tuple[list[str], list[int], int]:
        """Its peers; answers the first peer's addresses, the p2pd pids and its RSS before."""
        rss_before = psutil.Process().memory_info().rss
        self.swarm.start_peers(count, batch, initial_peers)
        return self.swarm.maddrs, [p.pid for p in self.swarm.p2pd_processes()], rss_before

    def host(self, server: str, local: int, record: Any, identity: Identity | None) -> None:
        if identity is not None:
            self.swarm.signer.add([identity])
        self.swarm.host(server, local, record)

    def add_server(self, identity: Identity, local: int, info: ServerInfo, num_blocks: int, expiration: float) -> None:
        self.swarm.add_server(identity, local, info, num_blocks, expiration)

    def stop_hosting(self, server: str) -> None:
        self.swarm.stop_hosting(server)

    def announce_all(self, num_blocks: int, expiration: float, hostile_expiration: float | None) -> None:
        self.swarm.announce_all(num_blocks, expiration, hostile_expiration)

    def keep_refreshing(self, num_blocks: int, period: float) -> None:
        self.swarm.keep_refreshing(num_blocks, period)

    def vanish(self, local: list[int]) -> None:
        self.swarm.vanish(local)

    def shutdown(self) -> None:
        self.swarm.shutdown()


def _worker_main(conn: Connection, parent: int) -> None:
    """A worker process: serves commands until ``shutdown``, its parent's end of the pipe closing,
    SIGTERM or its parent's death; its p2pds never outlive it (hivemind leaves them running when
    its process is killed, and they hold ~60 MiB each)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwinds to the finally below
    threading.Thread(target=_exit_with_parent, args=(parent,), name="exit-with-parent", daemon=True).start()
    try:
        _serve(conn, _Worker())
    finally:
        _kill_children()


def _serve(conn: Connection, worker: _Worker) -> None:
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):  # the parent closed its end, or died
            return
        try:
            if command not in _Worker.COMMANDS:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", getattr(worker, command)(*args)))
        except Exception:  # noqa: BLE001  the parent raises it; this worker serves on (or is shut down)
            conn.send(("error", traceback.format_exc()))
        if command == "shutdown":
            return


def _exit_with_parent(parent: int, every: float = 1.0) -> None:
    """Polls for the parent's death (a SIGKILL leaves no time to tell anyone): then kill the
    p2pds and exit at once."""
    while os.getppid() == parent:
        time.sleep(every)
    _kill_children()
    os._exit(1)


def _kill_children() -> None:
    for child in psutil.Process().children(recursive=True):
        with suppress(psutil.Error):
            child.kill()


AnySwarm = Swarm | ProcessSwarm


def measure(
    peers: int,
    servers: int,
    blocks: int,
    fetches: int,
    period: float,
    seed: int,
    refresh: bool = True,
    processes: int | None = None,
) -> dict:
    """Every figure of the module docstring; with ``refresh=False`` the records are stored once
    (for an hour) and the figures that need refreshing (bytes per minute, a dead server) are
    left out. ``processes`` (default :func:`default_processes`) hold the peers: one is this
    process itself (:class:`Swarm`), more are workers (:class:`ProcessSwarm`)."""
    rng = random.Random(seed)
    synthetic = make_swarm(servers, blocks, seed=seed)
    ids = identities(servers + 1)
    honest, hostile, _ = real_ids(synthetic, ids[:servers])
    processes = max(1, min(peers, default_processes(peers) if processes is None else processes))
    swarm: AnySwarm = Swarm(ServersSigner(ids)) if processes == 1 else ProcessSwarm(ids, processes)
    result: dict[str, Any] = {
        "peers": peers,
        "servers": servers,
        "blocks": blocks,
        "processes": processes,
        "update_period_s": period if refresh else None,
        "gomemlimit": os.environ.get("GOMEMLIMIT"),  # the Go runtime's soft memory limit, inherited by every p2pd
    }
    try:
        began = time.monotonic()
        swarm.start_peers(peers)
        result["start_s"] = round(time.monotonic() - began, 1)
        _progress(result)
        p2pd_rss = [p.memory_info().rss for p in swarm.p2pd_processes()]
        result["p2pd_rss_mib_mean"] = mib(statistics.mean(p2pd_rss))
        result["python_mib_per_peer"] = mib(swarm.python_growth() / peers)
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
        result["memory_per_peer_mib"] = round(result["p2pd_rss_mib_mean"] + swarm.python_growth() / peers / 2**20, 1)
        result["process_rss_mib"] = swarm.process_rss_mib()
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


def _bytes_per_minute(swarm: AnySwarm, period: float) -> int:
    """Bytes the peers' p2pd write per peer per minute, over whole refresh rounds (>= 60 s)."""
    procs = swarm.p2pd_processes()
    before = sum(p.io_counters().write_chars for p in procs)
    rounds = max(1, round(60 / period))
    time.sleep(rounds * period)
    after = sum(p.io_counters().write_chars for p in procs)
    return round((after - before) / len(procs) / (rounds * period / 60))


def _new_server(swarm: AnySwarm, client: LoopDHT, identity: Identity, blocks: int, period: float) -> float:
    """Seconds from a new server's first announcement until the client's fetch lists it."""
    peer = identity.peer_id.to_base58()
    info = ServerInfo(peer_id=peer, model=MODEL, start_block=0, end_block=4, throughput=20.0)
    began = time.monotonic()
    swarm.add_server(identity, 0, info, blocks, 3 * period)
    return _until(lambda: peer in {s.peer_id for s in fetch_servers(client, MODEL, blocks)}, began)


def _dead_server(swarm: AnySwarm, client: LoopDHT, honest: list[ServerInfo], blocks: int) -> float:
    """Seconds from a server's last refresh (it died) until the client's fetch no longer lists it."""
    victim = honest[0].peer_id
    swarm.stop_hosting(victim)
    began = time.monotonic()  # it may have refreshed up to a period ago: this is an upper bound
    return _until(lambda: victim not in {s.peer_id for s in fetch_servers(client, MODEL, blocks)}, began)


def _vanish(
    swarm: AnySwarm, client: LoopDHT, blocks: int, rng: random.Random, fetches: int, period: float, refresh: bool
) -> dict:
    """20% of the peers (never the first, the client's entry point) vanish at once."""
    victims = rng.sample(range(1, swarm.peer_count), max(1, swarm.peer_count // 5))
    alive = {
        s for s, (host, record) in swarm.refreshing.items() if host not in victims and isinstance(record, ServerInfo)
    }
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
    parser.add_argument("--processes", type=int, help="processes holding the peers (default: 1 per 10 peers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-refresh", action="store_true", help="store the records once (for an hour)")
    parser.add_argument("--out", help="also write the JSON object to this file")
    args = parser.parse_args()
    sizes = (args.peers, args.servers, args.blocks, args.fetches)
    result = measure(*sizes, args.update_period, args.seed, not args.no_refresh, args.processes)
    for key, value in result.items():
        print(f"  {key}: {value}")
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
