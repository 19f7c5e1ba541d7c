"""The dashboard's state and the pure fold that builds it: ``apply(state, event) -> state``.

Nothing here does I/O or reads a clock: each event brings its own time, so a list of events
always folds to the same state (see :mod:`swarm.dashboard.events`). States are frozen; the
mappings inside them are built fresh by each fold and never mutated afterwards.

Derived figures (per-block coverage, max-flow, health) are computed once per poll, here, so
the page, the JSON API and the Prometheus collector all read the same numbers.

Memory is bounded: a vanished server or model is kept (as offline) for ``forget_after``
seconds, history keeps ``history_points`` points per model (one per ``history_interval``),
uptime records are capped at ``max_uptime_records`` peers and reachability errors at
``max_errors`` entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from protocol.flow import swarm_max_flow
from protocol.records import ServerInfo, ServerState
from protocol.version import PROTOCOL_VERSION
from swarm.dashboard.events import Event, ModelSnapshot, PeerProbed, PollFailed, SwarmPolled

# A bucket of the uptime timeline shows the worst state seen in it.
_SEVERITY = {ServerState.ONLINE: 0, ServerState.JOINING: 1, ServerState.DRAINING: 2, ServerState.OFFLINE: 3}


@dataclass(frozen=True)
class Limits:
    """How much the dashboard remembers; passed down from the command line."""

    forget_after: float = 300.0  # seconds a vanished server or model stays listed as offline
    history_interval: float = 60.0  # seconds per history point
    history_points: int = 360  # points per series: 6 hours at one a minute
    max_errors: int = 50
    max_uptime_records: int = 1000


@dataclass(frozen=True)
class BlockCoverage:
    servers: int  # online servers holding the block
    throughput: float  # their total tokens/s


@dataclass(frozen=True)
class HistoryPoint:
    at: float  # start of the interval; the point holds the last poll within it
    coverage: float  # fraction of blocks with an online server
    max_flow: float  # tokens/s
    throughput: float  # sum of the online servers' throughput, tokens/s
    servers: int  # online servers


@dataclass(frozen=True)
class ServerEntry:
    """A server as the dashboard last saw it. ``state`` is its record's state, or OFFLINE once
    its record has vanished (the entry is then dropped ``forget_after`` seconds after last_seen)."""

    info: ServerInfo
    state: ServerState
    last_seen: float
    rtt: Optional[float] = None  # dashboard -> server, from the last probe
    probe_error: Optional[str] = None


@dataclass(frozen=True)
class UptimeRecord:
    first_seen: float
    last_seen: float
    polls: int  # polls that listed the server (online or not) since first_seen
    online_polls: int
    timeline: tuple[tuple[float, ServerState], ...] = ()  # (interval start, worst state in it)

    @property
    def availability(self) -> float:
        return self.online_polls / self.polls if self.polls else 0.0


@dataclass(frozen=True)
class ModelEntry:
    name: str
    num_blocks: Optional[int]
    last_listed: float  # last poll whose registry listed the model
    servers: Mapping[str, ServerEntry] = field(default_factory=dict)
    coverage: tuple[BlockCoverage, ...] = ()
    max_flow: float = 0.0
    history: tuple[HistoryPoint, ...] = ()
    disputes: Mapping[str, int] = field(default_factory=dict)  # peer id -> clients reporting it (last poll)

    @property
    def missing_blocks(self) -> list[int]:
        return [block for block, cover in enumerate(self.coverage) if cover.servers == 0]

    @property
    def healthy(self) -> bool:
        """Usable right now: the number of blocks is known and every block has an online server."""
        return bool(self.coverage) and not self.missing_blocks

    def online(self) -> list[ServerInfo]:
        """Online servers a client of this version can route to (another protocol version cannot)."""
        return [
            entry.info
            for entry in self.servers.values()
            if entry.state == ServerState.ONLINE and entry.info.protocol_version == PROTOCOL_VERSION
        ]


@dataclass(frozen=True)
class ReachabilityError:
    at: float  # last time it happened
    model: str
    peer_id: str
    message: str
    count: int = 1


@dataclass(frozen=True)
class State:
    limits: Limits = Limits()
    models: Mapping[str, ModelEntry] = field(default_factory=dict)
    uptime: Mapping[str, UptimeRecord] = field(default_factory=dict)
    errors: tuple[ReachabilityError, ...] = ()  # oldest first, one per (peer, message)
    updated_at: Optional[float] = None  # last successful poll
    poll_error: Optional[str] = None  # why the last poll failed; cleared by the next success
    poll_error_at: Optional[float] = None


def apply(state: State, event: Event) -> State:
    """The new state after ``event``; ``state`` itself is left as it was."""
    if isinstance(event, SwarmPolled):
        return _polled(state, event)
    if isinstance(event, PollFailed):
        return replace(state, poll_error=event.message, poll_error_at=event.at)
    if isinstance(event, PeerProbed):
        return _probed(state, event)
    raise TypeError(f"not a dashboard event: {event!r}")


def fold(events, state: Optional[State] = None) -> State:
    """Apply ``events`` in order, starting from ``state`` (default: empty, default limits)."""
    state = state or State()
    for event in events:
        state = apply(state, event)
    return state


# ---- SwarmPolled ------------------------------------------------------------------------------


def _polled(state: State, event: SwarmPolled) -> State:
    limits, at = state.limits, event.at
    snapshots = {snapshot.name: snapshot for snapshot in event.models}
    models: dict[str, ModelEntry] = {}
    for name in sorted(set(state.models) | set(snapshots)):
        previous = state.models.get(name)
        snapshot = snapshots.get(name)
        if snapshot is None:  # unlisted: keep its vanished servers as offline until forgotten
            snapshot = ModelSnapshot(name, previous.num_blocks, ())
            if at - previous.last_listed > limits.forget_after:
                continue
        models[name] = _model_polled(previous, snapshot, at, limits, listed=name in snapshots)
    uptime = _uptime_polled(state.uptime, models.values(), at, limits)
    return replace(state, models=models, uptime=uptime, updated_at=at, poll_error=None, poll_error_at=None)


def _model_polled(
    previous: Optional[ModelEntry], snapshot: ModelSnapshot, at: float, limits: Limits, listed: bool
) -> ModelEntry:
    old_servers = previous.servers if previous else {}
    servers: dict[str, ServerEntry] = {}
    for info in snapshot.servers:
        old = old_servers.get(info.peer_id)
        probe = {"rtt": old.rtt, "probe_error": old.probe_error} if old else {}
        servers[info.peer_id] = ServerEntry(info, info.state, at, **probe)
    for peer_id, old in old_servers.items():
        if peer_id not in servers and at - old.last_seen <= limits.forget_after:
            servers[peer_id] = replace(old, state=ServerState.OFFLINE)
    num_blocks = snapshot.num_blocks or (previous.num_blocks if previous else None)
    entry = ModelEntry(
        name=snapshot.name,
        num_blocks=num_blocks,
        last_listed=at if listed or previous is None else previous.last_listed,
        servers=dict(sorted(servers.items(), key=lambda item: (item[1].info.start_block, item[0]))),
        history=previous.history if previous else (),
        disputes={peer: n for peer, n in snapshot.disputes.items() if peer in servers},  # bounded by the servers
    )
    online = entry.online()
    coverage = block_coverage(online, num_blocks or 0)
    max_flow = swarm_max_flow(online, num_blocks) if num_blocks else 0.0
    point = HistoryPoint(
        at=_bucket(at, limits.history_interval),
        coverage=sum(c.servers > 0 for c in coverage) / len(coverage) if coverage else 0.0,
        max_flow=max_flow,
        throughput=sum(info.throughput for info in online),
        servers=len(online),
    )
    history = _append_point(entry.history, point, limits.history_points)
    return replace(entry, coverage=coverage, max_flow=max_flow, history=history)


def block_coverage(online: list[ServerInfo], num_blocks: int) -> tuple[BlockCoverage, ...]:
    """Per block: how many of the ``online`` servers hold it, and their total throughput."""
    counts, throughput = [0] * num_blocks, [0.0] * num_blocks
    for info in online:
        for block in range(max(info.start_block, 0), min(info.end_block, num_blocks)):
            counts[block] += 1
            throughput[block] += info.throughput
    return tuple(BlockCoverage(n, t) for n, t in zip(counts, throughput))


def _append_point(history: tuple[HistoryPoint, ...], point: HistoryPoint, limit: int) -> tuple[HistoryPoint, ...]:
    """One point per interval: a poll in the last point's interval replaces it."""
    if history and history[-1].at == point.at:
        history = history[:-1]
    return (history + (point,))[-limit:]


