"""The network-namespace testbed (tests/kit/netns.py): a shaped link really limits the rate, and
close() leaves no namespace behind. Needs root; skipped otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.kit import netns

RATE_MBIT = 20
SIZE = 4_000_000  # bytes: 1.6 s at 20 Mbit/s

RECEIVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1)
print("listening", flush=True)
c, _ = s.accept(); n = 0
while (d := c.recv(1 << 16)):
    n += len(d)
c.sendall(str(n).encode()); c.close()
"""

SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001), timeout=20)
began = time.perf_counter()
s.sendall(b"x" * int(sys.argv[2])); s.shutdown(socket.SHUT_WR)
got = int(s.recv(64))
print(got, time.perf_counter() - began)
"""


@pytest.fixture
def available():
    try:
        netns.check_available()
    except netns.TestbedUnavailable as e:
        pytest.skip(f"no network-namespace testbed here: {e}")


def test_shaped_link_limits_the_rate_and_close_removes_everything(available):
    bed = netns.Testbed(["a", "b"], rate_mbit=RATE_MBIT)
    prefix = bed.prefix
    try:
        mine = {ns for ns in netns.list_namespaces() if ns.startswith(prefix)}
        assert mine == {prefix + "sw", prefix + "a", prefix + "b"}
        receiver = bed.run("b", [sys.executable, "-c", RECEIVER, bed.ip("b")], stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "listening"
        sender = bed.run("a", [sys.executable, "-c", SENDER, bed.ip("b"), str(SIZE)], stdout=subprocess.PIPE, text=True)
        out, _ = sender.communicate(timeout=25)
        got, seconds = out.split()
        assert int(got) == SIZE
        implied = SIZE * 8 / (RATE_MBIT * 1e6)
        assert float(seconds) > 0.6 * implied, f"{SIZE} B in {float(seconds):.2f} s: faster than {RATE_MBIT} Mbit/s"
        counters = bed.counters()
        assert counters["a"]["sent"] >= SIZE and counters["b"]["received"] >= SIZE
    finally:
        bed.close()
    assert not [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]
    assert all(p.poll() is not None for p in bed.processes)
