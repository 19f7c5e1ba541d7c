"""Serving from behind NAT, live, in network namespaces (needs root, iproute2 and nftables).

Hosts (tests/kit/netns.py): ``pub`` runs the bootstrap and a server with the first blocks,
``home`` sits behind a NAT router (nftables masquerade, no inbound connections) and serves the
last blocks, so every route passes through it; ``cli`` runs the client. Nobody can dial ``home``:
it finds out with the dial-back probe, reserves a slot on the bootstrap's relay, and announces
``using_relay`` with its circuit address. The generation must equal local transformers. A second
test starts a NATed server against a bootstrap that offers no relay: it must exit non-zero with
one clear line instead of announcing a span nobody can use. The dashboard's probe reaches both
servers (the NATed one through its relay).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.kit import netns
from tests.kit.swarms import SERVER_ARGS

pytestmark = pytest.mark.timeout(300)

CLIENT = """
import json, sys
from swarm import AutoDistributedModel
from protocol.dht_records import fetch_servers
path, peer, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = AutoDistributedModel.from_pretrained(path, initial_peers=[peer])
try:
    import torch
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    servers = fetch_servers(model.swarm.dht, model.swarm.model, model.config.num_hidden_layers)
    from swarm.dashboard.poller import SwarmReader  # the dashboard's reachability probe
    probed = {p.peer_id: p.rtt for p in SwarmReader(model.swarm.dht).probe(model.swarm.model, servers)}
    print(json.dumps({"tokens": out[0].tolist(), "servers": [
        {"start": s.start_block, "end": s.end_block, "using_relay": s.using_relay, "relay_addrs": s.relay_addrs,
         "probe_rtt": probed.get(s.peer_id)} for s in servers]}), flush=True)
finally:
    model.shutdown()
