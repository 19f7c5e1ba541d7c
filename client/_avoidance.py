"""Which servers a generation avoids after unsettled disputes, by machine group, and in which order
it falls back on them (docs/reliability.md, "Disputes": "Avoiding machine groups").

A dispute nobody trusted settled (a verdict audit's or a spot-check's) convicts nobody: both servers
are avoided for the rest of the generation, which re-verifies its tokens without them. Avoiding only
those two is not enough against sybils on one machine: after honest T and sybil S1 disagree, the
generation went on with S2, S1's group-mate, and nobody independent was left to refute it. So a
dispute between A and B is a dispute between their *machine groups* (client/_witnesses.py): every
server of either group is avoided (trusted servers excepted: they are independent of anyone).

Where that leaves no server for some blocks, the route falls back on avoided servers, in this order
(``fallback_key``): the group that was a side of fewer unsettled disputes first; then the group with
fewer identities (an honest volunteer is one identity on its machine; sybils are many on one);
within a group, a server that was not itself a side of a dispute before one that was. With one-group
sybils S1, S2 and an honest T that disputed S1, the sybils' group has two identities and T's one, so
the generation verifies on T: the output is T's, and its tokens stay flagged unconfirmed, since no
independent server is left that has not already disagreed with T. On a swarm where each tail is its
own group this is the old rule: the two disputants avoided, nobody else.

Witnesses (shadows, thirds, spot-check substitutes) are chosen the same way (``witness_order``): a
server of a group evidence refuted never (client/_evidence.py: it lied in this generation); a server
of a group that already disputed the checked server's group never (their disagreement is known, and
a second one settles nothing, it only costs a re-verification); servers of other disputed groups
after the undisputed ones. A side of an unsettled dispute may still witness for a third group. Why:
after honest T and a sybil S1 disagreed and nothing settled it, barring T from witnessing left the
next sybil S2 with sybils alone as witnesses, which confirmed its lies (measured: 74 wrong tokens
unflagged in 20 generations, three sybils on a /24 each, docs/reliability.md); T disagreeing with S2
costs a re-verification at most and goes to evidence like any dispute.

Falling back, a group evidence refuted comes after every group that was only disputed, and among
those, a group's unsettled disputes count less each time evidence upheld one of its servers against
another (``fallback_key``): a refutation is the client's own finding, a dispute only that one of two
lied. Why: an honest T that disputed S1 unsettled, then refuted S2 and S3 by evidence, was tied with
S1 (one dispute each) and the fallback went by peer id. What is still tied at the end is broken by a
keyed hash of the peer id that only this client can compute, never by the peer id itself, which a sybil
can grind to sort first.

A group a near tie's evidence leaned against (``leaned``: client/_evidence.py ``lean``, the side whose
token loses at the one hidden state both tails sent) comes after every group that no evidence leaned
against or refuted, whatever their counts of unsettled disputes, and before the refuted ones. Why: a
liar naming the runner-up where the top two are within the bounds (sized for 16-bit GPUs) is a near tie
on float32 servers, and the coin then fell on the liar half the time; and the count of unsettled
disputes is a vote sybils win: an honest T that disputed three sybils on groups of their own, each at
such a near tie, had three disputes to their one each and fell back behind all three; and an upheld
dispute is one too (a sybil of another group lies where the live one is honest, and is refuted). A lean cannot
be made against an honest tail by the tails alone: both must send one state, at which the honest
tail's own token wins; a head that feeds both a false state can make evidence refute the honest tail
outright, which already counts first.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import Counter
from typing import Collection, Iterable, Optional, Sequence

from client._witnesses import Witnesses


class Avoidance:
    """A generation's unsettled disputes, by machine group: who is avoided, and the fallback order."""

    def __init__(self, witnesses: Witnesses):
        self.witnesses = witnesses
        self.peers: set[str] = set()  # every avoided server (the decoder's ``avoid`` set, shared)
        self.disputants: set[str] = set()  # the servers that were themselves a side of a dispute
        self.disputes: Counter[str] = Counter()  # machine group -> unsettled disputes it was a side of
        self.refutations: Counter[str] = Counter()  # machine group -> its servers evidence refuted
        self.upheld: Counter[str] = Counter()  # machine group -> its servers evidence upheld against another
        self.pairs: set[frozenset[str]] = set()  # the pairs of groups that disagreed
        self.leaned: Counter[str] = Counter()  # machine group -> near ties whose evidence leaned against it
        self.servers: set[str] = set()  # peer ids seen in server records (a group's identities count only those)
        self._salt = secrets.token_bytes(16)  # ties in the fallback order are broken by it (``_draw``)

    def reset(self) -> None:
        """A new generation (the decoder gives it a fresh ``avoid`` set through ``share``)."""
        self.disputants, self.disputes, self.pairs, self.servers = set(), Counter(), set(), set()
        self.refutations, self.upheld, self.leaned = Counter(), Counter(), Counter()

    def group(self, peer_id: str) -> str:
        """The server's machine group as last seen; a server of unknown address is its own group."""
        return self.witnesses.group_of(peer_id)

    def members(self, group: str) -> int:
        """How many server identities the client has seen on ``group`` (at least 1): peers without a
        server record (a DHT bootstrap node, another client on the same machine) do not count."""
        return max(1, sum(1 for p, g in self.witnesses.groups.items() if g == group and p in self.servers))

    def dispute(self, a: str, b: str, servers: Collection[str] = (), against: Optional[str] = None) -> set[str]:
        """``a`` and ``b`` disagreed and nobody trusted settled it: avoid both and every untrusted
        server of their machine groups (``servers``: the peer ids of the swarm's server records; none
        given: every peer the client is connected to counts; ``against``: the one of the two a near tie's
        evidence leans against, client/_evidence.py ``lean``). Returns the servers newly avoided."""
        self.servers.update(servers or self.witnesses.groups)
        self.servers.update((a, b))
        if against in (a, b):
            self.leaned[self.group(against)] += 1
        groups = {self.group(a), self.group(b)}
        for g in groups:
            self.disputes[g] += 1
        self.pairs.add(frozenset(groups))
        self.disputants.update((a, b))
        mates = {
            p
            for p, g in self.witnesses.groups.items()
            if g in groups and p in self.servers and not self.witnesses.is_trusted(p)
        }
        new = ({a, b} | mates) - self.peers
        self.peers.update(new)
        return new

    def refuted(self, peer_id: str, servers: Collection[str] = (), upheld: Optional[str] = None) -> set[str]:
        """Evidence the client checked itself refuted ``peer_id`` (client/_evidence.py) without
        convicting it: avoid it and every untrusted server of its machine group; the side it disputed
        (``upheld``, where there was one) is not avoided. Returns the servers newly avoided."""
        if upheld is not None:
            self.upheld[self.group(upheld)] += 1
        self.servers.update(servers or self.witnesses.groups)
        self.servers.add(peer_id)
        group = self.group(peer_id)
        self.disputes[group] += 1
        self.refutations[group] += 1
        self.disputants.add(peer_id)
        mates = {
            p
            for p, g in self.witnesses.groups.items()
            if g == group and p in self.servers and not self.witnesses.is_trusted(p)
        }
        new = ({peer_id} | mates) - self.peers
        self.peers.update(new)
        return new

    def disputed(self, peer_ids: Sequence[str], servers: Collection[str] = (), against: Optional[str] = None) -> None:
        """A spot-check's or an upstream check's unsettled disagreement: two servers are a dispute;
        more (a three-way split) are each avoided, with their groups counted, no pair recorded."""
        if len(peer_ids) == 2:
            self.dispute(*peer_ids, servers=servers, against=against)
            return
        self.suspected(peer_ids)

    def suspected(self, peer_ids: Sequence[str]) -> None:
        """One of these servers answered otherwise and nothing says which (a three-way split, a route that
        answered a spot-check's replay otherwise than the live lap): each avoided, its group counted, no
        pair recorded (none of them disagreed with another)."""
        for p in peer_ids:
            self.disputes[self.group(p)] += 1
            self.disputants.add(p)
            self.peers.add(p)

    def group_standing(self, group: str) -> tuple[int, int, int, int]:
        """What orders machine groups, first first: refutations, leans against, unsettled disputes (upheld ones
        subtracted), identities (the module's docstring says why, in that order)."""
        unsettled = self.disputes[group] - self.refutations[group] - self.upheld[group]
        return self.refutations[group], self.leaned[group], unsettled, self.members(group)

    def fallback_key(self, peer_id: str) -> tuple:
        """The group's standing, then a server that was not itself a disputant first, then the client's draw."""
        return (*self.group_standing(self.group(peer_id)), peer_id in self.disputants, self._draw(peer_id))

    def _draw(self, peer_id: str) -> bytes:
        """The last tie-break: a keyed hash of the peer id, the key this client's own secret. Not the peer id
        itself: peer ids are free, so a sybil could grind one that sorts first and win every tie."""
        return hashlib.blake2b(peer_id.encode(), key=self._salt, digest_size=8).digest()

    def order(self, peer_ids: Iterable[str]) -> list[str]:
        """Avoided servers, the one to fall back on first first (the module's docstring says why)."""
        return sorted(peer_ids, key=self.fallback_key)

    def may_witness(self, witness: str, checked: Sequence[str]) -> bool:
        """Whether ``witness`` may check the servers ``checked`` as far as disputes go: its group was
        never refuted by evidence and never disagreed with one of theirs (the module's docstring)."""
        group = self.group(witness)
        if self.refutations[group]:
            return False
        return not any(frozenset((group, self.group(p))) in self.pairs for p in checked if p != witness)

    def witness_order(self, candidates: Sequence, checked: Sequence[str]) -> list:
        """The candidates (records with ``peer_id``) that may witness for ``checked``: undisputed groups
        first (stable otherwise, so a caller's trusted-first order survives), then by their group's standing."""
        fit = [c for c in candidates if self.may_witness(c.peer_id, checked)]
        standing = self.group_standing
        return sorted(fit, key=lambda c: (1, *standing(self.group(c.peer_id))) if c.peer_id in self.peers else (0,))
