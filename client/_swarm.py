"""The client's view of the swarm: its DHT peer, the servers of one model, and route choice.

Opening a session reads the model's records from the DHT, asks the router for the lowest-latency
route with room for the session, and opens it; a server that fails is excluded for a while
(doubling each time it fails again) so the next route avoids it. Routing uses the smaller of each
server's claimed throughput and what this client measured it deliver (client/_throughput.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

import hivemind
from hivemind.p2p import P2P

from client import _adapters
from client._remote_session import RemoteSession, SessionPrompts
from client._throughput import ThroughputMeter
from client.errors import RouteFault, RoutingError, ServerError
from protocol.dht import make_dht
from protocol.dht_records import fetch_servers, publish_report
from protocol.errors import ErrorCode
from protocol.identity import load_or_create_identity
from protocol.limits import DEFAULT_MAX_POSITIONS_PER_STEP
from protocol.messages import Hop
from protocol.records import ServerInfo, ServerState
from protocol.route_errors import NoRouteError
from protocol.routing import MaxFlowRouter, RoutePlanner, cap_throughput, same_model, with_adapter
from protocol.streams import ping_many

logger = logging.getLogger(__name__)

RTT_TTL = 60.0  # seconds a measured client->server RTT is trusted
PING_TIMEOUT = 2.0
SECOND_PING = 6.0  # a hop silent to one ping gets a second this long before it is excluded (a busy machine)
SUSPECT_SECONDS = 60.0  # a route's servers stay suspects this long after a fault nobody can be blamed for
STALLED_AUDIT_SECONDS = 600.0  # a hop shared by an audit that stalled is detoured around this long (doubling)
MAX_SUSPECT_SUBSETS = 64  # routing plans tried to avoid suspects before routing over them all


@dataclass
class ExclusionList:
    """Peers that failed us recently, each until a deadline that doubles on repeat failures; and
    peers caught lying (spot-checks), excluded for the rest of the client's life."""

    base_seconds: float = 15.0
    max_seconds: float = 600.0
    _until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, int] = field(default_factory=dict)
    _banned: set[str] = field(default_factory=set)

    def add(self, peer_id: str) -> None:
        strikes = self._strikes.get(peer_id, 0) + 1
        self._strikes[peer_id] = strikes
        self._until[peer_id] = time.monotonic() + min(self.max_seconds, self.base_seconds * 2 ** (strikes - 1))

    def ban(self, peer_id: str) -> None:
        """Exclude for good: a server whose outputs lost a spot-check's majority vote."""
        self._banned.add(peer_id)

    @property
    def banned(self) -> frozenset[str]:
        return frozenset(self._banned)

    def current(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, until in self._until.items() if until > now} | self._banned


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
        max_positions_per_step: int = DEFAULT_MAX_POSITIONS_PER_STEP,
        config_fingerprint: str = "",
        revision: str = "",
        active_adapter: str = "",
    ):
        """``max_positions_per_step``: the most positions one Step carries; longer prompts (and
        failover replays) are sent as several Steps (chunked prefill). Servers refuse a Step
        above their own limit (``step_too_large``), 512 by default."""
        if max_positions_per_step < 1:
            raise ValueError(f"max_positions_per_step must be >= 1, got {max_positions_per_step}")
        self.max_positions_per_step = max_positions_per_step
        # which model exactly (protocol.routing.same_model): routes never mix configs or weights
        self.config_fingerprint, self.revision = config_fingerprint, revision
        self.dht, self.p2p, self.model, self.num_blocks = dht, p2p, model, num_blocks
        self.router = router or MaxFlowRouter()
        self.request_timeout = request_timeout
        self.max_route_attempts = max_route_attempts
        self.route_retry_delay = route_retry_delay
        self.excluded = ExclusionList()
        # on a route that failed with no hop to blame (or on hearsay): avoided while others exist; longer
        # than an exclusion, so that the accuser is still avoided when an accused hop that missed a
        # ping comes back (a soft preference: it costs nothing where no other route exists)
        self.suspects = ExclusionList(base_seconds=SUSPECT_SECONDS)
        # the hops before the tail of a verdict audit that ended with no verdict: a later generation through
        # one of them starts its shadows on a detour (client/_shadow_detour.py) instead of waiting for a timeout
        self.stalled_audits = ExclusionList(base_seconds=STALLED_AUDIT_SECONDS)
        self._rtts: dict[str, tuple[float, float]] = {}  # peer id -> (measured at, RTT seconds)
        self.meter = ThroughputMeter()  # what each server delivered to this client
        self._records: dict[str, ServerInfo] = {}  # peer id -> the record the last route was planned from
        self.reports: Counter = Counter()  # peer id -> times a spot-check caught it lying (client/_spot_checks.py)
        self._publishing: Optional[asyncio.Future] = None
        self._closing = False
        self._stale = False  # the reports changed while a store was in flight
        # a prompt-tuned model's prompts [P, hidden] (and deep prompts) float32, sent to the head of every
        # session this client opens (generation, audits, replays alike); None: no prompts (client/_prompts.py)
        self.prompts: Optional[SessionPrompts] = None
        # a LoRA adapter (docs/fine_tuning.md) every session and training step applies: routes use only
        # servers that announce it, and every hop is asked to apply it; "": none. A call may override it
        # (client/_adapters.py): ``active_adapter`` is the call's
        self.default_adapter = active_adapter

    @property
    def active_adapter(self) -> str:
        """The LoRA adapter of the call running now (client/_adapters.py), else the model's ("": none)."""
        return _adapters.current(self.default_adapter)

    @active_adapter.setter
    def active_adapter(self, adapter: str) -> None:
        self.default_adapter = adapter

    @classmethod
    async def connect(cls, initial_peers: list[str], model: str, num_blocks: int, **kwargs) -> "SwarmClient":
        # an identity of its own (a fresh key per client), so that it can sign its spot-check reports
        dht = make_dht(initial_peers=initial_peers, client_mode=True, identity=load_or_create_identity(None))
        p2p = await dht.replicate_p2p()
        return cls(dht, p2p, model, num_blocks, **kwargs)

    async def open_session(self, max_length: int, avoid: Collection[str] = ()) -> RemoteSession:
        """A session on a fresh route; retries (bounded) past busy or dead servers and empty swarms.
        ``avoid``: servers a generation saw in an unsettled dispute, routed around where the swarm
        allows (as suspects are), never excluded; a sequence is a fallback order (the first is allowed
        first where the swarm leaves no route without them: client/_avoidance.py)."""
        last_error: Exception | None = None
        refusal: Optional[ServerError] = None  # the last server that refused (busy, ...), named if no route is left
        busy: set[str] = set()  # full right now, not broken: skipped by this call only, not by other sessions
        for attempt in range(self.max_route_attempts):
            if attempt:
                await asyncio.sleep(self.route_retry_delay * 2 ** (attempt - 1))
            try:
                route = await self._plan(max_length, busy, avoid)
            except NoRouteError as e:
                logger.info(f"No route yet (attempt {attempt + 1}/{self.max_route_attempts}): {e}")
                last_error = RoutingError(
                    f"{self.model}: {e}" + (f"; a server refused earlier: {refusal}" if refusal else ""),
                    e.missing_blocks,
                )
                continue
            session = RemoteSession(
                self.p2p,
                route,
                max_length,
                timeout=self.request_timeout,
                prompts=self.prompts,
                adapter=self.active_adapter,
            )
            session.max_positions_per_step = self.route_step_limit(route)
            try:
                await session.open()
                return session
            except ServerError as e:
                self.router.release(route)
                if not e.retryable:
                    raise
                logger.info(f"Could not open a session on {e.peer_id or 'the route'}: {e}; trying another route")
                if e.code == ErrorCode.BUSY and not isinstance(e, RouteFault):
                    busy.add(e.peer_id or route[0].peer_id)
                else:
                    await self.blame(route, e)
                last_error = refusal = e
        assert last_error is not None
        raise last_error

    async def plan_route(self, also_exclude: Collection[str] = (), attempts: Optional[int] = None) -> list[Hop]:
        """A route over every block for a training step (docs/design.md, "Fine-tuning"): no session opens
        and no cache is reserved. The caller gives it back with ``router.release``. ``also_exclude``: servers
        this step avoids (client/_train_routes.py). Where the records leave a block uncovered it reads the DHT
        again after a pause, as ``open_session`` does (a record that lapsed under load comes back with the
        server's next announcement), ``attempts`` (default ``max_route_attempts``) reads in all."""
        attempts = self.max_route_attempts if attempts is None else attempts
        last_error = RoutingError(f"{self.model}: no route planned ({attempts} attempts)")
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.route_retry_delay * 2 ** (attempt - 1))
            try:
                return await self._plan(0, also_exclude)
            except NoRouteError as e:
                logger.info(f"No training route yet (attempt {attempt + 1}/{attempts}): {e}")
                last_error = RoutingError(f"{self.model}: {e}", e.missing_blocks)
        raise last_error

    async def _plan(self, max_length: int, also_exclude: Collection[str] = (), avoid: Collection[str] = ()):
        loop = asyncio.get_running_loop()
        servers = await loop.run_in_executor(None, fetch_servers, self.dht, self.model, self.num_blocks)
        if self.config_fingerprint:
            servers = same_model(servers, self.config_fingerprint, self.revision)
        servers = with_adapter(servers, self.active_adapter, self.num_blocks)  # spot-checks' substitutes too
        logger.debug(f"Routing over {[(s.public_name or s.peer_id[:8], s.span, s.state.value) for s in servers]}")
        rtts = await self._client_rtts(servers)
        self._records = {s.peer_id: s for s in servers}
        servers = cap_throughput(servers, self.meter.measured())
        exclude = self.excluded.current() | set(also_exclude)
        ordered = list(avoid) if isinstance(avoid, (list, tuple)) else sorted(avoid)
        suspects = [p for p in sorted(self.suspects.current()) if p not in exclude and p not in ordered]
        suspects += [p for p in dict.fromkeys(ordered) if p not in exclude]  # combinations keep this order
        # the route with the fewest suspects: none if the swarm allows, else one, two, ... (the
        # suspects of one fault are one route's servers, a handful; past MAX_SUSPECT_SUBSETS
        # plans, route over all of them)
        allowed_sets = (set(c) for k in range(len(suspects)) for c in itertools.combinations(suspects, k))
        for allowed in itertools.islice(allowed_sets, MAX_SUSPECT_SUBSETS):
            try:
                return self.router.plan(
                    servers,
                    0,
                    self.num_blocks,
                    max_length=max_length,
                    exclude=exclude | (set(suspects) - allowed),
                    client_rtts=rtts,
                )
            except NoRouteError:
                continue
        return self.router.plan(servers, 0, self.num_blocks, max_length=max_length, exclude=exclude, client_rtts=rtts)

    def spares(self, route: Sequence[Hop], most: int) -> list[Hop]:
        """Online servers of exactly one later hop's blocks, off the route and not excluded, from the last plan's
        records: a training row names them so the hop before a failed one can replace it (server/train_replay.py)."""
        avoid = {hop.peer_id for hop in route} | set(self.excluded.current())
        found = [
            Hop(info.peer_id, hop.start, hop.end, list(info.relay_addrs)[:4])
            for hop in route[1:]
            for info in self._records.values()
            if (info.start_block, info.end_block) == (hop.start, hop.end)
            and info.state == ServerState.ONLINE
            and info.peer_id not in avoid
        ]
        return found[:most]

    def route_step_limit(self, route: Sequence[Hop]) -> int:
        """The most positions one Step may carry on ``route``: this client's own limit, lowered to
        the smallest any of its servers announces (bounded below by the record schema)."""
        announced = [self._records[hop.peer_id].max_positions_per_step for hop in route if hop.peer_id in self._records]
        return min([self.max_positions_per_step, *announced])

    def observe_lap(self, route: Sequence[Hop], seconds: float, positions: int, looped: bool = False) -> None:
        """One lap of ``positions`` positions over ``route`` took ``seconds`` (send to verdict; for
        a looped run, the previous verdict to its own)."""
        rtts = {peer_id: rtt for peer_id, (_, rtt) in self._rtts.items()}
        self.meter.observe(route, self._records, seconds, positions, rtts, looped=looped)

    async def _client_rtts(self, servers) -> dict[str, float]:
        """RTTs from this client to the servers that can be a head or a tail (the client's own
        links of a lap), measured with one ping each and remembered for ``RTT_TTL`` seconds."""
        now = time.monotonic()
        ends = [  # only ONLINE servers are routed to; a JOINING one has no handlers yet
            s.peer_id
            for s in servers
            if s.state == ServerState.ONLINE and (s.start_block == 0 or s.end_block == self.num_blocks)
        ]
        stale = [p for p in ends if now - self._rtts.get(p, (float("-inf"), 0.0))[0] > RTT_TTL]
        for peer_id, rtt in (await ping_many(self.p2p, stale, PING_TIMEOUT)).items():
            if rtt is not None:
                self._rtts[peer_id] = (now, rtt)
        return {p: self._rtts[p][1] for p in ends if p in self._rtts}

    async def blame(self, route: Sequence[Hop], error: ServerError) -> list[str]:
        """Act on a failure of ``route`` by evidence only; returns the servers excluded.

        What this client saw of one server itself (its dial, its send, a stream it opened, the
        tail's own verdict) excludes that server. Anything else (an ErrorReply, which any hop may
        have written about anyone; a silent timeout; a rewritten Step) is checked by pinging every
        hop: those that answer neither a ping nor a second one (``SECOND_PING``) are excluded (failover,
        a training step's route and a shadow's opening all come here), and if all answer, every hop becomes a suspect
        (a black hole answers pings), which routes avoid for a while where they can. After hearsay
        the hops that did answer become suspects even when another missed its ping: an accused
        server busy for a few seconds must not leave its accuser trusted (seen: the accused tail
        excluded, then the accuser routed again once that exclusion ended). A tail's spent compile budget,
        on its own results stream, is no fault: that tail alone becomes a suspect (client/_remote_session.py)."""
        if error.code == ErrorCode.COMPILE_BUDGET and not error.hearsay:  # the tail's own: no fault, its ration
            self.suspects.add(error.peer_id)  # avoided where another tail serves, for about the budget's window
            return []
        if error.peer_id and not error.hearsay and not isinstance(error, RouteFault):
            self.exclude(error.peer_id)
            return [error.peer_id]
        # twice silent, as audits ask (a loaded machine misses one 3-s ping; one silent once is a suspect below)
        dead = await self.unresponsive(route, again=SECOND_PING)
        for peer_id in dead:
            self.exclude(peer_id)
        if not dead or error.hearsay:
            for hop in route:
                if hop.peer_id not in dead:
                    self.suspects.add(hop.peer_id)
            logger.info(f"No hop to blame for {error}: avoiding the route's {len(route)} servers for a while")
        return dead

    async def unresponsive(self, route: Sequence[Hop], timeout: float = 3.0, again: float = 0.0) -> list[str]:
        """The hops of ``route`` that do not answer a ping within ``timeout`` seconds; with ``again``,
        those are pinged once more for that long and only the ones silent twice count. Audits pass
        it: a busy machine can miss one short ping, and excluding an honest second tail for that
        left a client with no verdict audit at all."""
        rtts = await ping_many(self.p2p, [hop.peer_id for hop in route], timeout)
        silent = [peer_id for peer_id, rtt in rtts.items() if rtt is None]
        if silent and again > 0:
            rtts = await ping_many(self.p2p, silent, again)
            silent = [peer_id for peer_id, rtt in rtts.items() if rtt is None]
        return silent

    @property
    def records(self) -> dict[str, ServerInfo]:
        """Peer id -> the record the last route was planned from (spot-checks pick substitutes here)."""
        return self._records

    @property
    def liars(self) -> frozenset[str]:
        """Servers a spot-check caught lying: excluded for the rest of this client's life."""
        return self.excluded.banned

    def convict(self, peer_id: str) -> None:
        """An audit convicted ``peer_id`` (a trusted server's word, or evidence the client checked itself
        behind trusted hops; never a vote among strangers: docs/reliability.md, "Disputes and witnesses"):
        exclude it for good and report it in the DHT (``protocol.dht_records.publish_report``; the dashboard
        counts reporting clients)."""
        logger.warning(f"Excluding server {peer_id} for good: convicted by a trusted server or the client's evidence")
        self.excluded.ban(peer_id)
        self.reports[peer_id] += 1
        self._publish_reports()

    def _publish_reports(self) -> None:
        """Store the report in the background; one store at a time, the latest counts winning."""
        if self._closing:
            return
        if self._publishing is not None and not self._publishing.done():
            self._stale = True  # stored again once this one is done
            return
        self._stale = False
        loop = asyncio.get_running_loop()
        self._publishing = loop.run_in_executor(None, publish_report, self.dht, self.model, dict(self.reports))
        self._publishing.add_done_callback(self._published)

    def _published(self, future: asyncio.Future) -> None:
        _log_publish(future)
        if self._stale:
            self._publish_reports()

    async def flush_reports(self, timeout: float = 30.0) -> None:
        """Wait (bounded) until the latest spot-check report is stored."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._publishing is not None and (self._stale or not self._publishing.done()):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            await asyncio.wait([self._publishing], timeout=remaining)
            await asyncio.sleep(0)  # the done callback starts the next store

    def exclude(self, peer_id: str) -> None:
        if peer_id:
            logger.info(f"Excluding server {peer_id} for a while")
            self.excluded.add(peer_id)

    async def close_session(self, session: RemoteSession) -> None:
        self.router.release(session.route)
        await session.close()

    async def aclose(self) -> None:
        """Close our handle on the libp2p daemon, then stop the DHT process (which owns it)."""
        await self.flush_reports(timeout=10.0)  # a report being stored: let it land (bounded)
        self._closing = True
        try:
            await self.p2p.shutdown()
        finally:
            self.dht.shutdown()


def _log_publish(future: asyncio.Future) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if error is not None or not future.result():
        logger.warning(f"Could not store this client's spot-check report in the DHT: {error!r}")
