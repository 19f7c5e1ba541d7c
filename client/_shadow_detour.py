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
returned. ``independent_hops`` is the choice of such servers, which the forward-pass audits' second and third
routes use as well (client/_output_audits.py).
"""

from __future__ import annotations

import random
from typing import Collection, Iterable, Sequence

from client._spot_checks import alternatives
from client._swarm import SECOND_PING
from client._witnesses import Witnesses
from protocol.messages import Hop


async def independent_hops(
    swarm,
    witnesses: Witnesses,
    rng: random.Random,
    route: list[Hop],
    indices: Iterable[int],
    exclude: Collection[str],
    length: int,
    independent_of: Sequence[str],
    avoidance=None,
) -> tuple[list[Hop], set[str]]:
    """``route`` with each hop of ``indices`` computed by another server of its blocks and precision (none of
    ``exclude`` nor of the route, room for ``length`` tokens) that answers the client's ping and, given
    ``independent_of``, could not be the same operator as any of them (client/_witnesses.py; given ``avoidance``,
    one that may witness for them too), trusted first, else drawn at random; a hop without one stays. Also the
    servers silent to the pings. The verdict audits' detour and the forward-pass audits' routes share it."""
    pools = {i: alternatives(route, i, swarm.records, exclude, length) for i in indices}
    candidates, dead = [info for pool in pools.values() for info in pool], set()
    if candidates:  # ping them so that this client holds connections, whose addresses it reads
        pings = [Hop(peer_id=c.peer_id, start=0, end=0) for c in candidates]
        dead = set(await swarm.unresponsive(pings, again=SECOND_PING))
        await witnesses.refresh(swarm.p2p)
    out, used = list(route), {hop.peer_id for hop in route}
    for i, pool in pools.items():
        pool = [c for c in pool if c.peer_id not in dead and c.peer_id not in used]
        rng.shuffle(pool)
        if independent_of:  # never a disputant, nor a group that disputed one of theirs (client/_avoidance.py)
            if avoidance is not None:
                pool = [c for c in pool if avoidance.may_witness(c.peer_id, independent_of)]
            pool = witnesses.choose(pool, independent_of)
        else:
            pool.sort(key=lambda c: not witnesses.is_trusted(c.peer_id))
        if pool:
            out[i] = Hop(peer_id=pool[0].peer_id, start=route[i].start, end=route[i].end)
            used.add(pool[0].peer_id)
    return out, dead


async def detour(
    swarm, witnesses: Witnesses, rng: random.Random, route: list[Hop], length: int, exclude: Collection[str]
) -> list[Hop]:
    """``route`` with each hop before its tail replaced by an independent server of the same blocks and precision
    where the swarm has one (room for ``length`` tokens, none of ``exclude``); the tail stays. Servers silent to
    the client's own ping (twice) are excluded, as a shadow's tail is."""
    live = [hop.peer_id for hop in route]
    detoured, dead = await independent_hops(swarm, witnesses, rng, route, range(len(route) - 1), exclude, length, live)
    for peer_id in dead:
        swarm.exclude(peer_id)  # the client's own failed ping: evidence
    return detoured


def same_blocks(a: list[Hop], b: list[Hop]) -> bool:
    """Whether two routes split the blocks the same way (whoever computes them)."""
    return [(hop.start, hop.end) for hop in a] == [(hop.start, hop.end) for hop in b]
