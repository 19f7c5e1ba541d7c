"""``python -m`` processes forked from one that has already imported torch, transformers and hivemind.

A ``python -m swarm.server`` spends 5-10 s of CPU importing torch, transformers and hivemind before
it does anything of its own. A local swarm of three servers, a bootstrap node and a dashboard pays
that five times, and the test suite starts well over a hundred such processes on two cores. Here
the standard library's forkserver imports them once, and every process is a fork of it that runs
its module as ``__main__``, as ``python -m`` does: its own pid and session (so ``killpg`` reaches
its DHT process and libp2p daemon), its own arguments, environment, stdout, stderr and exit code.
Only the imports are shared. ``SPECSWARM_COLD_START=1`` starts plain ``python -m`` processes instead.

:class:`WarmProcess` offers what ``swarm.local`` and the tests use of ``subprocess.Popen``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn
from typing import IO, Mapping, Optional, Sequence, Union

ENV_COLD_START = "SPECSWARM_COLD_START"

# What the forkserver imports once (an ImportError there is ignored: the child imports it again).
# The model modules matter as much as the packages: transformers builds its lazy import table on
# the first model class a process asks for (seconds of CPU on these machines).
PRELOAD = [
    "torch",
    "transformers",
    "hivemind",
    "transformers.models.llama.modeling_llama",
    "server.span_server",
    "swarm.server",
    "swarm.bootstrap",
    "client.model",
]

Target = Union[None, int, IO]  # None: this process's own stream; subprocess.PIPE / DEVNULL; or an open file

_lock = threading.Lock()  # one start at a time: _Popen swaps a function of multiprocessing while it starts
_preloading = False
_started_env: dict[str, str] = {}  # this process's environment when it started the forkserver
_server_env: Optional[dict[str, str]] = None  # a warm child's environment before its own changes: _forkserver_env()
_running: "set[WarmProcess]" = set()  # strong: multiprocessing holds each child until exit anyway


def enabled() -> bool:
    return os.environ.get(ENV_COLD_START, "") not in ("1", "true", "yes")


class _Popen(popen_forkserver.Popen):
    """Starts the child without this process's ``__main__``: multiprocessing would import it in the
    child again, and a user's script without a main guard would run a second time there."""

    def _launch(self, process_obj) -> None:
        original = spawn.get_preparation_data

        def without_main(name: str) -> dict:
            data = original(name)
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            super()._launch(process_obj)
        finally:
            spawn.get_preparation_data = original


