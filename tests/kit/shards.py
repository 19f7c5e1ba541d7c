"""The suite in N pytest processes at once (``make test`` runs two): ``python -m tests.kit.shards``.

Why: much of a test's wall time is spent waiting on other processes (servers starting, the DHT
settling, a delay proxy's 25 ms per hop, a SIGSTOPped peer's timeout), while the other core idles.
Two processes, each running whole test files, took the suite from 2,034 s (one process, 47cdaaa) to
1,657 s with 57 more tests (9abf4c4), both cores 90-99% busy (docs/benchmarks.md). Whole files, not
single tests, because a file's module-scoped swarm must start once; files are dealt to the shards
longest first by the seconds they took (tests/kit/shard_weights.py). That balances them only roughly:
a file's seconds depend on what the other shard runs beside it. Each process is an ordinary pytest
run that deselects the other shards' files (``SPECSWARM_TEST_SHARD=i/N``, read by tests/conftest.py), so a shard can be
rerun alone: ``SPECSWARM_TEST_SHARD=2/2 python -m pytest tests``.

When the shards end with a few failed tests (at most ``RERUNS``), those tests run once more, alone, in one
pytest process: one that passes then is printed as ``FLAKY`` by name and the run passes; one that fails again
fails it. Why: under two shards' load, tests that wait on servers' timeouts failed now and then (a CI run
failed on one whose name had scrolled out of the log, 2026-12-05), and a rerun alone tells such a flake
from a bug that reproduces.

pytest-xdist would deal tests to workers too, but its workers see every collected test, so
tests/kit/last_use.py could not stop a shared swarm after its worker's last user, and idle swarms
slow everything beside them (that module says how much).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterable, Optional

from tests.kit.shard_weights import DEFAULT_WEIGHT, FILE_SECONDS

ENV = "SPECSWARM_TEST_SHARD"
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
ROOT = Path(__file__).resolve().parents[2]


def parse(value: str) -> tuple[int, int]:
    """``"i/N"`` (1-based) -> (i, N); anything else is a ValueError naming the variable."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"{ENV}={value!r}: expected i/N with 1 <= i <= N, e.g. 1/2")
    return int(m.group(1)), int(m.group(2))


def assign(files: Iterable[str], shards: int) -> dict[str, int]:
    """Each file -> its shard (1-based): longest first, each to the shard with the least so far."""
    load = [0.0] * shards
    owner: dict[str, int] = {}
    for path in sorted(set(files), key=lambda f: (-FILE_SECONDS.get(f, DEFAULT_WEIGHT), f)):
        shard = min(range(shards), key=lambda s: (load[s], s))
        owner[path] = shard + 1
        load[shard] += FILE_SECONDS.get(path, DEFAULT_WEIGHT)
    return owner


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def keep_own_shard(config, items: list) -> None:
    """pytest_collection_modifyitems: keep only this shard's files when ``SPECSWARM_TEST_SHARD`` is set."""
    value = os.environ.get(ENV)
    if not value:
        return
    shard, shards = parse(value)
    owner = assign((file_of(item.nodeid) for item in items), shards)
    kept = [item for item in items if owner[file_of(item.nodeid)] == shard]
    dropped = [item for item in items if owner[file_of(item.nodeid)] != shard]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


RECAP = re.compile(r"^(FAILED|ERROR) |^=+ .*\b(passed|failed|error|errors|no tests ran)\b.* in [\d.]+s")


def _pump(stream, prefix: str, lock: threading.Lock, recap: list[str]) -> None:
    """Copy a shard's lines out as they come; keep its failures and final count for the recap."""
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()
            if RECAP.search(line):
                recap.append(prefix + line.rstrip("\n"))


