"""Route planning and block selection over a flow network of block boundaries.

The swarm is modelled as in Helix: nodes are the block boundaries ``0..N`` of the model, and a
server holding blocks ``[a, b)`` with throughput ``T`` (tokens/s for its whole span) is a
capacity-limited path from boundary ``a`` to boundary ``b``. Two uses follow from it:

* **Block selection** (:func:`choose_best_span`, :func:`should_move`): a joining server takes the
  span that raises the swarm's max-flow (its throughput from boundary 0 to N) the most, and a
  running server moves when another span would raise it by enough. Both count each record's
  throughput only up to what a reader can check (:func:`placement_view`), never as claimed.
* **Routing** (:class:`MaxFlowRouter`): each session gets the lowest-latency path among servers
  with spare capacity, where a server's capacity is its share of the max-flow, so sessions are
  spread in proportion to what each server can carry (as Helix's weighted round-robin spreads
  them over flow paths) and the fastest path is not chosen by everyone.

Everything here is pure: callers pass the :class:`ServerInfo` records they read from the DHT.

Flow network. Each server is a node pair ``in -> out`` whose edge has capacity ``T``, so
everything the server computes shares one capacity. A route may use a sub-range of a server's
span, so every boundary ``a <= i < b`` has an edge into ``in`` and ``out`` has an edge to every
boundary ``a < j <= b`` (those edges are unlimited). That also lets flow "teleport" backward
(enter at ``i``, leave at ``j <= i``). Such detours never raise the max-flow *value*: take any
0 -> N path of a flow and walk it from boundary ``c = 0``; the first later hop whose range crosses
``c`` (enters at or before ``c``, leaves after it) belongs to a server whose span covers ``c``,
so the walk can jump there directly. It ends at ``N`` using a subset of the original hops, so no
capacity is exceeded. Only the value is used here, never the flow on single edges.

The value has a closed form, so no max-flow solver runs (networkx's took 0.4 s at 1,000 servers,
and block selection ran it once per candidate span): it is the least, over blocks, of the summed
throughput of the servers holding the block. Proof by min-cut: only ``in -> out`` edges are
finite, so a finite cut ``(S, rest)`` pays ``T`` for each server with ``in`` in ``S`` and ``out``
not. Let ``m`` be the lowest boundary outside ``S``: boundary ``m - 1`` is in ``S``, so every
server holding block ``m - 1`` has ``in`` in ``S`` (edge ``m - 1 -> in``) and ``out`` outside it
(edge ``out -> m``, else ``m`` would be reached by an unlimited edge), and the cut pays at least
that block's sum. The cut ``S = {0..m - 1}`` plus those servers' ``in`` nodes pays exactly it.
``tests/test_scale.py`` checks the closed form against networkx's max-flow on random swarms.
"""

from __future__ import annotations

import abc
import math
from collections import Counter
from typing import Collection, Mapping, Sequence

import msgspec

from protocol.messages import Hop
from protocol.records import MAX_THROUGHPUT, ServerInfo, ServerState
from protocol.version import PROTOCOL_VERSION

DEFAULT_RTT = 0.05  # seconds, assumed for a link nobody has measured

_ROUTABLE = frozenset({ServerState.ONLINE})
# Block selection also counts servers still joining, so two servers that join at once do not
# both take the same gap (a joining server has announced the span it chose).
_PLACED = frozenset({ServerState.JOINING, ServerState.ONLINE})


RouteHop = Hop
"""One server of a route and the blocks [start, end) it computes for this route (a hop may use a
sub-range of the server's span): the wire's :class:`protocol.messages.Hop` itself, so a planned
route goes into ``OpenSession`` as it is."""


