"""Route planning: which servers compute which blocks for one inference session.

:class:`RoutePlanner` is the contract a client's router meets; :class:`MaxFlowRouter` meets it by
giving each session the lowest-latency path among servers with spare capacity, where a server's
capacity is its share of the swarm's max-flow (:mod:`protocol.flow`), so sessions are spread in
proportion to what each server can carry (as Helix's weighted round-robin spreads them over flow
paths) and the fastest path is not chosen by everyone. :func:`cap_throughput`,
:func:`same_model` and :func:`with_adapter` filter the records a client routes over.

Everything here is pure: callers pass the :class:`ServerInfo` records they read from the DHT. A
route is a list of the wire's :class:`protocol.messages.Hop` (one server and the blocks
``[start, end)`` it computes for the session; a sub-range of its span), so a planned route goes
into ``OpenSession`` as it is.
"""

from __future__ import annotations

import abc
import math
from collections import Counter
from typing import Collection, Mapping, Sequence

import msgspec

from protocol.flow import ROUTABLE, max_flow, uncovered, usable
from protocol.messages import Hop
from protocol.records import ServerInfo
from protocol.route_errors import NoRouteError, _ranges, no_route_error
from protocol.version import PROTOCOL_VERSION

DEFAULT_RTT = 0.05  # seconds, assumed for a link nobody has measured


class RoutePlanner(abc.ABC):
    """Chooses which servers compute which blocks for one inference session."""

    @abc.abstractmethod
    def plan(
        self,
        servers: Sequence[ServerInfo],
        start: int,
        end: int,
        *,
        max_length: int = 0,
        exclude: Collection[str] = (),
        client_rtts: Mapping[str, float] | None = None,
    ) -> list[Hop]:
        """Return hops that together compute blocks ``[start, end)`` exactly once, in order.

        Guarantees: the first hop starts at ``start``, each hop starts where the previous one
        ended, the last ends at ``end``, and each hop's range lies inside its server's span.
        Only ``ONLINE`` servers with positive throughput and room for ``max_length`` (free cache
        within the announced per-session cap: ``ServerInfo.session_room``) are used, and never a
        peer in ``exclude`` (the client excludes servers that failed it).
        ``client_rtts`` maps peer id to the client's measured RTT in seconds.

        Raises :class:`protocol.route_errors.NoRouteError`, naming the blocks no usable server
        covers, when no route exists; ``ValueError`` when ``not 0 <= start < end``.

        A planner may count the routes it hands out to balance load; such a planner expects
        :meth:`release` when the session ends (or the route is replaced after a failure).
        """

    def release(self, route: Sequence[Hop]) -> None:
        """Tell the planner a route from :meth:`plan` is no longer used (no-op by default)."""