"""


@pytest.fixture
def bed():
    with netns.testbed_or_skip(["pub", "cli"], nat_hosts=["home"]) as testbed:
        yield testbed


def _bootstrap(bed, *extra: str) -> tuple[subprocess.Popen, str]:
    process = bed.run(
        "pub",
        [sys.executable, "-m", "swarm.bootstrap", "--host", bed.ip("pub"), *extra],
        stdout=subprocess.PIPE,
        text=True,
    )
    return process, process.stdout.readline().strip()


def _server(bed, host: str, model: str, peer: str, blocks: str, log_path, *extra: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "swarm.server",
        "--model",
        model,
        "--initial-peers",
        peer,
        "--blocks",
        blocks,
        "--host",
        bed.ip(host),
        *SERVER_ARGS,
        *extra,
    ]
    return bed.run(host, argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def test_server_behind_nat_serves_through_a_relay(bed, tiny_llama_path, tiny_reference, tmp_path):
    _, peer = _bootstrap(bed)
    assert peer.startswith(f"/ip4/{bed.ip('pub')}/")
    model = str(tiny_llama_path)
    public = _server(bed, "pub", model, peer, "0:3", tmp_path / "pub.log")
    home = _server(bed, "home", model, peer, "3:6", tmp_path / "home.log")
    ids = [1, 422, 1543, 314, 3125, 28]
    deadline = time.monotonic() + 120
    result = None
    while result is None and time.monotonic() < deadline:  # the client retries until both are online
        assert public.poll() is None and home.poll() is None, (tmp_path / "home.log").read_text()[-3000:]
        client = bed.run(
            "cli",
            [sys.executable, "-c", CLIENT, model, peer, json.dumps(ids)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = client.communicate(timeout=120)
        if client.returncode == 0:
            result = json.loads(out.strip().splitlines()[-1])
        else:
            time.sleep(2)
    assert result is not None, f"no generation through the NATed server: {err[-3000:]}"
    home_log = (tmp_path / "home.log").read_text()
    assert "cannot dial this server directly" in home_log and "Reachable through 1 relay" in home_log
    records = {(s["start"], s["end"]): s for s in result["servers"]}
    assert records[(3, 6)]["using_relay"] and records[(3, 6)]["relay_addrs"][0].startswith(peer + "/p2p-circuit/p2p/")
    assert not records[(0, 3)]["using_relay"]
    assert all(r["probe_rtt"] is not None for r in records.values())  # the dashboard reaches both
    with torch.no_grad():
        expected = tiny_reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert result["tokens"] == expected[0].tolist()


def test_server_behind_nat_without_a_relay_exits_with_one_clear_line(bed, tiny_llama_path, tmp_path):
    _, peer = _bootstrap(bed, "--no-relay")
    home = _server(bed, "home", str(tiny_llama_path), peer, "3:6", tmp_path / "home.log")
    try:
        code = home.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    log = (tmp_path / "home.log").read_text()
    assert code not in (None, 0), f"exit code {code}; the home server's log ends:\n{log[-5000:]}"
    errors = [line for line in log.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "no relay could be reached" in errors[0], log[-3000:]


# ---- the pieces, on loopback (no root needed) ------------------------------------------------


def test_only_well_formed_circuit_addresses_of_the_peer_itself_are_kept():
    from protocol import relay

    me, other = "QmY2BEWQvt9bxCg7KUxMPhvXrSfZ1wacXso1YEps1xWjxC", "QmQa8jrsSkogQrtaBrWN68FkmtigGxzN771cyokw6YGTbo"
    good = f"/ip4/10.0.0.1/tcp/5000/p2p/{other}/p2p-circuit/p2p/{me}"
    assert relay.valid_circuit_addrs([good], me) == (good,)
    assert relay.valid_circuit_addrs([good], other) == ()  # names another peer
    assert (
        relay.valid_circuit_addrs([f"/ip4/10.0.0.1/tcp/5000/p2p/{me}"], me) == ()
    )  # direct: never taken from a record
    assert relay.valid_circuit_addrs(["/garbage/p2p-circuit/p2p/" + me, 42], me) == ()
    assert len(relay.valid_circuit_addrs([good] * 10, me)) == relay.MAX_RELAY_ADDRS


def test_dial_back_probe_tells_a_listening_peer_from_a_dead_address():
    import asyncio

    from hivemind.p2p import P2P

    from server.reachability import ProbeService, ask_dial_back

    async def scenario():
        prober = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        asker = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await prober.get_visible_maddrs())
        try:
            service = ProbeService()
            await service.add_to(prober)
            mine = [str(m) for m in await asker.get_visible_maddrs()]
            reachable = await ask_dial_back(asker, [prober.peer_id], mine)
            dead = await ask_dial_back(asker, [prober.peer_id], ["/ip4/127.0.0.1/tcp/1"])
            bad = await ask_dial_back(asker, [prober.peer_id], ["not an address"])
            return reachable, dead, bad, service.probes
        finally:
            await asker.shutdown()
            await prober.shutdown()

    reachable, dead, bad, probes = asyncio.run(scenario())
    assert (reachable, dead, bad, probes) == (True, False, None, 2)  # a malformed request is refused unprobed


def test_a_peer_without_a_relay_refuses_to_vouch_for_circuits_through_it(monkeypatch):
    """p2pd may relay anyway (docs/nat.md "Who relays"): the probe's answer is what servers go by."""
    import asyncio

    from hivemind.p2p import P2P

    from server import reachability
    from server.reachability import NOT_A_RELAY, ProbeService, _working_circuits, ask_dial_back, circuit_addrs

    answers = []
    ask = reachability._ask

    async def counted(*args, **kwargs):
        answers.append(await ask(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(reachability, "_ask", counted)

    async def scenario():
        prober = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        asker = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await prober.get_visible_maddrs())
        try:
            service = ProbeService(relays=False)
            await service.add_to(prober)
            relay = [str(m) for m in await prober.get_visible_maddrs()][:1]
            through_it = circuit_addrs(relay, asker.peer_id)
            deadline = asyncio.get_running_loop().time() + 60
            working = await _working_circuits(asker, [prober.peer_id], through_it, deadline=deadline)
            circuit_answers = list(answers)
            direct = await ask_dial_back(asker, [prober.peer_id], [str(m) for m in await asker.get_visible_maddrs()])
            return working, circuit_answers, service.probes, direct
        finally:
            await asker.shutdown()
            await prober.shutdown()

    working, circuit_answers, probes, direct = asyncio.run(scenario())
    # asked once and dropped at once (not asked again until the deadline), without a dial
    assert working == [] and [a.error for a in circuit_answers] == [NOT_A_RELAY]
    assert probes == 1 and direct is True  # it still probes direct addresses: one dial for those