class NoRouteError(Exception):
    """No usable servers cover ``missing_blocks``; the message says why and what would help."""

    def __init__(self, message: str, missing_blocks: list[int]):
        super().__init__(message)
        self.missing_blocks = missing_blocks


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
    ) -> list[RouteHop]:
        """Return hops that together compute blocks ``[start, end)`` exactly once, in order.

        Guarantees: the first hop starts at ``start``, each hop starts where the previous one
        ended, the last ends at ``end``, and each hop's range lies inside its server's span.
        Only ``ONLINE`` servers with positive throughput and room for ``max_length`` (free cache
        within the announced per-session cap: ``ServerInfo.session_room``) are used, and never a peer in ``exclude`` (the client excludes servers that failed it).
        ``client_rtts`` maps peer id to the client's measured RTT in seconds.

        Raises :class:`NoRouteError`, naming the blocks no usable server covers, when no route
        exists; ``ValueError`` when ``not 0 <= start < end``.

        A planner may count the routes it hands out to balance load; such a planner expects
        :meth:`release` when the session ends (or the route is replaced after a failure).
        """

    def release(self, route: Sequence[RouteHop]) -> None:
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
    ) -> list[RouteHop]:
        if not 0 <= start < end:
            raise ValueError(f"bad block range [{start}, {end})")
        eligible = [
            s
            for s in _usable(servers, _ROUTABLE)
            if s.peer_id not in exclude
            and s.protocol_version == PROTOCOL_VERSION  # another version cannot talk to this client
            and s.session_room >= max_length
            and s.start_block < end
            and s.end_block > start
        ]
        missing = _uncovered(eligible, start, end)
        if missing:
            raise _no_route_error(servers, missing, max_length, exclude)
        flow = _max_flow(eligible, start, end)
        spare = [s for s in eligible if self._load[s.peer_id] < self._quota(s.throughput / flow)]
        route = self._fastest(spare, start, end, client_rtts or {})
        if not route:  # quotas overbooked (e.g. after servers left): latency alone decides
            route = self._fastest(eligible, start, end, client_rtts or {})
        self._count(route, +1)
        return route

    def release(self, route: Sequence[RouteHop]) -> None:
        self._count(route, -1)

    def load(self, peer_id: str) -> int:
        """Open sessions this planner has routed through ``peer_id``."""
        return self._load[peer_id]

    def _count(self, route: Sequence[RouteHop], delta: int) -> None:
        """Sessions count once per server."""
        for peer_id in {hop.peer_id for hop in route}:
            self._load[peer_id] = max(0, self._load[peer_id] + delta)
        self._sessions = max(0, self._sessions + delta)

    def _quota(self, share: float) -> int:
        """Sessions a server with this share may hold once the new one opens (float-tolerant)."""
        return math.ceil(min(1.0, share) * (self._sessions + 1) * (1 - 1e-9))

    def _fastest(
        self, servers: list[ServerInfo], start: int, end: int, client_rtts: Mapping[str, float]
    ) -> list[RouteHop]:
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


def swarm_max_flow(servers: Sequence[ServerInfo], num_blocks: int) -> float:
    """Tokens/s the ``ONLINE`` servers can push through all ``num_blocks`` blocks (0 if a block
    has no server)."""
    return _max_flow(_usable(servers, _ROUTABLE), 0, num_blocks)


CLAIM_CAP = 1.0
"""Placement counts no server faster than ``CLAIM_CAP`` times the median per-block speed of the
model's ``ONLINE`` servers (:func:`placement_view`)."""


def placement_view(servers: Sequence[ServerInfo]) -> list[ServerInfo]:
    """The records placement and rebalancing count (``JOINING`` and ``ONLINE``, one per peer), each
    throughput counted only up to what a reader can check.

    A throughput is a claim: nobody measured it but its author, and identities are free. Believed
    as written, one fresh record claiming 1,000 times a real server's speed makes its blocks look
    saturated, and rebalancing moves honest servers off them (onto which the record's author may
    serve nothing at all). So every record is counted at most at a *reference speed* the reader can
    derive from the swarm as a whole rather than from the record:

    - an ``ONLINE`` record: at most :data:`CLAIM_CAP` times the median per-block speed
      (``throughput * blocks``) of the model's ``ONLINE`` records, spread over its span. The median
      holds while fewer than half of the online records lie; one identity then weighs no more than
      a typical server, so inflating a claim buys nothing beyond announcing at all (and many
      identities weigh as many typical servers: placement spreads servers by count where it
      cannot check speed). An honest server faster than the median is under-counted; that costs
      placement some precision, never coverage, and routing still weighs it by its claim capped by
      what each client measures (:func:`cap_throughput`).
    - a ``JOINING`` record: at most the slowest ``ONLINE`` per-block speed, spread over its span,
      which is what an honest joining server announces before it has measured anything
      (``server.joining.joining_throughput``).

    Without any ``ONLINE`` record there is no reference and claims count as written. Idempotent:
    capped values never exceed the median, so capping again changes nothing. Routing
    (:class:`MaxFlowRouter`) does not use this: a client has its own measurements.
    """
    placed = _usable(servers, _PLACED)
    speeds = sorted(s.throughput * len(s.span) for s in placed if s.state == ServerState.ONLINE)
    if not speeds:
        return placed
    mid = len(speeds) // 2
    median = speeds[mid] if len(speeds) % 2 else (speeds[mid - 1] + speeds[mid]) / 2
    limit = {ServerState.ONLINE: CLAIM_CAP * median, ServerState.JOINING: speeds[0]}
    counted = []
    for s in placed:
        cap = limit[s.state] / len(s.span)
        counted.append(s if s.throughput <= cap else msgspec.structs.replace(s, throughput=cap))
    return counted