def _uptime_polled(uptime: Mapping[str, UptimeRecord], models, at: float, limits: Limits) -> dict:
    records = dict(uptime)
    for model in models:
        for peer_id, entry in model.servers.items():
            records[peer_id] = _uptime_seen(records.get(peer_id), entry.state, at, limits)
    if len(records) > limits.max_uptime_records:  # forget the peers seen longest ago
        newest = sorted(records.items(), key=lambda item: item[1].last_seen)[-limits.max_uptime_records :]
        records = dict(newest)
    return records


def _uptime_seen(record: Optional[UptimeRecord], state: ServerState, at: float, limits: Limits) -> UptimeRecord:
    bucket = _bucket(at, limits.history_interval)
    record = record or UptimeRecord(first_seen=at, last_seen=at, polls=0, online_polls=0)
    timeline = record.timeline
    if timeline and timeline[-1][0] == bucket:
        worst = max(timeline[-1][1], state, key=_SEVERITY.__getitem__)
        timeline = timeline[:-1] + ((bucket, worst),)
    else:
        timeline = (timeline + ((bucket, state),))[-limits.history_points :]
    return UptimeRecord(
        first_seen=record.first_seen,
        last_seen=at if state != ServerState.OFFLINE else record.last_seen,
        polls=record.polls + 1,
        online_polls=record.online_polls + (state == ServerState.ONLINE),
        timeline=timeline,
    )


def _bucket(at: float, interval: float) -> float:
    return math.floor(at / interval) * interval if interval > 0 else at


# ---- PeerProbed -------------------------------------------------------------------------------


def _probed(state: State, event: PeerProbed) -> State:
    model = state.models.get(event.model)
    if model is not None and event.peer_id in model.servers:
        entry = replace(model.servers[event.peer_id], rtt=event.rtt, probe_error=event.error)
        model = replace(model, servers={**model.servers, event.peer_id: entry})
        state = replace(state, models={**state.models, event.model: model})
    if event.error is None:
        return state
    same = [e for e in state.errors if (e.peer_id, e.message) == (event.peer_id, event.error)]
    error = ReachabilityError(event.at, event.model, event.peer_id, event.error, 1 + sum(e.count for e in same))
    others = tuple(e for e in state.errors if (e.peer_id, e.message) != (event.peer_id, event.error))
    return replace(state, errors=(others + (error,))[-state.limits.max_errors :])
