"""Shadow routes around the live route's head and middles, once they stalled an audit (docs/reliability.md,
"Verdict audits"; issue 35).

A shadow shares the live route's hops before the tail, so that a head or middle that lies in its activations
makes both tails compute from the same wrong input and cannot get an honest tail disputed (the spot-checks
catch such a hop). But a shared hop sees the client open a second session with the generation's prompt while
the first is open, and a hop that shields a lying tail can drop that session's Steps: every audit then ends
with no verdict after the request timeout, nobody is blamed, and every token is returned unconfirmed. So after
an audit of a generation ended with no verdict, its shadows take a detour: each hop before the tail is computed
by another server of its blocks and precision that answers the client's ping and could not be the same operator
as any server of the live route (client/_witnesses.py), a trusted one first, else one drawn at random; a hop
with no such server stays as it was. The audit that failed is tried again on the detour before the output is
returned.
"""

from __future__ import annotations

import random
from typing import Collection

from client._spot_checks import alternatives, substituted
from client._swarm import SECOND_PING
from client._witnesses import Witnesses
from protocol.messages import Hop


async def detour(
    swarm, witnesses: Witnesses, rng: random.Random, route: list[Hop], length: int, exclude: Collection[str]
) -> list[Hop]:
    """``route`` with each hop before its tail replaced by an independent server of the same blocks and precision
    where the swarm has one (room for ``length`` tokens, none of ``exclude``); the tail stays. Servers silent to
    the client's own ping (twice) are excluded, as a shadow's tail is."""
    detoured = list(route)
    live = [hop.peer_id for hop in route]
    for index in range(len(route) - 1):
        picked = {hop.peer_id for hop in detoured}  # never one server for two hops
        found = [s for s in alternatives(route, index, swarm.records, exclude, length) if s.peer_id not in picked]
        if not found:
            continue
        dead = set(await swarm.unresponsive([Hop(peer_id=s.peer_id, start=0, end=0) for s in found], again=SECOND_PING))
        for peer_id in dead:
            swarm.exclude(peer_id)  # the client's own failed ping: evidence
        await witnesses.refresh(swarm.p2p)  # the pings opened connections: their addresses
        found = witnesses.choose([s for s in found if s.peer_id not in dead], live)
        if not found:
            continue
        trusted = [s for s in found if witnesses.is_trusted(s.peer_id)]
        pick = trusted[0] if trusted else rng.choice(found)
        detoured = substituted(detoured, index, pick.peer_id)
    return detoured


def same_blocks(a: list[Hop], b: list[Hop]) -> bool:
    """Whether two routes split the blocks the same way (whoever computes them)."""
    return [(hop.start, hop.end) for hop in a] == [(hop.start, hop.end) for hop in b]
