"""What the dashboard learns about the swarm, as typed, frozen events.

The dashboard never edits its state in place: the poller turns each read of the DHT into events,
and :func:`swarm.dashboard.state.apply` folds them into a new state (as exo's ``event_apply``
does), so any state can be rebuilt, and tested, from a plain list of events.
Every event carries the unix time ``at`` it describes; the fold takes its clock from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from protocol.records import ServerInfo


@dataclass(frozen=True)
class ModelSnapshot:
    """Every unexpired record of one model, as one read of the DHT found them."""

    name: str
    num_blocks: Optional[int]  # None: no server said, and none of the records reach further
    servers: tuple[ServerInfo, ...]
    # accused peer id -> clients whose spot-checks caught it lying (protocol.dht_records.fetch_reports):
    # anybody's claims, a signal and not a ban
    disputes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SwarmPolled:
    """A complete, successful read of the model registry and of every listed model's blocks.

    Servers and models that are not in it have lost their records (expired, or announced their
    departure long enough ago); the fold shows them as offline for a while, then forgets them.
    """

    at: float
    models: tuple[ModelSnapshot, ...]


@dataclass(frozen=True)
class PollFailed:
    """A read of the DHT failed; the last good state stays, flagged with this message."""

    at: float
    message: str


@dataclass(frozen=True)
class PeerProbed:
    """The dashboard dialled a server directly: its round-trip time, or why it could not."""

    at: float
    model: str
    peer_id: str
    rtt: Optional[float]  # seconds; None when the probe failed
    error: Optional[str] = None


Event = Union[SwarmPolled, PollFailed, PeerProbed]