def run(shards: int, pytest_args: list[str]) -> int:
    """Run the shards at once, each line of their output prefixed with its shard; the worst exit code.

    A shard dealt no test file (a run of fewer files than shards) exits 5, "no tests ran"; that fails
    the run only when every shard did, as it fails a single pytest run."""
    if shards == 1:
        return subprocess.call([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    recap: list[str] = []  # why: a CI log keeps only its tail, and the first shard to end scrolls out of it
    for shard in range(1, shards + 1):
        env = {**os.environ, ENV: f"{shard}/{shards}", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *pytest_args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{shard}/{shards}] ", lock, recap), daemon=True)
        pump.start()
        pumps.append(pump)

    def forward(signum, _frame) -> None:  # CI's cancel or ^C reaches every shard (each reaps its own swarms)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    codes = [proc.wait() for proc in procs]
    for pump in pumps:
        pump.join(timeout=10)
    print("---- every shard's failures and counts ----")
    for line in recap:
        print(line)
    for shard, code in enumerate(codes, 1):
        print(f"shard {shard}/{shards}: pytest exit code {code}")
    code = combined_exit_code(codes)
    ids = failed_ids(recap)
    if not (code == TESTS_FAILED and all(c in (0, NO_TESTS, TESTS_FAILED) for c in codes) and 0 < len(ids) <= RERUNS):
        return code
    print(f"---- rerunning the {len(ids)} failed test(s) once, alone: {' '.join(ids)} ----", flush=True)
    again = subprocess.call([sys.executable, "-m", "pytest", *ids], cwd=ROOT)
    if again == 0:
        print(f"FLAKY: failed beside the other shard, passed alone on the rerun: {' '.join(ids)}")
    return 0 if again == 0 else code


TESTS_FAILED = 1  # pytest.ExitCode.TESTS_FAILED
# failed tests rerun once, alone, after the shards end: a test that fails only beside the other shard's
# load is reported FLAKY by name and passes the run; one that fails again fails it, as do more failures
RERUNS = 3


def failed_ids(recap: list[str]) -> list[str]:
    """The node ids of the recap's FAILED and ERROR lines, in order, each once."""
    ids: list[str] = []
    for line in recap:
        m = re.match(r"^\[\d+/\d+\] (?:FAILED|ERROR) (\S+)", line)
        if m and m.group(1) not in ids:
            ids.append(m.group(1))
    return ids


def combined_exit_code(codes: list[int]) -> int:
    """The first shard's failure; 5 only when no shard ran a test; else 0."""
    failed = [code for code in codes if code not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(code == NO_TESTS for code in codes) else 0


SECONDS_FILE = "file-seconds.json"  # what every run writes in its artifacts folder (tests/conftest.py)


class FileSeconds:
    """Seconds per test file (setup, call and teardown of its tests), written when the session ends: every
    run, ``make test`` included, leaves the weights a later deal can use (``--weights``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, report) -> None:
        path = file_of(report.nodeid)
        self.seconds[path] = self.seconds.get(path, 0.0) + float(report.duration)

    def write(self, folder: Path) -> None:
        if self.seconds:
            rounded = {path: round(secs, 1) for path, secs in sorted(self.seconds.items())}
            (folder / SECONDS_FILE).write_text(json.dumps(rounded, indent=1) + "\n")


def weights_from_log(log: Path) -> dict[str, float]:
    """Per-file seconds from a run's ``file-seconds.json`` or the ``--durations=0`` lines of a pytest log
    (shard prefixes allowed)."""
    if log.suffix == ".json":
        return {path: float(secs) for path, secs in json.loads(log.read_text()).items()}
    seconds: dict[str, float] = {}
    pattern = re.compile(r"([\d.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py)::")
    for line in log.read_text(errors="replace").splitlines():
        m = pattern.search(line)
        if m:
            seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    return seconds


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.kit.shards", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="pytest processes at once (default 2)")
    p.add_argument(
        "--weights",
        type=Path,
        nargs="+",
        help="print FILE_SECONDS measured in these runs (each shard's test-artifacts/shard-i-of-N/file-seconds.json, "
        "or a --durations=0 log) and exit",
    )
    p.add_argument("--plan", action="store_true", help="print which shard runs each file, and exit")
    args, pytest_args = p.parse_known_args(argv)
    if args.weights:
        measured: dict[str, float] = {}
        for source in args.weights:
            measured.update(weights_from_log(source))
        for path, secs in sorted(measured.items()):
            print(f'    "{path}": {secs:.1f},')
        return 0
    if args.shards < 1:
        p.error("--shards must be at least 1")
    if args.plan:
        files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py"))
        owner = assign(files, args.shards)
        for shard in range(1, args.shards + 1):
            mine = [f for f in files if owner[f] == shard]
            total = sum(FILE_SECONDS.get(f, DEFAULT_WEIGHT) for f in mine)
            print(f"shard {shard}: {len(mine)} files, about {total:.0f} s")
        return 0
    return run(args.shards, pytest_args or ["tests"])


if __name__ == "__main__":
    sys.exit(main())
