"""What each server actually delivers to this client, measured from lap timings.

A server's record claims its throughput (tokens/s for its whole span) and anyone can claim
anything up to ``protocol.records.MAX_THROUGHPUT``. The client times every decode lap, in every
decoding mode (client/_generation.py, ``SpeculativeDecoder._time_lap``, says which laps count), and attributes that
time to the hops of the route: a hop is charged what the lap took minus the network legs minus what
the *other* hops are expected to take at their current effective throughput. What a lap is:
- a run the client sent: from sending it to its verdict; its network legs are the client's own
  measured RTTs to the head and the tail (half each) and, per link between hops, half the smaller
  of the two servers' ``next_pings``, at most ``DEFAULT_RTT``;
- a looped run (the tail started it at the head, client/modes/looped.py): from the previous
  verdict's arrival to its own. Both arrivals cross the same tail -> client link, so that leg
  cancels; the legs are the tail -> head link and the links between hops (``next_pings`` as above;
  a leg nobody measured counts as zero: hops look slower, never faster).
A hop that is slower than it
claims therefore gets the unexplained time; the other hops' estimates recover as the slow one's
own estimate falls and explains more of the lap. Routing then uses the smaller of claimed and
measured (``protocol.routing.cap_throughput``), so a server far below its claim loses weight for
this client, and only for it.

Only laps with at most ``max_positions`` positions count: a decode lap costs about one step of
each span, which is what servers measure and claim (``server.placement.measure_throughput``); a
prefill lap would make every hop look slow. Estimates are kept in seconds per step (an
exponential moving average) and forgotten after ``ttl`` seconds, so a server that was slow once
is tried again later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from protocol.messages import Hop
from protocol.records import ServerInfo
from protocol.routing import DEFAULT_RTT

MAX_MEASURED_POSITIONS = 16  # laps with more positions (prefills, replays) are not timed


def lap_is_timed(overlapped: bool, positions: int, beside_audit: bool) -> bool:
    """Whether a lap says what its hops deliver: only one that had the route to itself. Not timed:
    a run sent while an earlier run of the session was in flight (it queued behind it at every hop,
    and the client cannot tell queueing from computing), a lap beside an audit of this generation
    (its sessions share the route's head and middles), and a prefill or replay (more positions than
    a decode lap: ``MAX_MEASURED_POSITIONS``)."""
    return not overlapped and positions <= MAX_MEASURED_POSITIONS and not beside_audit


@dataclass
class ThroughputMeter:
    alpha: float = 0.3  # weight of the newest lap in the moving average
    ttl: float = 300.0  # seconds a measurement is kept
    max_positions: int = MAX_MEASURED_POSITIONS
    clock: Callable[[], float] = time.monotonic
    _seconds: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (at, s per step)

    def measured(self) -> dict[str, float]:
        """Peer id -> measured tokens/s for its whole span (what the router compares with claims)."""
        now = self.clock()
        self._seconds = {p: v for p, v in self._seconds.items() if now - v[0] <= self.ttl}
        return {peer: 1.0 / step for peer, (_, step) in self._seconds.items()}

    def observe(
        self,
        route: Sequence[Hop],
        servers: Mapping[str, ServerInfo],
        seconds: float,
        positions: int,
        client_rtts: Mapping[str, float],
        looped: bool = False,
    ) -> None:
        """Attribute one lap of ``seconds`` over ``route`` (``servers``: the records it was
        planned from) to its hops; laps over unknown servers or too many positions are ignored.
        ``looped``: the lap began at the tail (a looped run), not at the client."""
        if not route or positions > self.max_positions or not seconds > 0:
            return
        infos = [servers.get(hop.peer_id) for hop in route]
        if any(info is None for info in infos):
            return
        measured = self.measured()
        network = _looped_network_seconds(infos) if looped else _network_seconds(route, infos, client_rtts)
        share = [(hop.end - hop.start) / max(1, info.end_block - info.start_block) for hop, info in zip(route, infos)]
        expected = [
            s / min(info.throughput, measured.get(info.peer_id, info.throughput)) for s, info in zip(share, infos)
        ]
        now = self.clock()
        for i, info in enumerate(infos):
            unexplained = seconds - network - (sum(expected) - expected[i])
            if unexplained <= 0 or share[i] <= 0:
                continue  # the others explain the whole lap: nothing learned about this hop
            step = unexplained / share[i]  # seconds for one step of the whole span
            _, old = self._seconds.get(info.peer_id, (now, step))
            self._seconds[info.peer_id] = (now, (1 - self.alpha) * old + self.alpha * step)


def _network_seconds(route: Sequence[Hop], infos: Sequence[ServerInfo], client_rtts: Mapping[str, float]) -> float:
    """One-way legs of a lap: the client's own RTTs to the head and the tail, and per link between
    hops the smaller of the two servers' ``next_pings``, at most ``DEFAULT_RTT`` (what the router
    assumes for an unmeasured link), so a server that claims a slow link hides at most half that
    of its compute. Unknown legs count as zero: that makes hops look slower, never faster."""
    legs = client_rtts.get(route[0].peer_id, 0.0) / 2 + client_rtts.get(route[-1].peer_id, 0.0) / 2
    return legs + sum(_link_seconds(p, q) for p, q in zip(infos, infos[1:]))


def _looped_network_seconds(infos: Sequence[ServerInfo]) -> float:
    """One-way legs of a looped lap: tail -> head, then the links between hops (none on a route of
    one server, whose tail is its head)."""
    links = sum(_link_seconds(p, q) for p, q in zip(infos, infos[1:]))
    return links + (_link_seconds(infos[-1], infos[0]) if len(infos) > 1 else 0.0)


def _link_seconds(p: ServerInfo, q: ServerInfo) -> float:
    """One way over the p -> q link: half the smaller of the two servers' ``next_pings`` of each
    other, at most ``DEFAULT_RTT``; zero when neither measured it."""
    rtts = [r for r in (p.next_pings.get(q.peer_id), q.next_pings.get(p.peer_id)) if r is not None]
    return min(rtts + [DEFAULT_RTT]) / 2 if rtts else 0.0
