"""The JSON the API serves and the page renders, built from a :class:`State`.

Field meanings are documented in ``docs/dashboard.md``; keep the two in step. Only plain JSON
types come out of here (no enums, no structs), and times are unix seconds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from protocol.records import ServerState
from protocol.version import PROTOCOL_VERSION
from swarm.dashboard.state import ModelEntry, ServerEntry, State, UptimeRecord

API_VERSION = 1
ANONYMOUS = "(anonymous)"
PER_PAGE = 100  # server rows per page when the caller pages (the page does: 1,000 rows took 3.9 s to draw)
MAX_PER_PAGE = 1000
PAGED_CONTRIBUTORS = 25  # contributor rows in a paged view (a swarm of 1,000 one-server volunteers has 1,000)


@dataclass(frozen=True)
class Paging:
    """Which server rows of each model a view carries: ``page`` (1-based) of ``per_page`` rows,
    ordered by first block then peer id (as docs/dashboard.md says) so that a page holds the same
    servers from one poll to the next."""

    page: int = 1
    per_page: int = PER_PAGE

    def __post_init__(self) -> None:
        if self.page < 1:
            raise ValueError(f"page must be 1 or more, got {self.page}")
        if not 1 <= self.per_page <= MAX_PER_PAGE:
            raise ValueError(f"per_page must be between 1 and {MAX_PER_PAGE}, got {self.per_page}")


def state_view(state: State, now: float, refresh_seconds: float, paging: Optional[Paging] = None) -> dict[str, Any]:
    """Everything the page shows; with ``paging``, each model's ``servers`` holds one page of rows
    and ``servers_page`` says which, and ``top_contributors`` the first PAGED_CONTRIBUTORS groups
    (``contributors_total`` says how many there are); without it, every row: the API as it always was."""
    contributors = top_contributors(state)
    view = {
        "api_version": API_VERSION,
        "now": now,
        "updated_at": state.updated_at,
        "refresh_seconds": refresh_seconds,
        "error": state.poll_error,
        "error_at": state.poll_error_at,
        "models": [model_view(model, state, now, paging) for model in state.models.values()],
        "top_contributors": contributors if paging is None else contributors[:PAGED_CONTRIBUTORS],
        "reachability_errors": [
            {"at": e.at, "model": e.model, "peer_id": e.peer_id, "message": e.message, "count": e.count}
            for e in reversed(state.errors)
        ],
    }
    if paging is not None:
        view["contributors_total"] = len(contributors)
    return view


def model_view(model: ModelEntry, state: State, now: float, paging: Optional[Paging] = None) -> dict[str, Any]:
    online = model.online()
    entries = list(model.servers.items())
    page = None
    if paging is not None:
        pages = max(1, -(-len(entries) // paging.per_page))
        number = min(paging.page, pages)  # past the last page (the swarm shrank): the last one
        entries.sort(key=lambda item: (item[1].info.start_block, item[0]))
        entries = entries[(number - 1) * paging.per_page : number * paging.per_page]
        page = {"page": number, "per_page": paging.per_page, "pages": pages, "total": len(model.servers)}
    view = {
        "name": model.name,
        "healthy": model.healthy,
        "num_blocks": model.num_blocks,
        "missing_blocks": model.missing_blocks,
        "max_flow": model.max_flow,
        "throughput": sum(info.throughput for info in online),
        "servers_online": len(online),
        "servers_total": len(model.servers),
        "blocks": [
            {"block": i, "servers": c.servers, "throughput": c.throughput} for i, c in enumerate(model.coverage)
        ],
        "speculation": speculation_view(model),
        "history": [
            {
                "at": p.at,
                "coverage": p.coverage,
                "max_flow": p.max_flow,
                "throughput": p.throughput,
                "servers": p.servers,
            }
            for p in model.history
        ],
        "servers": [
            server_view(entry, state.uptime.get(peer_id), model.num_blocks, now, model.disputes.get(peer_id, 0))
            for peer_id, entry in entries
        ],
    }
    if page is not None:
        view["servers_page"] = page
    return view


def server_view(
    entry: ServerEntry, uptime: Optional[UptimeRecord], num_blocks: Optional[int], now: float, disputed_by: int = 0
) -> dict:
    info = entry.info
    up = entry.state != ServerState.OFFLINE and info.started_at > 0
    return {
        "peer_id": info.peer_id,
        "public_name": info.public_name,
        "version": info.version,
        "protocol_version": info.protocol_version,
        "compatible": info.protocol_version == PROTOCOL_VERSION,  # else routers skip it (and coverage leaves it out)
        "state": entry.state.value,
        "start_block": info.start_block,
        "end_block": info.end_block,
        "is_tail": num_blocks is not None and info.end_block == num_blocks,
        "started_at": info.started_at or None,
        "uptime_seconds": max(0.0, now - info.started_at) if up else None,
        "last_seen": entry.last_seen,
        "availability": uptime.availability if uptime else None,
        "uptime_timeline": [{"at": at, "state": s.value} for at, s in uptime.timeline] if uptime else [],
        "throughput": info.throughput,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "adapters": list(info.adapters),  # LoRA adapters it serves (--adapters)
        "cache_tokens": info.cache_tokens,
        "free_cache_tokens": info.free_cache_tokens,
        "open_sessions": info.open_sessions,
        "using_relay": info.using_relay,
        "next_pings": dict(info.next_pings),
        "rtt": entry.rtt,
        "probe_error": entry.probe_error,
        "laps_served": info.laps_served,
        "accepted_tokens": info.accepted_tokens,
        "cancelled_runs": info.cancelled_runs,
        "disputed_by": disputed_by,
    }


def speculation_view(model: ModelEntry) -> dict[str, Any]:
    """Totals over the tail servers (only they see results), whether online or recently gone."""
    tails = [e.info for e in model.servers.values() if model.num_blocks and e.info.end_block == model.num_blocks]
    laps = sum(info.laps_served for info in tails)
    accepted = sum(info.accepted_tokens for info in tails)
    return {
        "tail_servers": len(tails),
        "laps_served": laps,
        "accepted_tokens": accepted,
        "tokens_per_lap": accepted / laps if laps else None,
        "cancelled_runs": sum(info.cancelled_runs for info in tails),
    }


def top_contributors(state: State) -> list[dict[str, Any]]:
    """Online servers grouped by public name, most blocks served first (then throughput)."""
    groups: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"servers": 0, "blocks": 0, "throughput": 0.0, "models": set()}
    )
    for model in state.models.values():
        for info in model.online():
            group = groups[info.public_name or ANONYMOUS]
            group["servers"] += 1
            group["blocks"] += len(info.span)
            group["throughput"] += info.throughput
            group["models"].add(model.name)
    rows = [{"public_name": name, **group, "models": sorted(group["models"])} for name, group in groups.items()]
    return sorted(rows, key=lambda row: (-row["blocks"], -row["throughput"], row["public_name"]))
