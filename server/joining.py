"""How a server claims its span before it loads weights: the ``JOINING`` announcement.

A server announces a ``JOINING`` record for its span as soon as it has chosen it, before it loads
weights (which can take minutes), and refreshes it until it announces ``ONLINE``. Routing ignores
joining servers (``protocol.flow.ROUTABLE`` is ``ONLINE`` only: a client never sends a session to
a server that is still loading), while block placement counts them (``_PLACED`` is ``JOINING`` and
``ONLINE``: :func:`protocol.placement.choose_best_span` and the rebalancing
:func:`protocol.placement.should_move`), so a server that starts while another is still loading sees
that span as taken and fills another gap.

A joining server's throughput is not known until it has loaded and measured its span, so its
record carries a conservative placeholder, :func:`joining_throughput`: the speed of the slowest
``ONLINE`` server of the model (per block, converted to the joining span's length), or
:data:`JOINING_THROUGHPUT` (1 token/s) while none is online. Block selection counts the server it
is placing with the same figure. Not 1 token/s always: next to servers measured at hundreds of
tokens/s such a figure would make the span being loaded look empty, and the rebalancing of a
running server would move onto it, only to move back once the newcomer is measured. Not more
than the slowest: a newcomer may well be a slow machine; once it is online its own measurement
replaces the placeholder and rebalancing corrects whatever the guess got wrong.

**Servers started at the same moment.** Both may read the swarm before either has announced, and
pick the same gap. :func:`claim_span` narrows that race for servers that choose their own blocks
(``--num-blocks``, or as many as fit in memory; a ``--blocks`` server just announces):

1. wait a random ``0..JOIN_JITTER`` seconds before reading the swarm, so that servers started
   together usually read one after the other has announced;
2. choose, announce ``JOINING`` (waiting until the DHT stored it), wait ``JOIN_SETTLE`` seconds and
   read the swarm again;
3. a *rival* is a server in that second read whose span overlaps ours, which the first choice did
   not count (it was absent, or held another span), and which *outranks* us: it is ``ONLINE`` (it
   already serves and will not look again), or it is ``JOINING`` and wins the pairwise draw
   :func:`rank` (a hash of both peer ids, so both sides agree on who yields without talking to
   each other);
4. if there is a rival, choose once more, counting everything in the second read except the new
   overlapping servers that we outrank (they yield to us, so they will move), and announce the
   new span if it differs. Only once: start-up stays bounded and two servers cannot chase each
   other. What overlap remains (three servers racing for one gap, or a rival whose record reached
   the DHT only after our second read) the periodic rebalancing (``--balance-period``) fixes later.

**Why not the claim time.** The order used to be ``(started_at, peer_id)``: the earlier claim kept
its span. But ``started_at`` is what a record says about itself, so a record claiming
``started_at=0`` outranked every honest newcomer, and a peer id that sorts low outranked the rest
on ties; a stranger could make every joining server yield to it. The pairwise draw cannot be
bought: whether ``a`` outranks ``b`` is ``sha256(a, b) < sha256(b, a)``, which no peer id wins
against most others (an identity ground to beat one rival wins against half of the rest), and
needs no clock. ``started_at`` is only the record's freshness now (the dashboard's uptime).
An ``ONLINE`` record still outranks a joining one; what a false ``ONLINE`` claim can steer is
bounded by how much placement believes of its throughput (:func:`protocol.placement.placement_view`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from typing import Awaitable, Callable, Optional, Sequence

import msgspec

from protocol.records import MIN_THROUGHPUT, ServerInfo, ServerState

logger = logging.getLogger(__name__)

JOINING_THROUGHPUT = 1.0  # tokens/s announced while joining when no online server gives a better guess
JOIN_JITTER = 2.0  # seconds: the random wait before the first read is drawn from 0..JOIN_JITTER
JOIN_SETTLE = 2.0  # seconds between announcing JOINING and reading the swarm again

Span = tuple[int, int]
Fetch = Callable[[], Awaitable[Sequence[ServerInfo]]]  # every server's record (may include ours)
Publish = Callable[[ServerInfo], Awaitable[None]]  # store a record and wait until it is stored


def joining_throughput(servers: Sequence[ServerInfo], span_length: int) -> float:
    """Placeholder throughput (tokens/s for the whole span) of a server that has not measured its
    span yet: the slowest ``ONLINE`` server's per-block speed (``throughput * blocks``) spread over
    ``span_length`` blocks; :data:`JOINING_THROUGHPUT` when no server is online."""
    speeds = [
        s.throughput * (s.end_block - s.start_block)
        for s in servers
        if s.state == ServerState.ONLINE and s.throughput > 0 and s.end_block > s.start_block
    ]
    # at least MIN_THROUGHPUT: readers drop records below it, so a hostile record claiming a crawl
    # cannot make our JOINING record invisible to placement
    return max(MIN_THROUGHPUT, min(speeds) / max(1, span_length)) if speeds else JOINING_THROUGHPUT


def rank(peer_id: str, other: str) -> bytes:
    """``peer_id``'s draw against ``other``: the smaller draw keeps a span both claimed while joining.
    Pairwise (it depends on both ids), so no peer id outranks most others, and the order of two
    peers is the same wherever it is computed."""
    return hashlib.sha256(f"{peer_id}\0{other}".encode()).digest()


def outranks(other: ServerInfo, mine: ServerInfo) -> bool:
    """Whether ``other`` keeps its span when it and ``mine`` (joining) picked overlapping ones:
    an ``ONLINE`` server always does; of two joining ones, the one that wins :func:`rank`
    (never the claimed ``started_at``, which a record sets as it likes)."""
    if other.state == ServerState.ONLINE:
        return True
    if other.state != ServerState.JOINING or other.peer_id == mine.peer_id:
        return False
    return rank(other.peer_id, mine.peer_id) < rank(mine.peer_id, other.peer_id)


def _overlaps(a: ServerInfo, b: ServerInfo) -> bool:
    return a.start_block < b.end_block and b.start_block < a.end_block


def _placements(servers: Sequence[ServerInfo]) -> set[tuple[str, int, int]]:
    return {(s.peer_id, s.start_block, s.end_block) for s in servers}


def _new_overlapping(mine: ServerInfo, counted: Sequence[ServerInfo], fresh: Sequence[ServerInfo]) -> list[ServerInfo]:
    """Placed (joining or online) servers in ``fresh`` that the choice did not count and that overlap ``mine``."""
    seen = _placements(counted)
    placed = (ServerState.JOINING, ServerState.ONLINE)
    return [
        s
        for s in fresh
        if s.peer_id != mine.peer_id
        and s.state in placed
        and _overlaps(s, mine)
        and (s.peer_id, s.start_block, s.end_block) not in seen
    ]


def rivals(mine: ServerInfo, counted: Sequence[ServerInfo], fresh: Sequence[ServerInfo]) -> list[ServerInfo]:
    """Servers that took a span overlapping ``mine`` while we chose, and outrank us (rule 3 above)."""
    return [s for s in _new_overlapping(mine, counted, fresh) if outranks(s, mine)]


def recount(mine: ServerInfo, counted: Sequence[ServerInfo], fresh: Sequence[ServerInfo]) -> list[ServerInfo]:
    """What the second choice counts (rule 4): the second read, less ourselves and the new
    overlapping servers that yield to us."""
    yielding = {s.peer_id for s in _new_overlapping(mine, counted, fresh) if not outranks(s, mine)}
    return [s for s in fresh if s.peer_id != mine.peer_id and s.peer_id not in yielding]


async def claim_span(
    template: ServerInfo,
    choose: Callable[[Sequence[ServerInfo]], Span],
    fetch: Fetch,
    publish: Publish,
    *,
    automatic: bool = True,
    jitter: float = JOIN_JITTER,
    settle: float = JOIN_SETTLE,
    now: Callable[[], float] = time.time,
) -> ServerInfo:
    """Choose a span, announce it as ``JOINING`` and return that record (see the module docstring).

    ``template`` is this server's record (peer id, model, name, dtype...); ``choose`` maps the other
    servers' records to a span. With ``automatic=False`` (``--blocks``: ``choose`` ignores the
    swarm) the span is announced at once, with no random wait and no second read.
    """
    me = template.peer_id

    async def others() -> list[ServerInfo]:
        return [s for s in await fetch() if s.peer_id != me]

    if automatic and jitter > 0:
        await asyncio.sleep(random.uniform(0, jitter))
    counted = await others()  # with --blocks, read only for the placeholder throughput
    start, end = choose(counted)
    mine = msgspec.structs.replace(
        template,
        start_block=start,
        end_block=end,
        state=ServerState.JOINING,
        throughput=joining_throughput(counted, end - start),
        started_at=now(),
    )
    await publish(mine)
    if not automatic:
        return mine
    await asyncio.sleep(settle)
    fresh = await others()
    found = rivals(mine, counted, fresh)
    if not found:
        return mine
    names = ", ".join(
        f"{r.public_name or r.peer_id[:8]} ({r.state.value} {r.start_block}:{r.end_block})" for r in found
    )
    second = recount(mine, counted, fresh)
    span = choose(second)
    if span == (start, end):
        logger.info(f"Blocks {start}:{end} were also taken by {names} while choosing; still the best span, keeping it")
        return mine
    logger.info(f"Blocks {start}:{end} were also taken by {names} while choosing; taking {span[0]}:{span[1]} instead")
    mine = msgspec.structs.replace(
        mine, start_block=span[0], end_block=span[1], throughput=joining_throughput(second, span[1] - span[0])
    )
    await publish(mine)
    return mine


def keep_announcing(publish: Callable[[ServerInfo], object], info: ServerInfo, period: float) -> asyncio.Task:
    """Refresh ``info`` every ``period`` seconds until the task is cancelled (records expire after
    three periods; loading a large span takes longer than that)."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(period)
            try:
                publish(info)
            except Exception as e:  # a DHT hiccup must not stop the refreshes
                logger.warning(f"Could not refresh the joining record: {e!r}")

    return asyncio.create_task(loop())


def leave(publish: Callable[[ServerInfo], object], info: Optional[ServerInfo]) -> None:
    """Best effort: say ``OFFLINE`` for a span this server claimed but will not serve."""
    if info is None:
        return
    try:
        publish(msgspec.structs.replace(info, state=ServerState.OFFLINE))
    except Exception as e:
        logger.warning(f"Could not announce offline: {e!r}")