def choose_best_span(
    servers: Sequence[ServerInfo], num_blocks: int, span_length: int, my_throughput: float,
    within: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Span ``(start, end)`` for a joining server that raises the swarm's max-flow the most.

    Joining and online servers both count, each at most at the throughput :func:`placement_view`
    believes. While the model has gaps, no single span raises the max-flow unless it closes the
    last gap, so ties go to the span covering the most of the least-served blocks (gaps first,
    then the lowest per-block throughput), then to the span with the least throughput already on
    it, then to the lowest start. ``within=(lo, hi)`` keeps the span inside blocks [lo, hi) (a
    server whose memory cannot hold an end of the model).
    """
    return _best_span(placement_view(servers), num_blocks, span_length, my_throughput, within)


def _best_span(
    placed: Sequence[ServerInfo], num_blocks: int, span_length: int, my_throughput: float,
    within: tuple[int, int] | None,
) -> tuple[int, int]:
    """:func:`choose_best_span` over records already counted as placement believes them."""
    lo, hi = within or (0, num_blocks)
    if num_blocks <= 0 or span_length <= 0 or not 0 <= lo < hi <= num_blocks:
        raise ValueError("num_blocks and span_length must be positive, and within a range of blocks")
    length = min(span_length, hi - lo)
    per_block = _block_throughput(placed, num_blocks)
    least = min(per_block)

    def score(start: int) -> tuple[float, int, float]:
        window, rest = per_block[start : start + length], per_block[:start] + per_block[start + length :]
        flow = min([t + my_throughput for t in window] + rest)  # the max-flow with the candidate added
        flow = round(flow, 6)  # tolerate float noise in ties
        return flow, sum(math.isclose(t, least, abs_tol=1e-9) for t in window), -sum(window)

    best = max(range(lo, hi - length + 1), key=score)  # max() keeps the lowest start on ties
    return best, best + length


def should_move(
    servers: Sequence[ServerInfo], my_info: ServerInfo, num_blocks: int, min_gain: float = 0.2,
    within: tuple[int, int] | None = None,
) -> tuple[int, int] | None:
    """New span for a running server if moving there raises the max-flow by more than
    ``min_gain`` (relative), else ``None``. The threshold keeps servers from oscillating
    between near-equal spans. If the model has a gap either way, moving is worth it when it
    leaves fewer uncovered blocks. The others count as :func:`placement_view` believes them (the
    reference speeds come from every record, this server's own included); this server counts
    at its own measured throughput.
    """
    others = [s for s in placement_view([*servers, my_info]) if s.peer_id != my_info.peer_id]
    span = _best_span(others, num_blocks, len(my_info.span), my_info.throughput, within)
    if span == (my_info.start_block, my_info.end_block):
        return None
    moved = msgspec.structs.replace(my_info, start_block=span[0], end_block=span[1])
    here, there = others + [my_info], others + [moved]
    now, then = _max_flow(here, 0, num_blocks), _max_flow(there, 0, num_blocks)
    if now > 0:
        return span if (then - now) / now > min_gain else None
    if then > 0:
        return span
    fewer_gaps = len(_uncovered(there, 0, num_blocks)) < len(_uncovered(here, 0, num_blocks))
    return span if fewer_gaps else None


def _usable(servers: Sequence[ServerInfo], states: frozenset[ServerState]) -> list[ServerInfo]:
    """Servers in ``states`` that can compute something; one record per peer (the last wins).

    Records read from the DHT are already bounded (:meth:`ServerInfo.from_dict`); this check
    repeats the part the router depends on, so records built any other way cannot make max-flow
    raise (an infinite or NaN capacity) or a walk over blocks start below 0."""
    by_peer = {
        s.peer_id: s
        for s in servers
        if s.state in states and 0 < s.throughput <= MAX_THROUGHPUT and 0 <= s.start_block < s.end_block
    }
    return list(by_peer.values())


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


def _uncovered(servers: Sequence[ServerInfo], start: int, end: int) -> list[int]:
    """Blocks of ``[start, end)`` no server holds; costs servers x (end - start) at most, whatever
    spans the records claim."""
    covered = [False] * (end - start)
    for s in servers:
        for b in range(max(s.start_block, start), min(s.end_block, end)):
            covered[b - start] = True
    return [start + i for i, held in enumerate(covered) if not held]


def _block_throughput(servers: Sequence[ServerInfo], end: int, start: int = 0) -> list[float]:
    """Summed throughput of the servers holding each block of ``[start, end)``."""
    per_block = [0.0] * (end - start)
    for s in servers:
        for b in range(max(s.start_block, start), min(s.end_block, end)):
            per_block[b - start] += s.throughput
    return per_block


def _max_flow(servers: Sequence[ServerInfo], start: int, end: int) -> float:
    """The max-flow value of the flow network over ``[start, end)`` (module docstring): the least,
    over its blocks, of the summed throughput of the servers holding that block; 0 with a gap.
    Costs servers x blocks."""
    return min(_block_throughput(servers, end, start), default=0.0)


def _hops(back: Mapping, last: tuple[str, str, int]) -> list[RouteHop]:
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
    return _once_per_server([RouteHop(peer_id, a, b) for peer_id, a, b in hops])


def _once_per_server(route: list[RouteHop]) -> list[RouteHop]:
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
                hops[i : k + 1] = [RouteHop(hop.peer_id, hops[i].start, hop.end)]
                break
        else:
            return hops


def _no_route_error(
    servers: Sequence[ServerInfo], missing: list[int], max_length: int, exclude: Collection[str]
) -> NoRouteError:
    """Say which blocks lack a server, why the servers that hold them were passed over, and
    which ``--blocks`` argument would fill each gap."""
    gaps = _ranges(missing)
    where = " and ".join(f"block {a}" if b == a + 1 else f"blocks {a}..{b - 1}" for a, b in gaps)
    fix = " and ".join(f"--blocks {a}:{b}" for a, b in gaps)
    if not servers:  # not "nobody holds these blocks": nothing was read at all
        message = ("the DHT returned no server records for this model (an empty swarm, another model "
                   f"name or swarm, or a DHT read that failed); start a server with {fix}")  # fmt: skip
        return NoRouteError(message, missing)
    model = servers[0].model
    holders = {s.peer_id: s for s in servers if any(b in s.span for b in missing)}.values()
    reasons = _reasons(list(holders), max_length, exclude)
    if not reasons:
        message = f"no server holds {where} of model {model}; start a server with {fix}"
        return NoRouteError(message, missing)
    retry = "retry later or " if any("cache room" in r for r in reasons) else ""
    why = "; ".join(reasons)
    message = f"no usable server holds {where} of model {model}: {why}; {retry}start a server"
    return NoRouteError(f"{message} with {fix}", missing)


def _reasons(holders: list[ServerInfo], max_length: int, exclude: Collection[str]) -> list[str]:
    """Why each holder of a missing block was not usable, grouped into short phrases."""
    excluded = [s for s in holders if s.peer_id in exclude]
    rest = [s for s in holders if s.peer_id not in exclude]
    not_online = Counter(s.state.value for s in rest if s.state != ServerState.ONLINE)
    other_version = [s for s in rest if s.state == ServerState.ONLINE and s.protocol_version != PROTOCOL_VERSION]
    online = [s for s in rest if s.state == ServerState.ONLINE and s.protocol_version == PROTOCOL_VERSION]
    stalled = [s for s in online if s.throughput <= 0]
    capped = [s for s in online if s.throughput > 0 and 0 < s.max_session_tokens < max_length]
    full = [s for s in online if s.throughput > 0 and s not in capped and s.free_cache_tokens < max_length]
    reasons = [f"{_servers_are(len(excluded))} excluded after failing"] if excluded else []
    reasons += [f"{_servers_are(n)} {state}" for state, n in sorted(not_online.items())]
    if other_version:
        versions = ", ".join(str(v) for v in sorted({s.protocol_version for s in other_version}))
        reasons.append(f"{_servers_are(len(other_version))} on protocol version {versions}, not {PROTOCOL_VERSION}")
    if stalled:
        reasons.append(f"{_servers_are(len(stalled))} reporting zero throughput")
    if full:
        most = max(s.free_cache_tokens for s in full)
        room = f"out of cache room for {max_length} tokens (most free: {most})"
        reasons.append(f"{_servers_are(len(full))} {room}")
    if capped:
        most = max(s.max_session_tokens for s in capped)
        reasons.append(f"{_servers_are(len(capped))} capped at sessions of {most} tokens (--max-session-tokens), "
                       f"not {max_length}")  # fmt: skip
    return reasons


def _servers_are(n: int) -> str:
    return "1 server is" if n == 1 else f"{n} servers are"


def _ranges(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted blocks -> half-open runs, e.g. ``[4, 5, 6, 9] -> [(4, 7), (9, 10)]``."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


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
