"""The two things specswarm takes from hivemind beyond its public API, kept here and nowhere else.

hivemind (pinned in setup.cfg) exposes neither, and a release may rename or reshape them without
notice; tests/network/test_hivemind_private.py checks each assumption below against the installed hivemind
and p2pd, so an upgrade that breaks one fails there by name instead of as a server that sits
unreachable behind NAT.

1. ``P2P._make_process_args`` (a staticmethod that turns ``P2P.create``'s keyword arguments into
   p2pd's ``-key=value`` command line). hivemind has no way to pass extra p2pd flags, and we need
   two kinds (see :func:`install_p2pd_flags`):
   - ``-relayDiscovery=0`` when explicit relays are given: p2pd's default discovery mode makes
     libp2p's autorelay wait for 4 relay candidates or a 3-minute boot delay before it reserves a
     slot, so a server behind NAT in a swarm with one public peer would sit unreachable for minutes;
     with discovery off libp2p uses exactly the given relays (static-relay mode) and reserves as soon
     as it is connected.
   - ``-relayMaxReservations=0 -relayMaxCircuits=0`` for a peer that must not relay for others
     (``make_dht(relay_service=False)``): hivemind's ``use_relay=False`` does not stop p2pd's relay
     service (see protocol/dht.py).
2. ``P2P._client.connect`` (p2pd's CONNECT request, the daemon client's ``connect(peer_id,
   maddrs)``). hivemind only dials peers it finds through its DHT or the initial peers; we must dial
   given addresses: a server behind NAT through its relay circuit (protocol/relay.py, which the
   relayed server's DHT client mode keeps libp2p from finding by itself), and a fresh daemon's
   dial-back probe of a joining server's announced addresses (server/reachability.py). hivemind
   uses the same call for its own identity check (``P2P.is_identity_taken``).
"""

from __future__ import annotations

import functools
import threading
from typing import Iterable

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

_no_relay_service = threading.Event()  # set once a peer of this process offers no relay (inherited by its DHT fork)


def refuse_relay_service() -> None:
    """Start every later p2pd of this process (and of its DHT forks) with no relay slots to give."""
    _no_relay_service.set()


@functools.cache
def install_p2pd_flags() -> None:
    """Wrap ``P2P._make_process_args`` to add the flags of the module docstring. Installed once per
    process, before any DHT forks its child (the fork inherits the patched class). It changes
    nothing for a peer with no explicit relays that offers relays as usual."""
    original = P2P._make_process_args

    @functools.wraps(original)
    def make_process_args(*args, **kwargs):
        kwargs = p2pd_flags(kwargs, refuse_relay=_no_relay_service.is_set())
        return original(*args, **kwargs)

    P2P._make_process_args = staticmethod(make_process_args)


def p2pd_flags(kwargs: dict, refuse_relay: bool) -> dict:
    """``P2P.create``'s p2pd keyword arguments with our flags added (a new dict)."""
    kwargs = dict(kwargs)
    if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
        kwargs["relayDiscovery"] = False
    if refuse_relay:
        kwargs.update(relayMaxReservations=0, relayMaxCircuits=0)
    return kwargs


async def connect(p2p: P2P, peer_id: PeerID, maddrs: Iterable[Multiaddr]) -> None:
    """Make ``p2p``'s daemon dial ``peer_id`` at ``maddrs`` (a quick no-op when already connected).
    Raises whatever p2pd answers when the dial fails; callers bound it with a timeout."""
    await p2p._client.connect(peer_id, list(maddrs))
