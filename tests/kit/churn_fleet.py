"""The churn run's fleet (who is alive, what each kill left behind) and its monitor (coverage,
joining servers, the dashboard's poll), split from tests/kit/churn.py so each file has one job."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import psutil

from swarm.local import LocalSwarm, kill_group

if TYPE_CHECKING:
    from tests.kit.churn import ChurnConfig

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
ORPHAN_WAIT_S = 10.0  # swarm/lifeline.py: a killed server's DHT process and p2pd exit within this


@dataclass
class Fleet:
    """The swarm's servers by name, who is alive, and what each kill left behind."""

    swarm: LocalSwarm
    config: ChurnConfig
    rng: random.Random
    alive: dict[str, subprocess.Popen] = field(default_factory=dict)
    sessions: list[int] = field(default_factory=list)  # every session id started here (each process is its own)
    started_at: dict[str, float] = field(default_factory=dict)
    online_after: list[float] = field(default_factory=list)  # seconds from start to ONLINE, per joining server
    kills: dict[str, int] = field(default_factory=lambda: {name: 0 for name in SIGNALS})
    orphans_after_kill: int = 0
    count: int = 0
    _reapers: list[threading.Thread] = field(default_factory=list)

    def join(self, span: Optional[tuple[int, int]] = None) -> str:
        name = f"churn-{self.count}"
        self.count += 1
        if span is None:
            process = self.swarm.start_server(None, self.rng.randint(*self.config.num_blocks), name=name)
        else:
            process = self.swarm.start_server(*span, name=name)
        self.alive[name] = process
        self.sessions.append(process.pid)
        self.started_at[name] = time.monotonic()
        return name

    def leave(self, spans: dict[str, tuple[int, int]]) -> Optional[tuple[str, str]]:
        """SIGKILL or SIGTERM a random alive server; ``spans``: the ONLINE alive servers' spans, for
        ``keep_coverage`` (with it and no server to spare, nobody leaves this round)."""
        candidates = sorted(self.alive)
        if self.config.keep_coverage:
            candidates = [
                n
                for n in candidates
                if n in spans
                and all(
                    any(other != n and s <= b < e for other, (s, e) in spans.items() if other in self.alive)
                    for b in range(*spans[n])
                )
            ]
            if not candidates:
                return None
        name = self.rng.choice(candidates)
        how = self.rng.choice(sorted(SIGNALS))
        process = self.alive.pop(name)
        self.started_at.pop(name, None)
        process.send_signal(SIGNALS[how])
        self.kills[how] += 1
        reaper = threading.Thread(target=self._reap, args=(process, how), daemon=True)
        reaper.start()
        self._reapers.append(reaper)
        return name, how

    def _reap(self, process, how: str) -> None:
        """After a SIGKILL, count what of its session outlived it by ORPHAN_WAIT_S; then reap the group
        (a SIGTERMed server gets its drain time first). The count is read early once the session has
        no member but the killed server (an exited process does not come back), so a clean kill is
        not waited out."""
        if how == "SIGKILL":
            deadline = time.monotonic() + ORPHAN_WAIT_S
            while True:
                left = [p for p in session_members(process.pid) if p.pid != process.pid]
                if not left or time.monotonic() >= deadline:
                    break
                time.sleep(0.5)
            self.orphans_after_kill += len(left)
        else:
            try:
                process.wait(timeout=self.config.drain_seconds + 30)
            except Exception:
                pass
        kill_group(process)

    def mark_online(self, names: set[str]) -> None:
        for name in list(self.started_at):  # the monitor's thread; leave() may pop a name meanwhile
            began = self.started_at.pop(name, None) if name in names else None
            if began is not None:
                self.online_after.append(time.monotonic() - began)

    def finish_reaping(self) -> None:
        for reaper in self._reapers:
            reaper.join(timeout=60)


def session_members(sid: int) -> list[psutil.Process]:
    """Live processes of session ``sid`` (found by session id, never by name)."""
    members = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return members


class Monitor(threading.Thread):
    """Every ``check_every`` s: which blocks an alive, ONLINE server covers (time without full
    coverage, to that resolution), which joining servers are online; every ``poll_every`` s: the
    dashboard's poll and its state URL. Each check searches every block's key, so checking every
    second was itself a large share of a big swarm's DHT traffic on one machine."""

    def __init__(self, swarm: LocalSwarm, fleet: Fleet, poll_every: float, check_every: float = 1.0):
        super().__init__(daemon=True)
        from protocol.dht import make_dht

        self.swarm, self.fleet, self.poll_every, self.check_every = swarm, fleet, poll_every, check_every
        self.dht = make_dht(initial_peers=swarm.initial_peers, client_mode=True)
        self.stop = threading.Event()
        self.counting = False  # coverage counts only while the churn runs
        self.uncovered_s = 0.0
        self.covered = False
        self.spans: dict[str, tuple[int, int]] = {}  # alive ONLINE server -> its span, at the last read
        self.poll_s: list[float] = []
        self.state_s: list[float] = []
        self.poll_servers: list[int] = []
        self.poll_errors: list[str] = []

    def run(self) -> None:
        last, last_poll = time.monotonic(), float("-inf")
        while not self.stop.is_set():
            try:
                covered = self.check()
            except Exception as e:  # a slow DHT read: counts as not known to be covered
                print(f"monitor: {e!r}", file=sys.stderr, flush=True)
                covered = False
            now = time.monotonic()
            if self.counting and not covered:
                self.uncovered_s += now - last
            last, self.covered = now, covered
            if self.counting and now - last_poll >= self.poll_every:
                last_poll = now
                try:
                    self.dashboard()
                except Exception as e:  # a slow page: recorded, the coverage count goes on
                    self.poll_errors.append(f"{type(e).__name__}: {e}")
            self.stop.wait(self.check_every)

    def check(self) -> bool:
        from protocol.dht_records import fetch_servers
        from protocol.records import ServerState

        infos = fetch_servers(self.dht, self.swarm.dht_name, self.swarm.num_blocks)
        online = {i.public_name for i in infos if i.state == ServerState.ONLINE}
        self.fleet.mark_online(online)
        spans = {
            i.public_name: (i.start_block, i.end_block)
            for i in infos
            if i.state == ServerState.ONLINE and i.public_name in self.fleet.alive
        }
        self.spans = spans
        blocks = {b for start, end in spans.values() for b in range(start, end)}
        return len(blocks) == self.swarm.num_blocks

    def dashboard(self) -> None:
        from swarm.dashboard.events import SwarmPolled
        from swarm.dashboard.poller import SwarmReader

        began = time.monotonic()
        event = SwarmReader(self.dht, known_blocks={self.swarm.dht_name: self.swarm.num_blocks}).poll()
        self.poll_s.append(time.monotonic() - began)
        if isinstance(event, SwarmPolled):
            self.poll_servers.append(sum(len(m.servers) for m in event.models))
        if self.swarm.dashboard_url:
            began = time.monotonic()
            with urllib.request.urlopen(self.swarm.dashboard_url.rstrip("/") + "/api/v1/state", timeout=60) as r:
                r.read()
            self.state_s.append(time.monotonic() - began)

    def wait_covered(self, timeout: float) -> Optional[float]:
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.covered:
                return time.monotonic() - began
            time.sleep(0.5)
        return None

    def shutdown(self) -> None:
        self.stop.set()
        self.join(timeout=30)
        self.dht.shutdown()
