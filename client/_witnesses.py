"""Who may witness for whom: trusted peers, and independence by the network address the client
itself is connected to (docs/reliability.md, "Witnesses").

An identity costs nothing, so a second server agreeing with a first is evidence only when the two
could not be one operator as far as the client can tell. The client never believes an address a
record claims: it asks its own libp2p daemon which address each connection it holds to a server
runs over (``P2P.list_peers``; a connection is authenticated by the peer's key, so it is that
peer's machine or a relay it uses). Two servers count as one *machine group* when their addresses
share:

- a public IPv4 /24 or IPv6 /48 (one operator rents addresses by the block, not one by one);
- the exact address, for private and link-local addresses (a LAN's hosts share a /24 honestly, and
  a stranger cannot take several private addresses of the user's own LAN from outside it);
- a relay (``/p2p-circuit``): every server behind one relay is one group, as far as the client
  can tell (conservative: NAT'd volunteers do not witness for each other through a shared relay).

Loopback addresses are the exception: a connection over 127.0.0.0/8 or ::1 reaches a process on the
client's own machine, which a stranger cannot start; such servers are the user's own (a local test
swarm, ``swarm.local``) and each counts as its own group, by peer id. A server the client holds no
connection to has no known address and is independent of nobody.

Trusted peers (``trusted_peers=``: servers the user runs or vouches for) settle what strangers
cannot: a verdict one of them confirms is confirmed, and a dispute one of them settles convicts.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from typing import Collection, Optional, Sequence

logger = logging.getLogger(__name__)


def machine_group(addr: str, peer_id: str) -> Optional[str]:
    """The group a connection address (a multiaddr string) puts its server in; None when unknown."""
    if "/p2p-circuit" in addr:
        relay = addr.split("/p2p-circuit")[0]
        host = _host(relay)
        return f"relay:{host or relay}"
    host = _host(addr)
    if host is None:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"dns:{host}"
    if ip.is_loopback:
        return f"local:{peer_id}"
    if ip.is_private or ip.is_link_local:
        return f"private:{ip}"
    prefix = 24 if ip.version == 4 else 48
    return f"net:{ipaddress.ip_network(f'{ip}/{prefix}', strict=False)}"


def _host(addr: str) -> Optional[str]:
    parts = addr.split("/")
    for key in ("ip4", "ip6", "dns", "dns4", "dns6"):
        if key in parts:
            at = parts.index(key)
            if at + 1 < len(parts):
                return parts[at + 1]
    return None


class Witnesses:
    """The client's view of who may witness for whom: trusted peers, and the machine group of each
    server it is connected to (refreshed from its own daemon before each choice of witnesses)."""

    def __init__(self, trusted: Collection[str] = ()):
        self.trusted = frozenset(trusted)
        self.groups: dict[str, str] = {}  # peer id -> machine group, as last seen

    def is_trusted(self, peer_id: str) -> bool:
        return peer_id in self.trusted

    async def refresh(self, p2p) -> None:
        """Read the addresses of this client's open connections from its own libp2p daemon."""
        try:
            peers = await p2p.list_peers()
        except Exception as e:  # the daemon is the client's own; without it nobody is independent
            logger.info(f"Could not list this client's connections: {e!r}")
            return
        for info in peers:
            peer_id = info.peer_id.to_base58()
            groups = [g for g in (machine_group(str(a), peer_id) for a in info.addrs) if g is not None]
            if groups:
                self.groups[peer_id] = groups[0]

    def group_of(self, peer_id: str) -> str:
        """The server's machine group as last seen; a server of unknown address is its own group."""
        return self.groups.get(peer_id) or f"peer:{peer_id}"

    def independent(self, witness: str, of: Sequence[str]) -> bool:
        """Whether ``witness`` could not be the same operator as any of ``of``: trusted, or on a
        known machine group none of them shares."""
        if witness in self.trusted:
            return True
        group = self.groups.get(witness)
        if group is None:
            return False
        return all(self.groups.get(peer) != group for peer in of if peer != witness)

    def choose(self, candidates: Sequence, of: Sequence[str]) -> list:
        """The candidates (records with ``peer_id``) that may witness for ``of``: trusted first, then one of
        each machine group before a second of any (the candidates' order otherwise). Why: audits take a
        bounded number of witnesses (the last audit six), and identities on one group, however many, are
        one operator as far as the client can tell; they must not crowd the other groups out of the six."""
        found = [c for c in candidates if self.independent(c.peer_id, of)]
        earlier: Counter[str] = Counter()  # group -> its candidates ranked so far
        rank: dict[str, int] = {}
        for c in found:
            group = self.group_of(c.peer_id)
            rank[c.peer_id] = earlier[group]
            earlier[group] += 1
        return sorted(found, key=lambda c: (c.peer_id not in self.trusted, rank[c.peer_id]))

    def unseen_first(self, candidates: Sequence, seen: Collection[str], last: Collection[str] = ()) -> list:
        """``candidates`` (in ``choose``'s order, those of ``last`` after the others) with the machine groups not in
        ``seen`` before those in it, within each rank (trusted first, one of each group before a second of any);
        those of ``last`` stay last, in their order. Why: the verdict audits' last witnesses past the pool were the
        first of a shuffled order, so a group that had verified already could take the place of one that never had
        (client/_shadow_turns.py; measured with eight candidate groups, one honest: in 1 generation of 10 the
        honest one verified nothing and 24 lies came back counted as confirmed)."""
        earlier: Counter[str] = Counter()
        keys: dict[str, tuple] = {}
        for c in candidates:
            if c.peer_id in last:
                continue
            group = self.group_of(c.peer_id)
            keys[c.peer_id] = (0, c.peer_id not in self.trusted, earlier[group], group in seen)
            earlier[group] += 1
        return sorted(candidates, key=lambda c: keys.get(c.peer_id, (1,)))

    def draw(self, rng, candidates: Sequence):
        """One of ``candidates`` (non-empty) at random, its machine group drawn first, so that a group's chance
        does not grow with the identities it holds (with every group of one candidate: one plain draw)."""
        by_group: dict[str, list] = {}
        for c in candidates:
            by_group.setdefault(self.group_of(c.peer_id), []).append(c)
        if len(by_group) == len(candidates):
            return rng.choice(candidates)
        return rng.choice(rng.choice(list(by_group.values())))


def trusted_set(peers: Optional[Collection[str]], default: Collection[str] = ()) -> frozenset[str]:
    """``trusted_peers=``, checked: peer ids (base58 strings); None: the default."""
    if peers is None:
        return frozenset(default)
    if isinstance(peers, str) or not all(isinstance(p, str) and p for p in peers):
        raise ValueError(f"trusted_peers must be a list of peer ids (strings), got {peers!r}")
    return frozenset(peers)