class _Process(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


def _ensure_preload() -> None:
    global _preloading, _started_env
    if not _preloading:
        _started_env = dict(os.environ)  # the forkserver inherits it
        forkserver.set_forkserver_preload(PRELOAD)
        atexit.register(_kill_leftovers)  # runs before multiprocessing's own exit hook joins them
        _preloading = True


class _PassedFd:
    """An open file descriptor sent to the forked child with the request that starts it (the
    forkserver passes it over its Unix socket, as it does for multiprocessing's own pipes)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


# Variables that the preloaded libraries read once, at import (cache folders, offline switches,
# thread counts, log levels): a child asked for other values of these starts a fresh interpreter.
# Every other difference (PYTEST_CURRENT_TEST, the lifeline's pid, our own SPECSWARM_* settings,
# read when used) is applied to the warm child's environment.
READ_AT_IMPORT = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "OMP_",
    "MKL_",
    "KMP_",
    "BNB_",
    "BITSANDBYTES_",
    "TOKENIZERS_",
    "HIVEMIND_",
    "PYTHON",
    "XDG_",
    "HOME",
    "LD_",
)
# ... except these, which a library sets itself when it is imported, after torch: applied to a warm child
# (which sets them again if it imports that library) they change nothing. sklearn (lm-eval imports it)
# sets KMP_DUPLICATE_LIB_OK so that a second OpenMP runtime does not abort the process, and KMP_INIT_AT_FORK
# (both read when an Intel OpenMP runtime loads, which in a warm child happened before); lm_eval sets
# HF_XET_HIGH_PERFORMANCE (and HF_HUB_ENABLE_HF_TRANSFER where hf_transfer is installed), which only
# choose how fast huggingface_hub downloads: a warm child keeps the forkserver's choice. Taken for
# changes the caller asked for, they sent every server started after a test imported lm-eval back to cold.
SET_BY_LATE_IMPORTS = (
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
    "HF_XET_HIGH_PERFORMANCE",
    "HF_HUB_ENABLE_HF_TRANSFER",
)


def _forkserver_env() -> dict[str, str]:
    """The environment a warm child starts with, asked of a forked child once (under ``_lock``).

    Not this process's environment when the forkserver started: the imports set variables of their own
    in both processes, at different times. Importing ``torch._dynamo`` (transformers does, building or
    loading a model) sets ``TORCHINDUCTOR_CACHE_DIR``; taken for a change the caller asked for, it sent
    every server the suite started after its first model back to a cold ``python -m`` (5-10 s of CPU
    each)."""
    global _server_env
    if _server_env is None:
        read_end, write_end = os.pipe()
        try:
            probe = _Process(target=_send_environment, name="environment probe", args=(_PassedFd(write_end),))
            probe.start()
        finally:
            os.close(write_end)
        with open(read_end, "rb") as pipe:
            data = pipe.read()
        probe.join()
        _server_env = json.loads(data)
    return _server_env


def _send_environment(fd: int) -> None:
    with open(fd, "wb") as out:
        out.write(json.dumps(dict(os.environ)).encode())


def _environment_change(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """What ``env`` sets and removes relative to the environment a warm child starts with. A variable
    the forkserver's imports set themselves is not removed by an ``env`` that lacks it."""
    server_env = _forkserver_env()
    sets = {k: v for k, v in env.items() if server_env.get(k) != v}
    return sets, [k for k in server_env if k not in env and k in _started_env]


def _run_module(
    module: str,
    argv: list[str],
    env: dict[str, str],
    change: tuple[dict[str, str], list[str]],
    fds: dict[int, int],
    cwd: Optional[str],
) -> None:
    """In the child: become what ``python -m module argv...`` would be, then run it. ``change``:
    what ``env`` sets and removes relative to the forkserver's environment (the parent knows it)."""
    os.setsid()
    for target, fd in fds.items():
        os.dup2(fd, target)
        os.close(fd)
    if cwd is not None:
        os.chdir(cwd)
    sets, removes = change
    cold = [k for k in [*sets, *removes] if k.startswith(READ_AT_IMPORT) and k not in SET_BY_LATE_IMPORTS]
    if cold:
        print(f"warm_start: {module} starts a fresh interpreter: {', '.join(sorted(cold))} differ", file=sys.stderr)
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    for key in removes:
        os.environ.pop(key, None)
    os.environ.update(sets)  # what the imports set themselves (TORCHINDUCTOR_CACHE_DIR, ...) stays
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.modules.pop(module, None)  # preloaded as a module; now it runs as __main__, as under python -m
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        # multiprocessing ends its children with os._exit: run what a normal interpreter exit runs
        atexit._run_exitfuncs()


class WarmProcess:
    """A forked ``python -m module args``; the part of ``subprocess.Popen`` that launchers use."""

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Optional[Mapping[str, str]] = None,
        stdout: Target = None,
        stderr: Target = None,
        cwd: Optional[str] = None,
        text: bool = False,
    ):
        """``stdout``/``stderr``: None (this process's own), ``subprocess.PIPE``, ``DEVNULL``, an
        open file, or for stderr ``subprocess.STDOUT``; ``text`` reads the pipes as str."""
        self.args = [sys.executable, "-m", module, *args]
        self.returncode: Optional[int] = None
        self.stdout: Optional[IO] = None
        self.stderr: Optional[IO] = None
        fds, close_after = {}, []
        for target, where in ((1, stdout), (2, stderr)):
            if where is None:
                fds[target] = target
            elif where == subprocess.STDOUT and target == 2:
                fds[2] = fds[1]
            elif where == subprocess.PIPE:
                read_end, write_end = os.pipe()
                setattr(self, "stdout" if target == 1 else "stderr", open(read_end, "r" if text else "rb"))
                fds[target] = write_end
                close_after.append(write_end)
            elif where == subprocess.DEVNULL:
                fds[target] = os.open(os.devnull, os.O_WRONLY)
                close_after.append(fds[target])
            else:
                fds[target] = where.fileno()
        env = dict(os.environ if env is None else env)
        passed = {t: _PassedFd(fd) for t, fd in fds.items()}
        try:
            with _lock:
                _ensure_preload()
                process = _Process(
                    target=_run_module,
                    name=module,
                    args=(module, list(args), env, _environment_change(env), passed, None if cwd is None else str(cwd)),
                )
                process.start()
        finally:
            for fd in close_after:
                os.close(fd)
        self._process = process
        self.pid: int = process.pid
        _running.add(self)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Started = Union[WarmProcess, subprocess.Popen]  # what start() returns: warm, or cold when disabled


def start(
    module: str,
    args: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    stdout: Target = None,
    stderr: Target = None,
    cwd: Optional[str] = None,
    text: bool = False,
) -> Started:
    """``python -m module args``, forked from the warm forkserver unless ``SPECSWARM_COLD_START`` is set."""
    if enabled():
        return WarmProcess(module, args, env=env, stdout=stdout, stderr=stderr, cwd=cwd, text=text)
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=stdout,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=None if env is None else dict(env),
        cwd=cwd,
        text=text,
    )


def run(
    module: str,
    args: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    timeout: Optional[float] = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, module, *args], capture_output=True, text=True)``, warm: for
    tests of a command line's output and exit code. On a timeout the process group is killed."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = start(module, args, env=env, stdout=out, stderr=err, cwd=cwd)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(process)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())


def kill_group(process: Started) -> None:
    """SIGKILL a process and everything it started (its DHT process, the libp2p daemon): a server
    killed alone would leave those running."""
    if getattr(process, "group_reaped", False):  # its id may be a stranger's by now
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    process.group_reaped = True


def _kill_leftovers() -> None:
    """At exit, SIGKILL the groups of forked processes still running: multiprocessing would
    otherwise wait for every child it started before this interpreter may exit."""
    for process in list(_running):
        if process.poll() is None:
            kill_group(process)