class MaxFlowRouter(RoutePlanner):
    """Lowest-latency routes, spread over servers by their share of the swarm's max-flow.

    Expected latency of a route, in seconds, for one token through it:

    * network: the token travels client -> first server -> ... -> last server -> client, and each
      link costs half its RTT (one way). Server->server RTTs come from ``next_pings`` (either
      end's measurement), client->server from ``client_rtts``; unknown ones are ``default_rtt``.
    * compute: ``throughput`` is tokens/s for a server's whole span, so one block costs
      ``1 / (throughput * span_len)`` seconds and a hop over ``k`` blocks costs ``k`` times that.

    Spreading (Helix's weighted round-robin, with capacities from the max-flow): the eligible
    servers push at most ``F`` tokens/s through ``[start, end)`` (their max-flow), and server
    ``s`` can carry ``T_s`` of that, so it should hold at most a share ``min(1, T_s / F)`` of
    the sessions. With ``n`` sessions open, a new one may use ``s`` only while ``s`` holds fewer
    than ``ceil(share * (n + 1))``; the lowest-latency route within those quotas wins, and only
    if none exists are quotas ignored. Why capacity and not the flow on ``s`` in one max-flow:
    that flow is not unique, and a server a max-flow leaves idle (say, a fast server beside a
    slow bottleneck) is exactly the spare capacity a low-latency route should use. Quotas rarely
    leave no route: the servers covering any block have ``sum(T_s) >= F``, so their quotas add
    up to at least ``n + 1``, and a route may switch servers at any block.
    Every successful :meth:`plan` counts as an open session until :meth:`release`.
    """

    def __init__(self, default_rtt: float = DEFAULT_RTT):
        self.default_rtt = default_rtt
        self._load: Counter[str] = Counter()  # peer id -> open sessions routed through it
        self._sessions = 0

    def plan(
        self,
        servers: Sequence[ServerInfo],
        start: int,
        end: int,
        *,
        max_length: int = 0,
        exclude: Collection[str] = (),
        client_rtts: Mapping[str, float] | None = None,
    ) -> list[Hop]:
        if not 0 <= start < end:
            raise ValueError(f"bad block range [{start}, {end})")
        eligible = [
            s
            for s in usable(servers, ROUTABLE)
            if s.peer_id not in exclude
            and s.protocol_version == PROTOCOL_VERSION  # another version cannot talk to this client
            and s.session_room >= max_length
            and s.start_block < end
            and s.end_block > start
        ]
        missing = uncovered(eligible, start, end)
        if missing:
            raise no_route_error(servers, missing, max_length, exclude)
        flow = max_flow(eligible, start, end)
        spare = [s for s in eligible if self._load[s.peer_id] < self._quota(s.throughput / flow)]
        route = self._fastest(spare, start, end, client_rtts or {})
        if not route:  # quotas overbooked (e.g. after servers left): latency alone decides
            route = self._fastest(eligible, start, end, client_rtts or {})
        self._count(route, +1)
        return route

    def release(self, route: Sequence[Hop]) -> None:
        self._count(route, -1)

    def load(self, peer_id: str) -> int:
        """Open sessions this planner has routed through ``peer_id``."""
        return self._load[peer_id]

    def _count(self, route: Sequence[Hop], delta: int) -> None:
        """Sessions count once per server."""
        for peer_id in {hop.peer_id for hop in route}:
            self._load[peer_id] = max(0, self._load[peer_id] + delta)
        self._sessions = max(0, self._sessions + delta)

    def _quota(self, share: float) -> int:
        """Sessions a server with this share may hold once the new one opens (float-tolerant)."""
        return math.ceil(min(1.0, share) * (self._sessions + 1) * (1 - 1e-9))

    def _fastest(self, servers: list[ServerInfo], start: int, end: int, client_rtts: Mapping[str, float]) -> list[Hop]:
        """Lowest-latency route over ``servers``, or ``[]`` if they do not cover the range.

        A shortest path, found block by block. States: ``enter(q, j)``, the token reached ``q``
        to compute from block ``j``; ``ran(q, j)``, ``q`` has computed up to boundary ``j``. A
        server's chain enter -> ran -> ran ... costs compute time, a hand-off ``ran(p, j) ->
        enter(q, j)`` costs the p -> q link, and a server must compute at least one block before
        handing off (no free relays). Every edge leads from boundary ``j`` to ``j`` or ``j + 1``,
        so one pass over the boundaries in order is exact (a DAG; no priority queue needed).

        What keeps it linear in servers x blocks (the all-pairs graph it replaces had
        servers^2 x blocks hand-offs): almost every link costs ``default_rtt``, the same for
        everyone, so the best unmeasured hand-off into ``q`` at ``j`` comes from the cheapest
        ``ran(p, j)`` whose link to ``q`` nobody measured: the first of ``ran`` sorted by cost that
        is neither ``q`` nor measured to it. Measured links (each record lists at most
        ``MAX_NEXT_PINGS``) are tried one by one wherever both ends meet.
        """
        spans = {s.peer_id: (max(s.start_block, start), min(s.end_block, end)) for s in servers}
        per_block = {s.peer_id: 1.0 / (s.throughput * len(s.span)) for s in servers}
        measured = self._measured_links(servers)
        opening: dict[int, list[str]] = {}  # boundary -> servers whose usable range starts there
        for peer_id, (lo, hi) in spans.items():
            if lo < hi:
                opening.setdefault(lo, []).append(peer_id)
        back: dict[tuple[str, str, int], tuple[str, str, int] | None] = {}  # state -> the state before it
        ran: dict[str, float] = {}  # peer -> cost of ran(peer, j) at the current boundary j
        covering: list[str] = []  # servers that can compute block j
        for j in range(start, end):
            covering = [q for q in covering if spans[q][1] > j] + opening.get(j, [])
            if not covering:
                return []
            if j == start:
                enter = {q: client_rtts.get(q, self.default_rtt) / 2 for q in covering}
                back.update({("enter", q, j): None for q in covering})
            else:
                enter = self._hand_offs(ran, covering, measured, back, j)
            ran = self._compute(ran, enter, covering, per_block, back, j)
        tails = [(cost + client_rtts.get(p, self.default_rtt) / 2, p) for p, cost in ran.items() if spans[p][1] == end]
        if not tails:
            return []
        return _hops(back, ("ran", min(tails)[1], end))

    def _hand_offs(
        self,
        ran: dict[str, float],
        covering: list[str],
        measured: dict[str, dict[str, float]],
        back: dict,
        j: int,
    ) -> dict[str, float]:
        """Cost of ``enter(q, j)`` for every ``q`` that can compute block ``j``, from another
        server that has computed up to ``j`` (``measured``: see :meth:`_measured_links`)."""
        by_cost = sorted(ran, key=ran.__getitem__)
        half_default = self.default_rtt / 2
        enter: dict[str, float] = {}
        for q in covering:
            known = measured.get(q)
            best, via = math.inf, None
            if not known:  # most servers: the cheapest other one
                via = by_cost[0] if by_cost and by_cost[0] != q else (by_cost[1] if len(by_cost) > 1 else None)
                best = math.inf if via is None else ran[via] + half_default
            else:
                for p in by_cost:  # the cheapest unmeasured link: usually the first or second
                    if p != q and p not in known:
                        best, via = ran[p] + half_default, p
                        break
                for p, rtt in known.items():
                    if p in ran and ran[p] + rtt / 2 < best:
                        best, via = ran[p] + rtt / 2, p
            if via is not None:
                enter[q] = best
                back[("enter", q, j)] = ("ran", via, j)
        return enter

    @staticmethod
    def _compute(
        ran: dict[str, float], enter: dict[str, float], covering: list[str], per_block: dict, back: dict, j: int
    ) -> dict[str, float]:
        """``ran(q, j + 1)``: ``q`` computes block ``j``, entered at ``j`` or continuing (a tie
        keeps the server it is on: one hop fewer)."""
        after: dict[str, float] = {}
        for q in covering:
            came, cost = ("ran", q, j), ran.get(q, math.inf)
            if enter.get(q, math.inf) < cost:
                came, cost = ("enter", q, j), enter[q]
            if cost < math.inf:
                after[q] = cost + per_block[q]
                back[("ran", q, j + 1)] = came
        return after

    @staticmethod
    def _measured_links(servers: list[ServerInfo]) -> dict[str, dict[str, float]]:
        """``q`` -> ``p`` -> RTT of the p -> q link, for the links somebody measured (``p``'s own
        measurement wins, else ``q``'s). Its size is bounded by the records' ``next_pings``."""
        ids = {s.peer_id for s in servers}
        links: dict[str, dict[str, float]] = {}
        for q in servers:  # q measured p: counts for p -> q unless p measured q itself
            for p, rtt in q.next_pings.items():
                if p in ids and p != q.peer_id:
                    links.setdefault(q.peer_id, {})[p] = rtt
        for p in servers:
            for q, rtt in p.next_pings.items():
                if q in ids and q != p.peer_id:
                    links.setdefault(q, {})[p.peer_id] = rtt
        return links


