"""Caps per machine, not per peer id (docs/reliability.md, "Caps per machine"): a peer id costs
nothing, so a stranger with 50 of them would pass every per-peer cap 50 times. A session a client
opens at this server (the route's head, or any hop whose upstream is not an announced server of the
previous blocks: admission.cap_owner) also counts against the *source address* this server's libp2p
daemon observes on the connection, and one address holds at most ``share`` of this server's session
slots and of its cache budget.

The address is the connection's remote multiaddr that this server's own daemon reports with each
stream it hands over (protocol/streams.py), never anything the peer sends. A public address counts
by its prefix, /24 for IPv4 and /48 for IPv6 (:func:`address_group`): one operator rents addresses
by the block, so 50 addresses of one /24 hold one share, as the client's witnesses group them
(client/_witnesses.py). Loopback is exempt by default: a connection from 127.0.0.0/8 or ::1 comes
from a process on this machine (the operator's own gateway or clients, every test), which a stranger
cannot start; ``--cap-loopback`` counts it by /24 as a public address (the tests set it, and give
their "machines" addresses of different /24s of 127.0.0.0/8). A private address counts as itself
(a LAN or a container network: one address per machine there, and no stranger outside the network
has one). A relayed connection shows the relay's address, so clients behind one relay share its
share; where no address is known the per-peer caps alone apply. Subscribes waiting at the tail for
their sessions (server/subscribe.py) and the tail's unread results (server/results.py) are capped
per address group the same way.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Iterable, Optional

from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import DEFAULT_MAX_SHARE_PER_ADDRESS

logger = logging.getLogger(__name__)


def source_address(addrs: Iterable[object]) -> Optional[str]:
    """The IP of the first connection multiaddr that names one (a relayed one: the relay's)."""
    for addr in addrs:
        parts = str(addr).split("/")
        for key in ("ip4", "ip6"):
            if key in parts and parts.index(key) + 1 < len(parts):
                return parts[parts.index(key) + 1]
    return None


# private and link-local networks (RFC 1918, RFC 3927, RFC 4193, RFC 4291): a LAN's or a container
# network's own addresses, one machine each. Not Python's ``is_private``, which also holds the
# documentation ranges (203.0.113.0/24, 2001:db8::/32) that stand for public addresses in tests.
LOCAL_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "fc00::/7", "fe80::/10")
)


def address_group(address: str) -> str:
    """What the caps count ``address`` under: its /24 (IPv4) or /48 (IPv6) network, written as a
    prefix; a private or link-local address (or a name that is no IP) as itself."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if any(ip in network for network in LOCAL_NETWORKS if network.version == ip.version):
        return address
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class AddressCaps:
    """The share one source address may hold, and the address a peer's connection comes from."""

    def __init__(self, share: float = DEFAULT_MAX_SHARE_PER_ADDRESS, cap_loopback: bool = False):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"--max-share-per-address must be in (0, 1], got {share}")
        self.share, self.cap_loopback = share, cap_loopback

    def key_of(self, stream: object) -> Optional[str]:
        """The address a stream we serve comes from, as the caps count it (None: not capped by address).
        It is the remote multiaddr our own daemon reports with the stream (protocol/streams.py serve): no
        daemon call per session, and nothing the peer sent."""
        address = source_address([getattr(stream, "remote_addr", None) or ""])
        if address is None or (is_loopback(address) and not self.cap_loopback):
            return None
        return address_group(address)

    def most_unread(self, max_unread_bytes: int) -> int:
        """Unread result bytes one address may hold at the tail, of the server's ``max_unread_bytes``."""
        return max(1, int(self.share * max_unread_bytes))

    def most_sessions(self, max_sessions: int) -> int:
        """Sessions (and pending Subscribes) one address may hold of ``max_sessions``."""
        return max(1, int(self.share * max_sessions))

    def check(
        self, address: Optional[str], held: tuple[int, int], max_length: int, max_sessions: int, total_tokens: int
    ) -> None:
        """Refuse a session that would take ``address`` past its share; ``held``: its (sessions, tokens)."""
        if address is None:
            return
        sessions, tokens = held
        most_sessions = self.most_sessions(max_sessions)
        if sessions >= most_sessions:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"address {address} already holds {sessions} of this server's {max_sessions} session slots "
                f"(at most {most_sessions} per address, --max-share-per-address {self.share:g}), whatever its peer ids",
            )
        most_tokens = int(self.share * total_tokens)
        if tokens + max_length > most_tokens:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"address {address} already reserves {tokens} cache tokens here: {max_length} more exceed its "
                f"share of {most_tokens} of {total_tokens} (--max-share-per-address {self.share:g})",
            )
