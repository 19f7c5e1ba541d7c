"""What protocol/hivemind_private.py assumes of hivemind's private parts, checked against the
installed hivemind and its p2pd: when an upgrade renames or reshapes one of them, these tests fail
by name, before the NAT tests (or a volunteer behind a home router) find out the slow way.

Real daemons on 127.0.0.1 only; each test shuts down every daemon it starts."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest
from hivemind.p2p import P2P, P2PDaemonError
from multiaddr import Multiaddr

from protocol import hivemind_private

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def unpatched_make_process_args():
    made = inspect.getattr_static(P2P, "_make_process_args")
    assert isinstance(made, staticmethod), "hivemind's P2P._make_process_args is no longer a staticmethod"
    return getattr(made.__func__, "__wrapped__", made.__func__)


def test_make_process_args_turns_keywords_into_p2pd_flags():
    """The patch edits keyword arguments before this function renders them: it must still take the
    p2pd path positionally and render each keyword as ``-key=value`` (booleans as 0/1)."""
    make = unpatched_make_process_args()
    assert make("p2pd", relayDiscovery=False, relayMaxCircuits=0, trustedRelays="/ip4/1.2.3.4/tcp/1") == [
        "p2pd",
        "-relayDiscovery=0",
        "-relayMaxCircuits=0",
        "-trustedRelays=/ip4/1.2.3.4/tcp/1",
    ]


@pytest.mark.parametrize("refuse_relay", [False, True])
def test_p2p_create_builds_p2pd_command_line_through_the_patch(monkeypatch, refuse_relay):
    """``P2P.create`` calls ``_make_process_args`` with ``autoRelay`` and ``trustedRelays`` as we
    read them, and the daemon starts with the flags we add (p2pd refuses to start on a flag it does
    not know, so a renamed flag fails here too)."""
    hivemind_private.install_p2pd_flags()
    seen: list[tuple[dict, list[str]]] = []
    patched = P2P._make_process_args

    def recording(*args, **kwargs):
        seen.append((kwargs, patched(*args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(P2P, "_make_process_args", staticmethod(recording))
    if refuse_relay:  # on a switch of this test's own: the process-wide one stays off for other tests
        switch = threading.Event()
        switch.set()
        monkeypatch.setattr(hivemind_private, "_no_relay_service", switch)

    async def scenario() -> None:
        relay = await P2P.create(host_maddrs=LOCAL)
        try:
            maddrs = await relay.get_visible_maddrs()
            behind = await P2P.create(host_maddrs=LOCAL, use_auto_relay=True, trusted_relays=maddrs)
            await behind.shutdown()
        finally:
            await relay.shutdown()

    asyncio.run(scenario())
    (plain_kwargs, plain_args), (relayed_kwargs, relayed_args) = seen
    assert "relayDiscovery" not in plain_kwargs and "-relayDiscovery=0" not in plain_args
    assert relayed_kwargs["autoRelay"] is True and relayed_kwargs["trustedRelays"]
    assert "-relayDiscovery=0" in relayed_args
    for args in (plain_args, relayed_args):
        assert ("-relayMaxReservations=0" in args and "-relayMaxCircuits=0" in args) == refuse_relay


def test_p2pd_refuses_an_unknown_flag(monkeypatch):
    """What the test above relies on: a flag p2pd does not know stops the daemon at once."""
    make = unpatched_make_process_args()
    monkeypatch.setattr(P2P, "_make_process_args", staticmethod(lambda *a, **k: make(*a, noSuchFlag=1, **k)))

    async def scenario() -> None:
        p2p = await P2P.create(host_maddrs=LOCAL)
        await p2p.shutdown()

    with pytest.raises(P2PDaemonError):
        asyncio.run(scenario())


def test_connect_dials_given_addresses():
    """``connect`` makes a fresh daemon (no DHT, no initial peers) dial a peer at the addresses we
    give it; a second call while connected succeeds; a dial to a closed port raises."""

    async def scenario() -> None:
        target = await P2P.create(host_maddrs=LOCAL)
        dialer = await P2P.create(host_maddrs=[], no_listen=True, dht_mode="client")
        try:
            maddrs = [Multiaddr(str(m).split("/p2p/")[0]) for m in await target.get_visible_maddrs()]
            assert target.peer_id not in {info.peer_id for info in await dialer.list_peers()}
            await asyncio.wait_for(hivemind_private.connect(dialer, target.peer_id, maddrs), 30)
            assert target.peer_id in {info.peer_id for info in await dialer.list_peers()}
            await asyncio.wait_for(hivemind_private.connect(dialer, target.peer_id, maddrs), 30)

            stranger = await P2P.create(host_maddrs=LOCAL)
            stranger_maddrs = [Multiaddr(str(m).split("/p2p/")[0]) for m in await stranger.get_visible_maddrs()]
            stranger_id = stranger.peer_id
            await stranger.shutdown()  # its port is closed now
            with pytest.raises(Exception):
                await asyncio.wait_for(hivemind_private.connect(dialer, stranger_id, stranger_maddrs), 30)
        finally:
            await dialer.shutdown()
            await target.shutdown()

    asyncio.run(scenario())
