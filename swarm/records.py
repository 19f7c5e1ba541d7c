"""What a server tells the swarm about itself, as stored in the DHT.

A record is stored under the key ``"{model}.{block}"`` for every block the server holds, with the
server's peer id (base58) as the subkey, so one DHT ``get`` of a block key lists every server of
that block. Records expire ``expiration`` seconds after they were written unless the server
refreshes them; a server that stops refreshing disappears from routing on its own.

Records are decoded with :func:`msgspec.convert`, which validates the types of the fields it
knows and ignores fields it does not, so older peers can read records written by newer ones.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from protocol.version import PROTOCOL_VERSION


class ServerState(str, enum.Enum):
    JOINING = "joining"
    ONLINE = "online"
    DRAINING = "draining"
    OFFLINE = "offline"


class ServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One server's announcement for one model (identical under each of its block keys)."""

    peer_id: str
    model: str
    start_block: int
    end_block: int  # exclusive
    state: ServerState = ServerState.ONLINE
    throughput: float = 1.0  # tokens/s this span sustains on its device, measured at start-up
    cache_tokens: int = 0  # total KV budget in tokens
    free_cache_tokens: int = 0
    protocol_version: int = PROTOCOL_VERSION
    version: str = ""  # package version
    public_name: Optional[str] = None
    dtype: str = "float32"
    quantization: Optional[str] = None
    using_relay: bool = False
    next_pings: dict[str, float] = {}  # peer id -> RTT in seconds, measured by this server
    started_at: float = 0.0  # unix time the server came up
    open_sessions: int = 0  # sessions open on this server when the record was written
    # Counters since start-up, for the dashboard's speculation figures (a tail server's runs are laps)
    laps_served: int = 0  # runs computed and passed on (by the tail: answered)
    accepted_tokens: int = 0  # tokens committed by the tail's results: accepted drafts + 1 per lap
    cancelled_runs: int = 0

    @property
    def span(self) -> range:
        return range(self.start_block, self.end_block)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, raw: Any) -> "ServerInfo":
        """Validate a record read from the DHT; raises ``msgspec.ValidationError`` on a bad one."""
        return msgspec.convert(raw, cls)


def block_key(model: str, block: int) -> str:
    return f"{model}.{block}"


MODELS_KEY = "_specswarm.models"  # subkey: model name, value: {"num_blocks": N} (None from older servers)
