"""Route planning and block selection over a flow network of block boundaries.

The swarm is modelled as in Helix: nodes are the block boundaries ``0..N`` of the model, and a
server holding blocks ``[a, b)`` with throughput ``T`` (tokens/s for its whole span) is a
capacity-limited path from boundary ``a`` to boundary ``b``. Two uses follow from it:

* **Block selection** (:func:`choose_best_span`, :func:`should_move`): a joining server takes the
  span that raises the swarm's max-flow (its throughput from boundary 0 to N) the most, and a
  running server moves when another span would raise it by enough.
* **Routing** (:class:`MaxFlowRouter`): each session gets the lowest-latency path among servers
  with spare capacity, where a server's capacity is its share of the max-flow, so sessions are
  spread in proportion to what each server can carry (as Helix's weighted round-robin spreads
  them over flow paths) and the fastest path is not chosen by everyone.

Everything here is pure: callers pass the :class:`ServerInfo` records they read from the DHT.

Flow network (see :func:`_flow_graph`). Each server is a node pair ``in -> out`` whose edge has
capacity ``T``, so everything the server computes shares one capacity. A route may use a
sub-range of a server's span, so every boundary ``a <= i < b`` has an edge into ``in`` and
``out`` has an edge to every boundary ``a < j <= b``. That also lets flow "teleport" backward
(enter at ``i``, leave at ``j <= i``). Such detours never raise the max-flow *value*: take any
0 -> N path of a flow and walk it from boundary ``c = 0``; the first later hop whose range crosses
``c`` (enters at or before ``c``, leaves after it) belongs to a server whose span covers ``c``,
so the walk can jump there directly. It ends at ``N`` using a subset of the original hops, so no
capacity is exceeded. Only the value is used here, never the flow on single edges (which may
include such detours, and is not unique anyway).
"""

from __future__ import annotations

import abc
import math
from collections import Counter
from typing import Collection, Mapping, Sequence

import msgspec
import networkx as nx

from protocol.messages import Hop
from protocol.records import MAX_THROUGHPUT, ServerInfo, ServerState
from protocol.version import PROTOCOL_VERSION

DEFAULT_RTT = 0.05  # seconds, assumed for a link nobody has measured

_ROUTABLE = frozenset({ServerState.ONLINE})
# Block selection also counts servers still joining, so two servers that join at once do not
# both take the same gap (a joining server has announced the span it chose).
_PLACED = frozenset({ServerState.JOINING, ServerState.ONLINE})
_CLIENT_IN, _CLIENT_OUT = "client_in", "client_out"
_CANDIDATE = "\0candidate"  # peer id of the hypothetical server in block selection


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
        Only ``ONLINE`` servers with positive throughput and ``free_cache_tokens >= max_length``
        are used, and never a peer in ``exclude`` (the client excludes servers that failed it).
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
            and s.free_cache_tokens >= max_length
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
        """Sessions count once per server even if a route visits it twice."""
        for peer_id in {hop.peer_id for hop in route}:
            self._load[peer_id] = max(0, self._load[peer_id] + delta)
        self._sessions = max(0, self._sessions + delta)

    def _quota(self, share: float) -> int:
        """Sessions a server with this share may hold once the new one opens (float-tolerant)."""
        return math.ceil(min(1.0, share) * (self._sessions + 1) * (1 - 1e-9))

    def _fastest(
        self, servers: list[ServerInfo], start: int, end: int, client_rtts: Mapping[str, float]
    ) -> list[RouteHop]:
        """Lowest-latency route over ``servers``, or ``[]`` if they do not cover the range."""
        graph = self._latency_graph(servers, start, end, client_rtts)
        try:
            path = nx.dijkstra_path(graph, _CLIENT_IN, _CLIENT_OUT, weight="weight")
        except (nx.NetworkXNoPath, nx.NodeNotFound):
            return []
        return _path_to_hops(path)

    def _latency_graph(
        self, servers: list[ServerInfo], start: int, end: int, client_rtts: Mapping[str, float]
    ) -> nx.DiGraph:
        """Nodes ``("enter", peer, i)``: the token reached ``peer`` to compute from block ``i``;
        ``("ran", peer, j)``: ``peer`` has computed up to boundary ``j``. A server's chain
        enter -> ran -> ran ... costs compute time; ran(p, j) -> enter(q, j) costs the p->q link.
        Keeping the previous server in the node is what lets server->server RTTs count. Entering
        needs at least one block computed before leaving, so no server acts as a free relay.
        """
        graph = nx.DiGraph()
        for s in servers:
            self._add_server(graph, s, start, end, client_rtts)
        for p in servers:
            for q in servers:
                if p.peer_id != q.peer_id:
                    self._add_links(graph, p, q, start, end)
        return graph

    def _add_server(
        self,
        graph: nx.DiGraph,
        s: ServerInfo,
        start: int,
        end: int,
        client_rtts: Mapping[str, float],
    ) -> None:
        lo, hi = max(s.start_block, start), min(s.end_block, end)
        per_block = 1.0 / (s.throughput * len(s.span))
        for i in range(lo, hi):
            graph.add_edge(("enter", s.peer_id, i), ("ran", s.peer_id, i + 1), weight=per_block)
            if i > lo:
                graph.add_edge(("ran", s.peer_id, i), ("ran", s.peer_id, i + 1), weight=per_block)
        client_leg = client_rtts.get(s.peer_id, self.default_rtt) / 2
        if lo == start:
            graph.add_edge(_CLIENT_IN, ("enter", s.peer_id, start), weight=client_leg)
        if hi == end:
            graph.add_edge(("ran", s.peer_id, end), _CLIENT_OUT, weight=client_leg)

    def _add_links(
        self, graph: nx.DiGraph, p: ServerInfo, q: ServerInfo, start: int, end: int
    ) -> None:
        """Hand-offs from ``p`` (having computed up to ``j``) to ``q`` (computing from ``j``)."""
        first = max(p.start_block + 1, q.start_block, start + 1)
        last = min(p.end_block, q.end_block - 1, end - 1)
        leg = self._link_rtt(p, q) / 2
        for j in range(first, last + 1):
            graph.add_edge(("ran", p.peer_id, j), ("enter", q.peer_id, j), weight=leg)

    def _link_rtt(self, p: ServerInfo, q: ServerInfo) -> float:
        rtt = p.next_pings.get(q.peer_id)
        if rtt is None:
            rtt = q.next_pings.get(p.peer_id)
        return self.default_rtt if rtt is None else rtt


