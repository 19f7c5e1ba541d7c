"""The one place that starts a hivemind DHT for specswarm: every peer (server, bootstrap, client,
dashboard, gateway, test) joins with the same record validator and the same libp2p relay rules.

Relays (docs/nat.md): a peer that nobody can dial (behind a home router) reaches the swarm through
a libp2p circuit relay run by a public peer. ``reachability="public"`` is for peers known to be
dialable (a bootstrap, a server whose dial-back probe succeeded): libp2p then runs the relay
service (hop) for others at once instead of waiting for AutoNAT to agree. ``reachability="private"``
with ``relays`` makes the peer reserve a slot on those relays right away.

One flag hivemind does not expose: p2pd's ``-relayDiscovery`` defaults to on, and in discovery mode
libp2p's autorelay waits for 4 relay candidates or a 3-minute boot delay before it reserves a
slot, so a server behind NAT in a swarm with one public peer would sit unreachable for minutes.
With explicit relays we pass ``-relayDiscovery=0``, which makes p2pd use exactly those relays
(libp2p's static-relay mode: it reserves as soon as it is connected). :func:`_install_p2pd_flags`
adds the flag to hivemind's argument list; it changes nothing when no relays are given.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Optional, Sequence

import hivemind
from hivemind.p2p import P2P

from protocol.identity import Identity
from protocol.validation import PeerIdSignatureValidator

logger = logging.getLogger(__name__)

REACHABILITY = ("auto", "public", "private")
_no_relay_service = threading.Event()  # set once a peer of this process offers no relay (inherited by its DHT fork)


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

    :param host: listen on ``/ip4/{host}/tcp/{port}``; ``None`` for a client that only dials out.
    :param reachability: ``auto`` (let libp2p's AutoNAT decide), ``public`` or ``private``.
    :param relays: full multiaddrs of relays to reserve a slot on (makes this peer reachable
      through them; only meaningful with ``reachability="private"``).
    :param relay_service: ``False`` turns circuit relays off entirely (neither used nor offered;
      overrides ``reachability``).
    """
    if reachability not in REACHABILITY:
        raise ValueError(f"reachability must be one of {REACHABILITY}, got {reachability!r}")
    _install_p2pd_flags()
    kwargs: dict = {}
    if host is not None:
        kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
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
        _no_relay_service.set()
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        client_mode=client_mode,
        record_validators=[PeerIdSignatureValidator(identity)],
        start=start,
        **kwargs,
    )


@functools.cache
def _install_p2pd_flags() -> None:
    """Add ``-relayDiscovery=0`` to p2pd's command line when it is given explicit relays (see the
    module docstring). Installed once per process, before any DHT forks its child."""
    original = P2P._make_process_args

    @functools.wraps(original)
    def make_process_args(*args, **kwargs):
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        if _no_relay_service.is_set():
            kwargs.update(relayMaxReservations=0, relayMaxCircuits=0)
        return original(*args, **kwargs)

    P2P._make_process_args = staticmethod(make_process_args)
