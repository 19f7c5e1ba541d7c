"""Why no route exists: :class:`NoRouteError` and the message that tells a user what would help.

A planner (:mod:`protocol.routing`) raises it when no usable server covers some blocks. The
message names the missing blocks, why each server holding them was passed over (excluded after
failing, not online, another protocol version, no throughput, no cache room), and the ``--blocks``
argument that would fill each gap, so a volunteer can act on it without reading the code.
"""

from __future__ import annotations

from collections import Counter
from typing import Collection, Sequence

from protocol.records import ServerInfo, ServerState
from protocol.version import PROTOCOL_VERSION


class NoRouteError(Exception):
    """No usable servers cover ``missing_blocks``; the message says why and what would help."""

    def __init__(self, message: str, missing_blocks: list[int]):
        super().__init__(message)
        self.missing_blocks = missing_blocks


def no_route_error(
    servers: Sequence[ServerInfo], missing: list[int], max_length: int, exclude: Collection[str]
) -> NoRouteError:
    """Say which blocks lack a server, why the servers that hold them were passed over, and
    which ``--blocks`` argument would fill each gap."""
    gaps = _ranges(missing)
    where = " and ".join(f"block {a}" if b == a + 1 else f"blocks {a}..{b - 1}" for a, b in gaps)
    fix = " and ".join(f"--blocks {a}:{b}" for a, b in gaps)
    if not servers:  # not "nobody holds these blocks": nothing was read at all
        message = (
            "the DHT returned no server records for this model (an empty swarm, another model "
            f"name or swarm, or a DHT read that failed); start a server with {fix}"
        )
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
    """Why each holder of a missing block was not usable, grouped into short phrases: first what
    rules a server out whatever the session (:func:`_ruled_out`), then what this session asks of
    the online ones (:func:`_short_of_room`)."""
    rest = [s for s in holders if s.peer_id not in exclude]
    online = [s for s in rest if s.state == ServerState.ONLINE and s.protocol_version == PROTOCOL_VERSION]
    return _ruled_out(holders, rest, exclude) + _short_of_room(online, max_length)


def _ruled_out(holders: list[ServerInfo], rest: list[ServerInfo], exclude: Collection[str]) -> list[str]:
    """Holders excluded after failing this client, not ``ONLINE``, or on another protocol version
    (``rest``: the holders not excluded)."""
    excluded = [s for s in holders if s.peer_id in exclude]
    not_online = Counter(s.state.value for s in rest if s.state != ServerState.ONLINE)
    other_version = [s for s in rest if s.state == ServerState.ONLINE and s.protocol_version != PROTOCOL_VERSION]
    reasons = [f"{_servers_are(len(excluded))} excluded after failing"] if excluded else []
    reasons += [f"{_servers_are(n)} {state}" for state, n in sorted(not_online.items())]
    if other_version:
        versions = ", ".join(str(v) for v in sorted({s.protocol_version for s in other_version}))
        reasons.append(f"{_servers_are(len(other_version))} on protocol version {versions}, not {PROTOCOL_VERSION}")
    return reasons


def _short_of_room(online: list[ServerInfo], max_length: int) -> list[str]:
    """Online holders of this version that report no throughput, or have no cache room for a
    session of ``max_length`` tokens (out of free cache, or capped by ``--max-session-tokens``)."""
    stalled = [s for s in online if s.throughput <= 0]
    capped = [s for s in online if s.throughput > 0 and 0 < s.max_session_tokens < max_length]
    full = [s for s in online if s.throughput > 0 and s not in capped and s.free_cache_tokens < max_length]
    reasons = [f"{_servers_are(len(stalled))} reporting zero throughput"] if stalled else []
    if full:
        most = max(s.free_cache_tokens for s in full)
        room = f"out of cache room for {max_length} tokens (most free: {most})"
        reasons.append(f"{_servers_are(len(full))} {room}")
    if capped:
        most = max(s.max_session_tokens for s in capped)
        reasons.append(
            f"{_servers_are(len(capped))} capped at sessions of {most} tokens (--max-session-tokens), not {max_length}"
        )
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
