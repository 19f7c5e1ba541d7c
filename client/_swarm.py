"""The client's view of the swarm: its DHT peer, the servers of one model, and route choice.

Opening a session reads the model's records from the DHT, asks the router for the lowest-latency
route with room for the session, and opens it; a server that fails is excluded for a while
(doubling each time it fails again) so the next route avoids it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import hivemind
from hivemind.p2p import P2P

from client._remote_session import RemoteSession
from client.errors import RoutingError, ServerError
from swarm.dht_records import fetch_servers
from swarm.records import ServerState
from swarm.routing import MaxFlowRouter, NoRouteError, RouteHop, RoutePlanner
from swarm.streams import ping_many
from swarm.validation import PeerIdSignatureValidator

logger = logging.getLogger(__name__)

RTT_TTL = 60.0  # seconds a measured client->server RTT is trusted
PING_TIMEOUT = 2.0


@dataclass
class ExclusionList:
    """Peers that failed us recently, each until a deadline that doubles on repeat failures."""

    base_seconds: float = 15.0
    max_seconds: float = 600.0
    _until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, int] = field(default_factory=dict)

    def add(self, peer_id: str) -> None:
        strikes = self._strikes.get(peer_id, 0) + 1
        self._strikes[peer_id] = strikes
        self._until[peer_id] = time.monotonic() + min(self.max_seconds, self.base_seconds * 2 ** (strikes - 1))

    def current(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, until in self._until.items() if until > now}


class SwarmClient:
    def __init__(
        self,
        dht: hivemind.DHT,
        p2p: P2P,
        model: str,
        num_blocks: int,
        *,
        router: Optional[RoutePlanner] = None,
        request_timeout: float = 60.0,
        max_route_attempts: int = 5,
        route_retry_delay: float = 1.0,
    ):
        self.dht, self.p2p, self.model, self.num_blocks = dht, p2p, model, num_blocks
        self.router = router or MaxFlowRouter()
        self.request_timeout = request_timeout
        self.max_route_attempts = max_route_attempts
        self.route_retry_delay = route_retry_delay
        self.excluded = ExclusionList()
        self._rtts: dict[str, tuple[float, float]] = {}  # peer id -> (measured at, RTT seconds)

    @classmethod
    async def connect(cls, initial_peers: list[str], model: str, num_blocks: int, **kwargs) -> "SwarmClient":
        dht = hivemind.DHT(
            initial_peers=initial_peers,
            client_mode=True,
            record_validators=[PeerIdSignatureValidator()],
            start=True,
        )
        p2p = await dht.replicate_p2p()
        return cls(dht, p2p, model, num_blocks, **kwargs)

    async def open_session(self, max_length: int) -> RemoteSession:
        """A session on a fresh route; retries (bounded) past busy or dead servers and empty swarms."""
        last_error: Exception | None = None
        for attempt in range(self.max_route_attempts):
            if attempt:
                await asyncio.sleep(self.route_retry_delay * 2 ** (attempt - 1))
            try:
                route = await self._plan(max_length)
            except NoRouteError as e:
                logger.info(f"No route yet (attempt {attempt + 1}/{self.max_route_attempts}): {e}")
                last_error = RoutingError(str(e), e.missing_blocks)
                continue
            session = RemoteSession(self.p2p, route, max_length, timeout=self.request_timeout)
            try:
                await session.open()
                return session
            except ServerError as e:
                self.router.release(route)
                if not e.retryable:
                    raise
                logger.info(f"Could not open a session on {e.peer_id or 'the route'}: {e}; trying another route")
                self.exclude(e.peer_id or route[0].peer_id)
                last_error = e
        assert last_error is not None
        raise last_error

    async def _plan(self, max_length: int):
        loop = asyncio.get_running_loop()
        servers = await loop.run_in_executor(None, fetch_servers, self.dht, self.model, self.num_blocks)
        logger.debug(f"Routing over {[(s.public_name or s.peer_id[:8], s.span, s.state.value) for s in servers]}")
        rtts = await self._client_rtts(servers)
        return self.router.plan(
            servers, 0, self.num_blocks, max_length=max_length, exclude=self.excluded.current(), client_rtts=rtts
        )

    async def _client_rtts(self, servers) -> dict[str, float]:
        """RTTs from this client to the servers that can be a head or a tail (the client's own
        links of a lap), measured with one ping each and remembered for ``RTT_TTL`` seconds."""
        now = time.monotonic()
        ends = [  # only ONLINE servers are routed to; a JOINING one has no handlers yet
            s.peer_id for s in servers
            if s.state == ServerState.ONLINE and (s.start_block == 0 or s.end_block == self.num_blocks)
        ]  # fmt: skip
        stale = [p for p in ends if now - self._rtts.get(p, (float("-inf"), 0.0))[0] > RTT_TTL]
        for peer_id, rtt in (await ping_many(self.p2p, stale, PING_TIMEOUT)).items():
            if rtt is not None:
                self._rtts[peer_id] = (now, rtt)
        return {p: self._rtts[p][1] for p in ends if p in self._rtts}

    async def unresponsive(self, route: Sequence[RouteHop], timeout: float = 3.0) -> list[str]:
        """The hops of ``route`` that do not answer a ping within ``timeout`` seconds."""
        rtts = await ping_many(self.p2p, [hop.peer_id for hop in route], timeout)
        return [peer_id for peer_id, rtt in rtts.items() if rtt is None]

    def exclude(self, peer_id: str) -> None:
        if peer_id:
            logger.info(f"Excluding server {peer_id} for a while")
            self.excluded.add(peer_id)

    async def close_session(self, session: RemoteSession) -> None:
        self.router.release(session.route)
        await session.close()

    async def aclose(self) -> None:
        """Close our handle on the libp2p daemon, then stop the DHT process (which owns it)."""
        try:
            await self.p2p.shutdown()
        finally:
            self.dht.shutdown()
