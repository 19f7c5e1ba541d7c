"""The one place that starts a hivemind DHT for specswarm: every peer (server, bootstrap, client,
dashboard, gateway, test) joins with the same record validator and the same libp2p relay rules.

Relays (docs/nat.md): a peer that nobody can dial (behind a home router) reaches the swarm through
a libp2p circuit relay run by a public peer. ``reachability="public"`` is for peers known to be
dialable (a bootstrap, a server whose dial-back probe succeeded): libp2p then runs the relay
service (hop) for others at once instead of waiting for AutoNAT to agree. ``reachability="private"``
with ``relays`` makes the peer reserve a slot on those relays right away.

Flags hivemind does not expose (``-relayDiscovery=0`` with explicit relays, no relay slots for a
peer that offers no relay service) are added to p2pd's command line by
:mod:`protocol.hivemind_private`, which says why each is needed.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import hivemind

from protocol import hivemind_private
from protocol.identity import Identity
from protocol.validation import PeerIdSignatureValidator

logger = logging.getLogger(__name__)

REACHABILITY = ("auto", "public", "private")


def make_dht(
    *,
    initial_peers: Sequence[str] = (),
    identity: Optional[Identity] = None,
    host: Optional[str] = None,
    port: int = 0,
    announce_maddrs: Sequence[str] = (),
    client_mode: bool = False,
    reachability: str = "auto",
    relays: Sequence[str] = (),
    relay_service: bool = True,
    start: bool = True,
) -> hivemind.DHT:
    """A hivemind DHT that signs this peer's records (with ``identity``) and validates everyone's.

    :param host: listen on this IPv4 or IPv6 address (:func:`listen_maddr`); ``None`` for a client
      that only dials out.
    :param reachability: ``auto`` (let libp2p's AutoNAT decide), ``public`` or ``private``.
    :param relays: full multiaddrs of relays to reserve a slot on (makes this peer reachable
      through them; only meaningful with ``reachability="private"``).
    :param relay_service: ``False`` turns circuit relays off entirely (neither used nor offered;
      overrides ``reachability``).
    """
    if reachability not in REACHABILITY:
        raise ValueError(f"reachability must be one of {REACHABILITY}, got {reachability!r}")
    hivemind_private.install_p2pd_flags()
    kwargs: dict = {}
    if host is not None:
        kwargs["host_maddrs"] = [listen_maddr(host, port)]
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity is not None:
        kwargs["identity_path"] = identity.path
    if reachability != "auto":
        kwargs["force_reachability"] = reachability
    if relays:
        kwargs.update(use_auto_relay=True, trusted_relays=list(relays))
    if not relay_service:
        # Best effort only: hivemind's p2pd also starts a relay with libp2p's default limits (seen
        # relaying with -relay=0 too), and whichever registers the hop protocol last wins. So a peer
        # without a relay service also refuses to vouch for circuits through it in the dial-back
        # probe (server.reachability.ProbeService), which is what servers behind NAT go by.
        hivemind_private.refuse_relay_service()
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        client_mode=client_mode,
        record_validators=[PeerIdSignatureValidator(identity)],
        start=start,
        **kwargs,
    )


def listen_maddr(host: str, port: int) -> str:
    """``/ip4/...`` or ``/ip6/...`` + ``/tcp/port`` for an IP address (brackets around IPv6 allowed),
    built with ``multiaddr``; a ValueError names a host that is not an IP address."""
    import ipaddress

    from multiaddr import Multiaddr

    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        allowed = "0.0.0.0, ::, 127.0.0.1, ::1"
        raise ValueError(f"--host must be an IPv4 or IPv6 address to listen on ({allowed}), got {host!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    return str(Multiaddr(f"/ip{ip.version}/{ip}/tcp/{port}"))