def cap_throughput(servers: Sequence[ServerInfo], measured: Mapping[str, float]) -> list[ServerInfo]:
    """``servers`` with each throughput replaced by the smaller of the claim and what this client
    measured the server deliver (``measured``: peer id -> tokens/s for its whole span, e.g. from
    ``client._throughput.ThroughputMeter``), so a server far below its claim loses weight in
    routing for this client. Servers nobody measured keep their claim."""
    capped = []
    for s in servers:
        rate = measured.get(s.peer_id)
        if rate is not None and rate < s.throughput:
            s = msgspec.structs.replace(s, throughput=rate)
        capped.append(s)
    return capped


def _hops(back: Mapping, last: tuple[str, str, int]) -> list[Hop]:
    """Walk the states back from ``last`` to the client; each ``enter`` state opens one hop."""
    states: list[tuple[str, str, int]] = []
    state: tuple[str, str, int] | None = last
    while state is not None:
        states.append(state)
        state = back[state]
    hops: list[list] = []
    for kind, peer_id, block in reversed(states):
        if kind == "enter":
            hops.append([peer_id, block, block])
        else:
            hops[-1][2] = block
    return _once_per_server([Hop(peer_id, a, b) for peer_id, a, b in hops])


def _once_per_server(route: list[Hop]) -> list[Hop]:
    """The route with every server in one hop: a server that appears twice (it hands off to
    another and gets the token back further on) computes everything between its two visits itself.

    A server keys its sessions by session id, so a second OpenSession of the same session reaches
    it as ``session_exists`` and the generation fails (seen in the 24-server churn run, docs/scale.md).
    Its span is contiguous and holds both visits' blocks, so it holds every block between them, and
    the merged route has fewer hand-offs."""
    hops = list(route)
    while True:
        first: dict[str, int] = {}
        for k, hop in enumerate(hops):
            i = first.setdefault(hop.peer_id, k)
            if i != k:
                hops[i : k + 1] = [Hop(hop.peer_id, hops[i].start, hop.end)]
                break
        else:
            return hops