def swarm_max_flow(servers: Sequence[ServerInfo], num_blocks: int) -> float:
    """Tokens/s the ``ONLINE`` servers can push through all ``num_blocks`` blocks (0 if a block
    has no server)."""
    return _max_flow(_usable(servers, _ROUTABLE), 0, num_blocks)


def choose_best_span(
    servers: Sequence[ServerInfo], num_blocks: int, span_length: int, my_throughput: float,
    within: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Span ``(start, end)`` for a joining server that raises the swarm's max-flow the most.

    Joining and online servers both count. While the model has gaps, no single span raises the
    max-flow unless it closes the last gap, so ties go to the span covering the most of the
    least-served blocks (gaps first, then the lowest per-block throughput), then to the span
    with the least throughput already on it, then to the lowest start. ``within=(lo, hi)`` keeps
    the span inside blocks [lo, hi) (a server whose memory cannot hold an end of the model).
    """
    lo, hi = within or (0, num_blocks)
    if num_blocks <= 0 or span_length <= 0 or not 0 <= lo < hi <= num_blocks:
        raise ValueError("num_blocks and span_length must be positive, and within a range of blocks")
    placed = _usable(servers, _PLACED)
    length = min(span_length, hi - lo)
    per_block = _block_throughput(placed, num_blocks)
    model = placed[0].model if placed else ""
    least = min(per_block)

    def score(start: int) -> tuple[float, int, float]:
        me = _candidate(model, start, start + length, my_throughput)
        window = per_block[start : start + length]
        flow = round(_max_flow(placed + [me], 0, num_blocks), 6)  # tolerate float noise in ties
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
    leaves fewer uncovered blocks.
    """
    others = [s for s in _usable(servers, _PLACED) if s.peer_id != my_info.peer_id]
    span = choose_best_span(others, num_blocks, len(my_info.span), my_info.throughput, within)
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


def _candidate(model: str, start: int, end: int, throughput: float) -> ServerInfo:
    """The server block selection is placing, as a record so it joins the flow network."""
    return ServerInfo(
        peer_id=_CANDIDATE, model=model, start_block=start, end_block=end, throughput=throughput
    )


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


def _block_throughput(servers: Sequence[ServerInfo], num_blocks: int) -> list[float]:
    per_block = [0.0] * num_blocks
    for s in servers:
        for b in range(max(s.start_block, 0), min(s.end_block, num_blocks)):
            per_block[b] += s.throughput
    return per_block


def _flow_graph(servers: Sequence[ServerInfo], start: int, end: int) -> nx.DiGraph:
    """Boundaries ``start..end`` (int nodes) plus an ``in -> out`` pair per server (see the
    module docstring). Boundary edges have no capacity attribute, i.e. unlimited."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(start, end + 1))
    for s in servers:
        lo, hi = max(s.start_block, start), min(s.end_block, end)
        if lo >= hi:
            continue
        node_in, node_out = ("in", s.peer_id), ("out", s.peer_id)
        graph.add_edge(node_in, node_out, capacity=s.throughput)
        graph.add_edges_from((i, node_in) for i in range(lo, hi))
        graph.add_edges_from((node_out, j) for j in range(lo + 1, hi + 1))
    return graph


def _max_flow(servers: Sequence[ServerInfo], start: int, end: int) -> float:
    if _uncovered(servers, start, end):
        return 0.0
    return nx.maximum_flow_value(_flow_graph(servers, start, end), start, end)


def _path_to_hops(path: list) -> list[RouteHop]:
    """Turn a latency-graph path into hops: each ``enter`` node opens one."""
    hops: list[list] = []
    for kind, peer_id, block in path[1:-1]:
        if kind == "enter":
            hops.append([peer_id, block, block])
        else:
            hops[-1][2] = block
    return [RouteHop(peer_id, a, b) for peer_id, a, b in hops]


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
    full = [s for s in online if s.throughput > 0 and s.free_cache_tokens < max_length]
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
