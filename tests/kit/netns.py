"""A multi-host testbed on one machine: network namespaces joined by a bridge, links shaped by tbf.

    with Testbed(["a", "b"], rate_mbit=20) as bed:       # needs root (ip netns, veth, tc)
        server = bed.run("b", [sys.executable, "-m", "http.server", "--bind", bed.ip("b"), "8000"])
        client = bed.run("a", ["curl", f"http://{bed.ip('b')}:8000/"])

Layout: one "switch" namespace holds a Linux bridge; every host is its own namespace with loopback
up and one veth (``eth0``, address ``10.77.0.N/24`` by default) whose peer is a port of the bridge.
Nothing is routed anywhere else: the namespaces have no default route and no link to the machine's
own network, so traffic between hosts never leaves them (the private addresses stay inside).

NAT (``add_nat_host``): a host behind a home router. The router is an ordinary host on the bridge
with a second veth into the NATed host's namespace (a private LAN, ``192.168.77.0/24`` by default,
routed nowhere else); nftables masquerades the LAN's traffic and forwards back only replies to
connections the LAN opened, so the NATed host can dial out and nobody can dial in
(tests/network/test_nat.py).

Shaping (``rate_mbit``): ``tc qdisc ... root tbf`` on the host's ``eth0`` (what the host sends) and
on its bridge port (what it receives), so each host sits behind a symmetric link of that rate; a
packet between two hosts passes the sender's uplink and the receiver's downlink. tbf works on these
kernels; netem does not (delay comes from ``swarm/delay_proxy.py`` in user space instead).

Measuring: :meth:`Testbed.counters` gives the bytes each host has sent and received (its bridge
port's counters); :class:`tests.kit.netns_links.CounterSampler` samples them every few milliseconds, to tell when a link
was busy. :meth:`Testbed.spec` hands both, and re-shaping (``netns_links.shape_spec``), to another process.

``run()`` starts a process inside a host's namespace (``ip netns exec``, in a new session);
``close()`` (also on ``with`` exit, at interpreter exit, and after a failed start) SIGKILLs every
process group it started, then every process still inside its namespaces, then deletes the
namespaces (which removes their veths). Namespaces are named ``ssbed<pid>-<name>``, so parallel
runs never collide; ``python -m tests.kit.netns --cleanup`` removes those left behind by runs
that were SIGKILLed (only testbeds whose creating process is gone).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from swarm import lifeline
from tests.kit.netns_links import FAMILY, _cmd, _ip, _shape_link, read_counters

SWITCH = "sw"
DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_LAN = "192.168.77.0/24"
NAT_RULES = """
table ip specswarm_nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "eth0" ip saddr {lan} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "lan0" oifname "eth0" accept
    iifname "eth0" oifname "lan0" ct state established,related accept
  }}
}}
"""


class TestbedUnavailable(RuntimeError):
    """This machine (or user) cannot build network namespaces: not root, no ``ip``, or no netns."""


@dataclass
class Host:
    name: str
    ns: str  # namespace name
    ip: str
    port: str  # the host's port on the bridge, in the switch namespace
    rate_mbit: Optional[float] = None


def list_namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def check_available() -> None:
    """Raise :class:`TestbedUnavailable` with the reason unless namespaces can be made here."""
    if os.geteuid() != 0:
        raise TestbedUnavailable("the network-namespace testbed needs root (ip netns, veth, tc)")
    probe = f"{FAMILY}{os.getpid()}-probe-{uuid.uuid4().hex[:6]}"
    try:
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    except FileNotFoundError as e:
        raise TestbedUnavailable("the `ip` command (iproute2) is not installed") from e
    if done.returncode != 0:
        raise TestbedUnavailable(f"`ip netns add` failed: {done.stderr.strip() or done.returncode}")
    _ip("netns", "del", probe, check=False)
    try:
        _cmd(["tc", "-V"])
    except (FileNotFoundError, RuntimeError) as e:
        raise TestbedUnavailable(f"the `tc` command (iproute2) does not work: {e}") from e


def current_testbed_namespace() -> Optional[str]:
    """The name of the testbed namespace this process runs in (``ip netns identify``), or None
    when it runs in any other network namespace, such as the machine's own."""
    try:
        mine = os.stat("/proc/self/ns/net")
        for name in os.listdir("/run/netns"):
            if name.startswith(FAMILY):
                st = os.stat(os.path.join("/run/netns", name))
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    return name
    except OSError:
        pass
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_pids(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (only our testbed's, by construction)."""
    done = _ip("netns", "pids", ns, check=False)
    for token in done.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(token), signal.SIGKILL)


def _delete_namespaces(names: Iterable[str]) -> None:
    names = list(names)
    for ns in names:
        _kill_namespace_pids(ns)
    for ns in names:
        for _ in range(20):  # a process being killed may hold the namespace busy for a moment
            if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in list_namespaces():
                break
            time.sleep(0.1)


def cleanup_stale() -> list[str]:
    """Delete namespaces of testbeds whose creating process no longer exists; returns their names."""
    stale = []
    for ns in list_namespaces():
        m = re.fullmatch(rf"{FAMILY}(\d+)-.+", ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    _delete_namespaces(stale)
    return stale


class Testbed:
    """Hosts in network namespaces on one bridge; see the module docstring. A context manager."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self,
        hosts: Sequence[str] = (),
        *,
        rate_mbit: Optional[float] = None,
        subnet: str = DEFAULT_SUBNET,
        latency_ms: float = 100.0,
    ):
        check_available()
        self.prefix = f"{FAMILY}{os.getpid()}-"
        self.subnet = ipaddress.ip_network(subnet)
        if not self.subnet.is_private:
            raise ValueError(f"the testbed uses private addresses only, got {subnet}")
        self.latency_ms = latency_ms
        self.hosts: dict[str, Host] = {}
        self.nat_hosts: dict[str, Host] = {}  # behind a NAT router host (add_nat_host)
        self.processes: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self._addresses = self.subnet.hosts()
        next(self._addresses)  # .1 stays free (a gateway, should a later test want one)
        self._closed = False
        # namespaces with our own prefix belong to a dead process that had our pid: ours to remove
        _delete_namespaces(ns for ns in list_namespaces() if ns.startswith(self.prefix))
        atexit.register(self.close)
        try:
            self.switch = self._add_namespace(SWITCH)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name in hosts:
                self.add_host(name, rate_mbit=rate_mbit)
        except BaseException:
            self.close()
            raise

    # ---- building ------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> str:
        ns = self.prefix + name
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def add_host(self, name: str, *, rate_mbit: Optional[float] = None, ip: Optional[str] = None) -> Host:
        """A new namespace with ``eth0`` on the bridge, an address, and optionally a shaped link."""
        if not re.fullmatch(r"[A-Za-z0-9_.]+", name) or name == SWITCH or name in self.hosts:
            raise ValueError(f"bad or duplicate host name {name!r}")
        address = ip or str(next(self._addresses))
        if ipaddress.ip_address(address) not in self.subnet:
            raise ValueError(f"{address} is outside the testbed's subnet {self.subnet}")
        ns = self._add_namespace(name)
        port = f"p{len(self.hosts)}"
        # created straight in the two namespaces (names only need to be unique there)
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        host = self.hosts[name] = Host(name, ns, address, port)
        if rate_mbit:
            self.shape(name, rate_mbit)
        return host

    def add_nat_host(self, name: str, *, router: Optional[str] = None, lan: str = DEFAULT_LAN) -> Host:
        """A host behind a home router: namespace ``name`` on its own LAN (``lan``, private), and a
        router host on the bridge that masquerades the LAN's traffic (nftables) and forwards back
        only replies to connections the LAN opened. Nobody outside can dial ``name``: its address
        is not routed anywhere, and the router drops every new inbound connection."""
        router = router or f"{name}_nat"
        gateway = self.add_host(router)
        subnet = ipaddress.ip_network(lan)
        if not subnet.is_private:
            raise ValueError(f"the LAN must use private addresses, got {lan}")
        gateway_ip, address = (str(a) for a in list(subnet.hosts())[:2])
        ns = self._add_namespace(name)
        _ip("link", "add", "lan0", "netns", gateway.ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", gateway.ns, "addr", "add", f"{gateway_ip}/{subnet.prefixlen}", "dev", "lan0")
        _ip("-n", gateway.ns, "link", "set", "lan0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "via", gateway_ip)
        _cmd(["ip", "netns", "exec", gateway.ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        rules = NAT_RULES.format(lan=lan)
        try:
            subprocess.run(
                ["ip", "netns", "exec", gateway.ns, "nft", "-f", "-"],
                input=rules,
                text=True,
                capture_output=True,
                check=True,
            )
        except FileNotFoundError:
            raise TestbedUnavailable("the `nft` command (nftables) is not installed") from None
        except subprocess.CalledProcessError as e:
            raise TestbedUnavailable(f"nftables does not work here: {e.stderr.strip()}") from None
        host = self.nat_hosts[name] = Host(name, ns, address, port="")
        return host

    def shape(self, name: str, rate_mbit: Optional[float]) -> None:
        """Limit host ``name``'s link to ``rate_mbit`` both ways (None or 0: unshaped)."""
        host = self.hosts[name]
        for ns, dev in ((host.ns, "eth0"), (self.switch, host.port)):
            _shape_link(ns, dev, rate_mbit, self.latency_ms)
        host.rate_mbit = rate_mbit or None

    def shape_all(self, rate_mbit: Optional[float]) -> None:
        for name in self.hosts:
            self.shape(name, rate_mbit)

    # ---- using ---------------------------------------------------------------------------

    def _host(self, name: str) -> Host:
        return self.hosts[name] if name in self.hosts else self.nat_hosts[name]

    def ip(self, name: str) -> str:
        return self._host(name).ip

    def ns(self, name: str) -> str:
        return self._host(name).ns

    def run(self, name: str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``name``'s namespace, in a new session (close() kills its group)."""
        if self._closed:
            raise RuntimeError("the testbed is closed")
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        # our CLIs exit when this process is gone, even when it dies without running close()
        popen_kwargs.setdefault("env", lifeline.child_env())
        popen_kwargs["start_new_session"] = True
        process = subprocess.Popen(["ip", "netns", "exec", self.ns(name), *argv], **popen_kwargs)
        self.processes.append(process)
        return process

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes each host has sent and received on its link so far (bridge port counters)."""
        return read_counters(self.switch, {h.port: h.name for h in self.hosts.values()})

    def spec(self) -> str:
        """A JSON string with which another process (as root) reads :meth:`counters` and re-shapes
        the links: ``netns_links.read_counters_spec``, ``netns_links.shape_spec``."""
        links = [[h.ns, "eth0"] for h in self.hosts.values()] + [[self.switch, h.port] for h in self.hosts.values()]
        return json.dumps(
            {
                "switch": self.switch,
                "ports": {h.port: h.name for h in self.hosts.values()},
                "links": links,
                "latency_ms": self.latency_ms,
            }
        )

    # ---- teardown ------------------------------------------------------------------------

    def kill(self, process: subprocess.Popen, timeout: float = 0.0) -> None:
        """SIGTERM (if ``timeout``), wait up to ``timeout`` s, then SIGKILL the process's whole group."""
        if timeout > 0 and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for process in self.processes:
            self.kill(process)
        _delete_namespaces(reversed(self._namespaces))
        self._namespaces.clear()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def testbed_or_skip(hosts: Sequence[str], nat_hosts: Sequence[str] = ()) -> Iterator["Testbed"]:
    """A testbed for one pytest test: the test is skipped where namespaces (or NAT) cannot be made here,
    and on exit every namespace it made must be gone."""
    import pytest

    try:
        check_available()
        testbed = Testbed(hosts)
    except TestbedUnavailable as e:
        pytest.skip(f"no network-namespace testbed here: {e}")
    try:
        for name in nat_hosts:
            testbed.add_nat_host(name)
    except TestbedUnavailable as e:
        testbed.close()
        pytest.skip(f"no NAT in the testbed here: {e}")
    with testbed:
        yield testbed
    assert not [ns for ns in list_namespaces() if ns.startswith(testbed.prefix)]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.kit.netns", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cleanup", action="store_true", help="delete testbeds left behind by dead processes")
    args = p.parse_args(argv)
    if args.cleanup:
        for ns in cleanup_stale():
            print("deleted", ns)
        return 0
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
