"""The testbed's links, apart from the namespaces: tbf shaping, the bridge ports' byte counters
and a sampler of them, plus the ``ip``/``tc`` calls everything in tests/kit/netns.py runs. Another
process (a benchmark inside the testbed) uses these through :meth:`tests.kit.netns.Testbed.spec`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional, Sequence

FAMILY = "ssbed"  # every testbed's namespaces start with this, then the creating process's pid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _cmd(["ip", *args], check=check)


def _cmd(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def tbf_args(rate_mbit: float, latency_ms: float = 100.0) -> list[str]:
    """tbf parameters for a link of ``rate_mbit``: a bucket of 5 ms of traffic (at least 32 KiB;
    tbf splits GSO packets bigger than the bucket) and a queue of ``latency_ms`` at that rate,
    like a modem's buffer."""
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.005))
    return ["rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{latency_ms:g}ms"]


def read_counters(switch_ns: str, ports: dict[str, str]) -> dict[str, dict[str, int]]:
    """{host: {"sent": bytes, "received": bytes}} from the bridge ports' counters (a port's rx is
    what its host sent). Works from any namespace as root."""
    done = _ip("-n", switch_ns, "-s", "-j", "link", "show", check=True)
    out = {}
    for link in json.loads(done.stdout):
        name = ports.get(link.get("ifname", ""))
        if name is not None:
            stats = link["stats64"]
            out[name] = {"sent": stats["rx"]["bytes"], "received": stats["tx"]["bytes"]}
    return out


def read_counters_spec(spec: str) -> dict[str, dict[str, int]]:
    parsed = json.loads(spec)
    return read_counters(parsed["switch"], parsed["ports"])


def shape_spec(spec: str, rate_mbit: Optional[float]) -> None:
    """Shape every host's link of the testbed described by ``spec`` (:meth:`Testbed.spec`)."""
    parsed = json.loads(spec)
    for ns, dev in parsed["links"]:
        if not ns.startswith(FAMILY):
            raise ValueError(f"{ns} is not a testbed namespace")
        _shape_link(ns, dev, rate_mbit, parsed["latency_ms"])


def _shape_link(ns: str, dev: str, rate_mbit: Optional[float], latency_ms: float) -> None:
    if rate_mbit:
        _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", *tbf_args(rate_mbit, latency_ms)])
    else:
        _cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)


# Runs in the switch namespace (whose /sys shows its own links): every ``interval`` s one line
# "monotonic_time rx_bytes..." for the given ports, until stdin closes; CLOCK_MONOTONIC is the
# same in every namespace, so the times compare with the caller's time.monotonic().
_SAMPLER = r"""
import select, sys, time
interval, ports = float(sys.argv[1]), sys.argv[2:]
files = [open(f"/sys/class/net/{p}/statistics/rx_bytes", "rb", buffering=0) for p in ports]
rows = []
while True:
    row = [time.monotonic()]
    for f in files:
        f.seek(0)
        row.append(int(f.read()))
    rows.append(row)
    if select.select([sys.stdin], [], [], interval)[0]:
        break
print("\n".join(" ".join(map(str, row)) for row in rows), flush=True)
"""


class CounterSampler:
    """Samples the bytes every host has sent, every ``interval`` seconds, from another process
    (as root): ``with CounterSampler(spec) as sampler: ...``, then ``sampler.samples`` is
    {host: [(monotonic time, bytes sent so far), ...]} and :meth:`busy_seconds` tells how long each
    host was sending."""

    def __init__(self, spec: str, interval: float = 0.005):
        parsed = json.loads(spec)
        if not parsed["switch"].startswith(FAMILY):
            raise ValueError(f"{parsed['switch']} is not a testbed namespace")
        self.hosts = list(parsed["ports"].values())
        self._argv = [
            "ip",
            "netns",
            "exec",
            parsed["switch"],
            sys.executable,
            "-c",
            _SAMPLER,
            str(interval),
            *parsed["ports"],
        ]
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self._process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "CounterSampler":
        self._process = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self._process.communicate(input="", timeout=30)
        rows = [line.split() for line in out.splitlines() if line.strip()]
        self.samples = {h: [(float(r[0]), int(r[1 + i])) for r in rows] for i, h in enumerate(self.hosts)}

    def busy_seconds(self, host: str, rate_mbit: float, fraction: float = 0.25) -> float:
        """Seconds during which ``host`` sent faster than ``fraction`` of ``rate_mbit``: the time
        its link was busy carrying a transfer, apart from idle chatter."""
        threshold = fraction * rate_mbit * 1e6 / 8  # bytes/s
        busy = 0.0
        samples = self.samples.get(host, [])
        for (t0, b0), (t1, b1) in zip(samples, samples[1:]):
            if t1 > t0 and (b1 - b0) / (t1 - t0) > threshold:
                busy += t1 - t0
        return busy
