"""What a server tells the swarm about itself, as stored in the DHT.

A record is stored under the key ``"{model}.{block}"`` for every block the server holds, with the
server's peer id (base58) as the subkey, so one DHT ``get`` of a block key lists every server of
that block. Records expire ``expiration`` seconds after they were written unless the server
refreshes them; a server that stops refreshing disappears from routing on its own.

Records are decoded with :func:`msgspec.convert`, which validates the types of the fields it
knows and ignores fields it does not, so older peers can read records written by newer ones.

Anyone can join and sign records under their own peer id, so a record is checked against what a
reader knows, not against what it claims (``docs/reliability.md``, "Hostile records"): every
number is finite and inside the bounds below, every string and mapping has a bounded size, and
:meth:`ServerInfo.from_dict` given the model's ``num_blocks`` (from the model's own config) also
requires ``0 <= start_block < end_block <= num_blocks``. Nothing here is sized by a claim, so a
reader's cost is bounded by servers x blocks of the model.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Optional

import msgspec

from protocol.limits import DEFAULT_MAX_POSITIONS_PER_STEP, MAX_POSITIONS_PER_STEP, MIN_POSITIONS_PER_STEP
from protocol.version import PROTOCOL_VERSION


class ServerState(str, enum.Enum):
    JOINING = "joining"
    ONLINE = "online"
    DRAINING = "draining"
    OFFLINE = "offline"


# Bounds of a record's fields. Generous: an honest server is far inside every one of them.
MAX_MODEL_BLOCKS = 1024  # blocks of any model (the largest open models have < 200 layers)
MAX_THROUGHPUT = 1e6  # tokens/s for a span: ~100x a top GPU decoding a small span one position at a time
MIN_THROUGHPUT = 1e-3  # below this a server is useless, and 1 / throughput stays finite in the router
MAX_CACHE_TOKENS = 10**12
MAX_COUNT = 2**62  # session and lap counters
MAX_NEXT_PINGS = 64  # servers measure at most server.upkeep.MAX_PINGED (8) next servers
MAX_RTT = 60.0  # seconds
MAX_PEER_ID_CHARS = 128  # base58 peer ids are ~46-53 characters
MAX_NAME_CHARS = 256  # model names and public names
MAX_SHORT_CHARS = 64  # version, dtype, quantization
MAX_RELAY_ADDRS = 4  # circuit addresses of a server behind NAT (protocol.relay)
MAX_ADDR_CHARS = 512
MAX_TIME = 1e11  # unix seconds (year ~5138): keeps started_at finite
MAX_ADAPTERS = 16  # LoRA adapters one server announces (--adapters)
MAX_BACKWARD_BYTES = 1 << 50  # one training row's backward activations (1 PiB: no device holds that)

_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
_CacheTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_CACHE_TOKENS)]
_Block = Annotated[int, msgspec.Meta(ge=0, le=MAX_MODEL_BLOCKS)]
_PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PEER_ID_CHARS)]
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
_Short = Annotated[str, msgspec.Meta(max_length=MAX_SHORT_CHARS)]
_Rtt = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RTT)]  # NaN fails every bound
_Pings = Annotated[dict[_PeerId, _Rtt], msgspec.Meta(max_length=MAX_NEXT_PINGS)]
_Addr = Annotated[str, msgspec.Meta(max_length=MAX_ADDR_CHARS)]
_Throughput = Annotated[float, msgspec.Meta(ge=MIN_THROUGHPUT, le=MAX_THROUGHPUT)]


class ServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One server's announcement for one model (identical under each of its block keys)."""

    # The bounds (Annotated) are checked when a record is decoded, not when one is constructed.
    peer_id: _PeerId
    model: _Name
    start_block: _Block
    end_block: _Block  # exclusive
    state: ServerState = ServerState.ONLINE
    throughput: _Throughput = 1.0  # tokens/s this span sustains on its device, measured at start-up
    cache_tokens: _CacheTokens = 0  # total KV budget in tokens
    free_cache_tokens: _CacheTokens = 0
    protocol_version: _Count = PROTOCOL_VERSION
    version: _Short = ""  # package version
    public_name: Optional[_Name] = None
    dtype: _Short = "float32"
    quantization: Optional[_Short] = None
    using_relay: bool = False
    next_pings: _Pings = {}  # peer id -> RTT in seconds, measured by this server
    started_at: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIME)] = 0.0  # unix time the server came up
    open_sessions: _Count = 0  # sessions open on this server when the record was written
    # Counters since start-up, for the dashboard's speculation figures (a tail server's runs are laps)
    laps_served: _Count = 0  # runs computed and passed on (by the tail: answered)
    accepted_tokens: _Count = 0  # tokens committed by the tail's results: accepted drafts + 1 per lap
    cancelled_runs: _Count = 0
    # Behind NAT: circuit addresses through which peers dial this server (protocol.relay; readers keep
    # only well-formed circuit addresses naming this peer)
    relay_addrs: Annotated[list[_Addr], msgspec.Meta(max_length=MAX_RELAY_ADDRS)] = []
    # What a client must respect: the most positions one Step to this server may carry (clients
    # chunk prefill to the smallest on their route; older records read as the default)
    max_positions_per_step: Annotated[int, msgspec.Meta(ge=MIN_POSITIONS_PER_STEP, le=MAX_POSITIONS_PER_STEP)] = (
        DEFAULT_MAX_POSITIONS_PER_STEP
    )
    # Which model exactly: the config's fingerprint (protocol.models.config_fingerprint) and the
    # weights' revision (protocol.models.weights_revision: a hub commit, or a local folder's hash).
    # Servers of another config or revision are never routed together with ours (protocol.routing.same_model)
    config_fingerprint: _Short = ""
    revision: _Short = ""
    # The most positions (OpenSession.max_length) one session may reserve here (--max-session-tokens);
    # 0: not announced (older records), only free_cache_tokens limits it
    max_session_tokens: _CacheTokens = 0
    # the LoRA adapters this server applies on request (--adapters; OpenSession/TrainForward.active_adapter):
    # clients that ask for one route only through servers that announce it
    adapters: Annotated[list[_Name], msgspec.Meta(max_length=MAX_ADAPTERS)] = []
    # training rows (and chunks of long rows) this server computed forward since start-up; a resend answered
    # from its earlier reply (single-span replacement, server/train_replay.py) is not one
    train_forwards: _Count = 0
    # the activation bytes one training row's (or chunk's) backward may need through this server's blocks, what it
    # refuses past (--max-backward-mib, or by default what a row of max_positions_per_step needs:
    # server/train_budget.py); clients size a long row's chunks so each fits the smallest on their route
    # (protocol/train_memory.py). 0: not announced (older records): clients assume that default
    max_backward_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_BACKWARD_BYTES)] = 0

    @property
    def session_room(self) -> int:
        """The largest max_length a new session may ask of this server now."""
        if self.max_session_tokens:
            return min(self.free_cache_tokens, self.max_session_tokens)
        return self.free_cache_tokens

    @property
    def span(self) -> range:
        return range(self.start_block, self.end_block)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, raw: Any, num_blocks: Optional[int] = None) -> "ServerInfo":
        """Validate a record read from the DHT; raises ``msgspec.ValidationError`` on a bad one.

        ``num_blocks`` is the model's number of blocks, from its config (never from a record or
        the registry): the span must lie inside it. Without it only the field bounds are checked.
        """
        info = msgspec.convert(raw, cls)
        limit = MAX_MODEL_BLOCKS if num_blocks is None else num_blocks
        if not 0 <= info.start_block < info.end_block <= limit:
            raise msgspec.ValidationError(
                f"span {info.start_block}:{info.end_block} is not inside the model's 0:{limit}"
            )
        return info


def block_key(model: str, block: int) -> str:
    return f"{model}.{block}"


MODELS_KEY = "_specswarm.models"  # subkey: model name, value: {"num_blocks": N} (None from older servers)
# Anyone can write MODELS_KEY (it is unprotected, protocol.validation.UNPROTECTED_KEYS): readers take
# num_blocks from the model's config where they have it, and cap it at MAX_MODEL_BLOCKS otherwise.


# Spot-check reports (client/_spot_checks.py, docs/reliability.md "Spot-checks"): a client that
# caught a server lying stores {accused peer id: times caught} under REPORTS_KEY with its own peer id
# as the subkey (signed like any protected record, so nobody writes another client's report). A
# report is anybody's claim (a Sybil can make many identities): readers count distinct reporters and
# show it as a signal, never as a ban.
MAX_REPORTED_PEERS = 64  # entries of one client's report
MAX_REPORTERS = 1024  # client reports a reader counts per model
MAX_REPORT_COUNT = 2**31
REPORT_EXPIRATION = 3600.0  # seconds a report lives unless its client stores it again


def reports_key(model: str) -> str:
    return f"{model}.reports"
