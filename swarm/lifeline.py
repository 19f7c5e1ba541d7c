"""Processes that die with the process that started them, even when it is killed with SIGKILL.

A process killed with SIGKILL runs none of its shutdown code, so whatever it started keeps running
as an orphan: the servers, bootstrap and dashboard of a ``swarm.local`` launcher, and inside each
of those the hivemind DHT process (a fork) and its libp2p daemon (``p2pd``, started by the DHT
process). Each of them holds ports and memory and keeps announcing itself in the DHT.

The lifeline is a watchdog thread in every process we start: it polls whether the process that
started it is still there (``os.getppid()`` changes the moment a parent dies, whoever reaps it)
and, once it is gone, terminates its own descendants (SIGTERM, then SIGKILL after a grace period)
and exits. Two ways in:

- ``install()``, first thing in every entry point: every process this one forks from then on
  (hivemind's DHT process, any multiprocessing worker) gets a watchdog on it, through an at-fork
  hook; and if a launcher started this process with ``child_env()``, it watches that launcher too.
- ``child_env()``: the environment a launcher passes to a child (``subprocess.Popen(env=...)``) to
  make it die with the launcher; ``swarm.local.LocalSwarm`` does so for everything it starts.

Dying takes at most POLL_SECONDS + GRACE_SECONDS per generation of processes. A watchdog only
fires when its parent is gone, so the client-side DHT process and p2pd inside a long-lived process
(a notebook, pytest) live exactly as long as that process. Not covered: ``p2pd`` is a Go binary
and runs no watchdog, so it goes when the DHT process that started it exits through its watchdog or
its shutdown code, but not when that DHT process alone is SIGKILLed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Mapping, Optional

import psutil

ENV_VAR = "SPECSWARM_LIFELINE_PID"  # set by a launcher to its own pid: "die when I die"
POLL_SECONDS = 0.5
GRACE_SECONDS = 2.0

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_hooked = False
_pid = 0  # this process's pid; after a fork the child reads here which process forked it


def install() -> None:
    """Make this process and everything it forks die with their parents (idempotent)."""
    install_fork_hook()
    launcher = os.environ.pop(ENV_VAR, None)  # not inherited further: grandchildren watch their own parents
    if launcher:
        watch(int(launcher))


def install_fork_hook() -> None:
    """Every process forked from this one from now on exits (with its own children) when this
    one is gone. Used by ``LocalSwarm`` and the test suite for their own DHT processes."""
    global _hooked, _pid
    with _lock:
        if _hooked:
            return
        _pid = os.getpid()
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _hooked = True


def child_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment for a child process (a ``python -m swarm.*`` CLI started directly, not
    through a shell) that must exit when this process is gone."""
    return {**(os.environ if env is None else env), ENV_VAR: str(os.getpid())}


def watch(parent: int) -> None:
    """Start the watchdog thread: when ``parent`` is gone, stop our descendants and exit."""
    threading.Thread(target=_watch, args=(parent,), name="lifeline", daemon=True).start()


def _after_fork_in_child() -> None:
    global _pid
    parent, _pid = _pid, os.getpid()
    watch(parent)


def _watch(parent: int) -> None:
    alive = _liveness(parent)
    while alive():
        time.sleep(POLL_SECONDS)
    _die(parent)


def _liveness(parent: int) -> Callable[[], bool]:
    if os.getppid() == parent:  # the usual case: a direct child
        return lambda: os.getppid() == parent
    try:  # started through something in between (or the parent is gone already: checked right away)
        process = psutil.Process(parent)
    except psutil.Error:
        return lambda: False

    def alive() -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    return alive


def _die(parent: int) -> None:
    logger.warning(f"Process {parent}, which started this one ({os.getpid()}), is gone: exiting")
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        descendants = []
    for process in descendants:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(descendants, timeout=GRACE_SECONDS)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    os._exit(1)
