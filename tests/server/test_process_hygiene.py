"""Nothing we start outlives us (issues #14, #18; ``swarm/lifeline.py``): a ``swarm.local``
launcher, server, bootstrap or dashboard killed with SIGKILL leaves no process behind within 10 s,
its hivemind DHT process and libp2p daemon included.

Processes are found by parentage (collected before the kill) and by session id (every process
here is started in its own session), never by name, so other swarms on the machine do not
matter. Each test kills every session it started when it ends, even when it fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from swarm import lifeline

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN = 10.0  # seconds, from the SIGKILL to the last process of the tree
START_TIMEOUT = 150.0


class Started:
    """A ``python -m`` process in its own session, stdout and stderr in files under ``log_dir``."""

    def __init__(self, args: list[str], log_dir: Path, name: str):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out, self.log = log_dir / f"{name}.out", log_dir / f"{name}.log"
        with open(self.out, "w") as out, open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", *args],
                stdout=out,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=REPO,
                env=lifeline.child_env(),
            )

    def wait_for(self, ready: Callable[[str, str], bool], timeout: float = START_TIMEOUT) -> str:
        """Wait until ready(stdout, stderr) holds; return stdout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out, log = self.out.read_text(), self.log.read_text()
            if ready(out, log):
                return out
            if self.process.poll() is not None:
                pytest.fail(f"{self.process.args[2]} exited with {self.process.returncode}:\n{log[-3000:]}")
            time.sleep(0.2)
        pytest.fail(f"{self.process.args[2]} not ready within {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")


@contextlib.contextmanager
def cleanup(*started: Started):
    """On the way out (passed or failed) SIGKILL every session these processes started, and every
    descendant seen by the test."""
    tracked: list[psutil.Process] = []
    try:
        yield tracked
    finally:
        sessions = {s.process.pid for s in started}  # each is its own session's leader
        for process in tracked + _in_sessions(sessions):
            with contextlib.suppress(psutil.Error):
                process.kill()
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for s in started:
            s.process.wait()


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _alive(process: psutil.Process) -> bool:
    try:  # is_running() also tells a reused pid from the process we saw
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _in_sessions(sessions: set[int]) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(process.pid) in sessions and _alive(process):
                found.append(process)
    return found


def kill_and_expect_nothing_left(victim: subprocess.Popen, tree: list[psutil.Process]) -> None:
    """SIGKILL the victim alone, then wait up to GONE_WITHIN s for its whole tree (and every
    process in those sessions) to go."""
    sessions = {os.getsid(p.pid) for p in tree}
    assert os.getsid(0) not in sessions  # never pytest's own session
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = time.monotonic()
    left: list[psutil.Process] = []
    while time.monotonic() - killed_at < GONE_WITHIN:
        left = [p for p in tree if _alive(p)] + [p for p in _in_sessions(sessions) if p not in tree]
        if not left:
            return
        time.sleep(0.2)
    described = [(p.pid, p.ppid(), " ".join(p.cmdline())[:100]) for p in left if _alive(p)]
    pytest.fail(f"{len(described)} processes outlived the SIGKILL by {GONE_WITHIN:.0f} s: {described}")


@pytest.fixture(scope="module")
def bootstrap_peers(tmp_path_factory):
    """A bootstrap node (the CLI) for the server and dashboard tests; its multiaddr."""
    node = Started(
        ["swarm.bootstrap", "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"],
        tmp_path_factory.mktemp("bootstrap"),
        "bootstrap",
    )
    with cleanup(node):
        yield [node.wait_for(lambda out, _: out.endswith("\n")).split()[0]]


def test_sigkilled_launcher_leaves_no_process_of_its_swarm(tiny_llama_path, tmp_path):
    """Bootstrap, 3 servers (behind delay proxies, threads of the launcher) and dashboard, each with
    a DHT process and p2pd: all gone within 10 s of a SIGKILL to ``python -m swarm.local``. (The
    gateway, ``--api-port``, goes the same way; it is left out to keep the test short.)"""
    launcher = Started(
        [
            "swarm.local",
            "--model",
            str(tiny_llama_path),
            "--servers",
            "3",
            "--hop-delay-ms",
            "5",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        tmp_path,
        "launcher",
    )
    with cleanup(launcher) as tracked:
        launcher.wait_for(lambda out, _: "Press Ctrl-C to stop." in out)
        tree = _tree(launcher.process.pid)
        tracked += tree
        # the bootstrap, 3 servers and the dashboard, each its own session: forks of the launcher's
        # forkserver (swarm/warm_start.py), or its children under SPECSWARM_COLD_START=1
        leaders = [c for c in tree[1:] if os.getsid(c.pid) == c.pid and "torch_shm" not in c.name()]
        assert len(leaders) >= 5, tree
        assert len(tree) >= 1 + 3 * 5, tree  # each of those 5 with a DHT process and a p2pd
        kill_and_expect_nothing_left(launcher.process, tree)


def _kill_one_cli(started: Started, ready: Callable[[str, str], bool], tracked: list) -> None:
    started.wait_for(ready)
    tree = _tree(started.process.pid)
    tracked += tree
    assert len(tree) >= 3, tree  # the CLI, its DHT process, the DHT's p2pd
    kill_and_expect_nothing_left(started.process, tree)


def test_sigkilled_bootstrap_leaves_no_dht_process_or_p2pd(tmp_path):
    node = Started(["swarm.bootstrap", "--host", "127.0.0.1", "--port", "0"], tmp_path, "bootstrap")
    with cleanup(node) as tracked:
        _kill_one_cli(node, lambda out, _: out.endswith("\n"), tracked)


def test_sigkilled_dashboard_leaves_no_dht_process_or_p2pd(bootstrap_peers, tmp_path):
    dashboard = Started(
        ["swarm.dashboard", "--initial-peers", *bootstrap_peers, "--host", "127.0.0.1", "--port", "0"],
        tmp_path,
        "dashboard",
    )
    with cleanup(dashboard) as tracked:
        _kill_one_cli(dashboard, lambda out, _: "Dashboard: " in out, tracked)


def test_sigkilled_server_leaves_no_dht_process_or_p2pd(bootstrap_peers, tiny_llama_path, tmp_path):
    server = Started(
        [
            "swarm.server",
            "--model",
            str(tiny_llama_path),
            "--initial-peers",
            *bootstrap_peers,
            "--blocks",
            "0:6",
            "--host",
            "127.0.0.1",
            "--torch-threads",
            "1",
            "--log-level",
            "INFO",
        ],
        tmp_path,
        "server",
    )
    with cleanup(server) as tracked:
        _kill_one_cli(server, lambda _, log: "Listening on" in log, tracked)