def same_model(servers: Sequence[ServerInfo], config_fingerprint: str, revision: str = "") -> list[ServerInfo]:
    """The servers that hold this model exactly, so that one route never mixes weights: those of
    ``config_fingerprint`` and of one revision: ``revision`` where any server has it, else the
    revision most servers hold (a client that could not resolve one, or a swarm on an older
    commit). Records of another config, or without a fingerprint, are left out."""
    mine = [s for s in servers if s.config_fingerprint == config_fingerprint]
    revisions = Counter(s.revision for s in mine)
    if revision not in revisions and revisions:
        revision = min(revisions, key=lambda r: (-revisions[r], r))  # the most servers, then a fixed order
    return [s for s in mine if s.revision == revision]


def with_adapter(servers: Sequence[ServerInfo], adapter: str, num_blocks: int) -> list[ServerInfo]:
    """The servers that announce LoRA adapter ``adapter`` (every server when it is ""), so a route applies it
    at every block; a :class:`NoRouteError` naming the blocks that none of them holds."""
    if not adapter:
        return list(servers)
    serving = [s for s in servers if adapter in s.adapters]
    missing = uncovered(serving, 0, num_blocks)
    if missing:
        model = servers[0].model if servers else "this model"
        gaps = ", ".join(f"{a}" if b == a + 1 else f"{a}..{b - 1}" for a, b in _ranges(missing))
        raise NoRouteError(
            f"no server of {model} that serves adapter {adapter!r} holds blocks {gaps} "
            f"({len(serving)} of {len(servers)} servers announce it); start one with --adapters",
            missing,
        )
    return serving
