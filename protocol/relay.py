"""Dialing servers that are reachable only through a relay.

A server behind NAT announces circuit addresses (``<relay>/p2p-circuit/p2p/<its id>``) in its
record (``ServerInfo.relay_addrs``); route hops carry them to the servers upstream of it
(``Hop.addrs``). Whoever reads them :func:`remember`\\ s them, and :func:`dial_if_relayed` (called
before every stream is opened) hands them to libp2p once, so the stream goes through the relay;
libp2p cannot find them by itself because the relayed server is a DHT client that no one can ask.

Only circuit addresses are taken from records and peers: a hostile record cannot make a reader
dial arbitrary hosts directly, and each peer keeps at most :data:`MAX_RELAY_ADDRS`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from protocol import hivemind_private

logger = logging.getLogger(__name__)

MAX_RELAY_ADDRS = 4
MAX_ADDR_CHARS = 512
MAX_REMEMBERED_PEERS = 4096
DIAL_TIMEOUT = 15.0

_addrs: dict[str, tuple[str, ...]] = {}  # peer id -> its circuit addresses


def is_circuit_addr(text: str, peer_id: str) -> bool:
    """``/.../p2p/<relay>/p2p-circuit/p2p/<peer_id>``, well formed and short."""
    if not isinstance(text, str) or len(text) > MAX_ADDR_CHARS or not text.endswith(f"/p2p-circuit/p2p/{peer_id}"):
        return False
    try:
        Multiaddr(text)
    except Exception:
        return False
    return True


def valid_circuit_addrs(addrs: Iterable[str], peer_id: str) -> tuple[str, ...]:
    return tuple(a for a in addrs if is_circuit_addr(a, peer_id))[:MAX_RELAY_ADDRS]


def remember(peer_id: str, addrs: Iterable[str]) -> None:
    """Note the circuit addresses of ``peer_id`` (invalid ones are dropped)."""
    valid = valid_circuit_addrs(addrs, peer_id)
    if not valid:
        return
    if peer_id not in _addrs and len(_addrs) >= MAX_REMEMBERED_PEERS:
        _addrs.pop(next(iter(_addrs)))
    _addrs[peer_id] = valid


def known_addrs(peer_id: str) -> tuple[str, ...]:
    return _addrs.get(peer_id, ())


async def dial_if_relayed(p2p: P2P, peer_id: PeerID) -> None:
    """Connect to ``peer_id`` through its relays if it has any (a no-op round trip to p2pd when
    already connected); errors are left to the stream that follows."""
    text = peer_id.to_base58()
    addrs = _addrs.get(text)
    if not addrs:
        return
    suffix = f"/p2p/{text}"
    try:
        maddrs = [Multiaddr(a[: -len(suffix)]) for a in addrs]
        await asyncio.wait_for(hivemind_private.connect(p2p, peer_id, maddrs), DIAL_TIMEOUT)
    except Exception as e:
        logger.debug(f"Could not dial {text} through its relays: {e}")
