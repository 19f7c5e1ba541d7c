"""What a running server does between sessions: measure its links, keep its record fresh, and
move to a better span when the swarm needs it elsewhere.

RTTs to the next servers are measured by this server itself (a Ping/Pong exchange over libp2p)
and announced in its record, so routers can weigh server-to-server links without measuring them.
"""

from __future__ import annotations

import logging
from typing import Sequence

from hivemind.p2p import P2P

from protocol.records import ServerInfo, ServerState
from protocol.streams import ping_many

logger = logging.getLogger(__name__)

MAX_PINGED = 8  # next servers measured per refresh


def upkeep_blocks(me: ServerInfo, total: int) -> list[int]:
    """The blocks whose records a refresh needs when it does not rebalance: the block before ours
    (servers that hand sessions to us: ``SessionHandler.known_servers``) and the block after ours
    (the next servers, whose RTTs the record carries). Reading every block each period made each
    server search all of the model's keys every 15 s, which with 24 servers on one machine kept the
    DHT processes and their daemons busier than the models (docs/scale.md, "Churn")."""
    return [b for b in (me.start_block - 1, me.end_block) if 0 <= b < total]


def next_servers(me: ServerInfo, servers: Sequence[ServerInfo]) -> list[ServerInfo]:
    """Servers a route could hand over to after this one: those holding the block after ours."""
    return [
        s
        for s in servers
        if s.peer_id != me.peer_id and s.state == ServerState.ONLINE and s.start_block <= me.end_block < s.end_block
    ]


async def measure_next_pings(
    p2p: P2P, me: ServerInfo, servers: Sequence[ServerInfo], timeout: float = 5.0
) -> dict[str, float]:
    candidates = next_servers(me, servers)[:MAX_PINGED]
    rtts = await ping_many(p2p, [s.peer_id for s in candidates], timeout)
    return {peer_id: rtt for peer_id, rtt in rtts.items() if rtt is not None}
