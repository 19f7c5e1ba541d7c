"""ServerInfo records for tests that need no swarm: one builder, every field but the span optional."""

from __future__ import annotations

from typing import Any

from protocol.records import ServerInfo, ServerState


def srv(
    peer_id: str,
    start: int,
    end: int,
    throughput: float = 10.0,
    state: ServerState = ServerState.ONLINE,
    *,
    model: str = "m",
    **fields: Any,
) -> ServerInfo:
    """A server of blocks [start, end) with room for 4096 cache tokens unless ``fields`` say
    otherwise. A test module that always wants other defaults binds them once, e.g.
    ``srv = functools.partial(records.srv, model=MODEL)``: a call's own keywords still win."""
    fields.setdefault("free_cache_tokens", 4096)
    return ServerInfo(
        peer_id=peer_id, model=model, start_block=start, end_block=end, throughput=throughput, state=state, **fields
    )
