"""Can other peers dial this one? A dial-back probe, and joining through a relay when they cannot.

libp2p's AutoNAT answers the same question, but only after several peers have dialed back, and it
never says "nobody can reach you through this relay either". specswarm asks directly: a server
sends a :class:`DialBack` request to public peers (its initial peers); each starts a fresh libp2p
daemon that has no connection to the asker, dials the addresses the asker announced and reports
whether the dial succeeded. Because the prober is a fresh daemon, an existing connection the
asker opened itself (which NAT lets through) can never make the answer "reachable".

A server that nobody can dial restarts its DHT as a client with its initial peers as relays
(:func:`protocol.dht.make_dht`), then asks for a dial back through each relay's circuit address; if
none works it stops with one clear line (:class:`NoRelayError`) instead of announcing a span nobody
can use. Otherwise it announces those circuit addresses (``ServerInfo.relay_addrs``) with
``using_relay``, and peers dial it through them (:mod:`protocol.relay`).

Probers only dial the asker's own peer id (the authenticated remote id of the request), at most
:data:`MAX_PROBE_ADDRS` addresses, and run at most :data:`MAX_CONCURRENT_PROBES` at once, so the
probe cannot be used to make a public peer dial strangers or run many daemons.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

import msgspec
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from multiaddr import Multiaddr

from protocol import hivemind_private
from protocol.identity import Identity

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "specswarm.dial_back.v1"
MAX_PROBE_ADDRS = 8
MAX_ADDR_CHARS = 512
MAX_CONCURRENT_PROBES = 2
DIAL_TIMEOUT = 10.0
NOT_A_RELAY = "not a relay: this peer offers no circuit relay (swarm.bootstrap --no-relay)"


class DialBack(msgspec.Struct, array_like=True):
    """Asker -> prober: dial me (the stream's remote peer) at these multiaddrs."""

    maddrs: list[str]


class DialBackResult(msgspec.Struct, array_like=True):
    reachable: bool
    error: str = ""


class NoRelayError(RuntimeError):
    """Nobody can dial this server, directly or through a relay: serving would be useless."""


def _check_maddrs(maddrs: Sequence[str]) -> list[Multiaddr]:
    if not 0 < len(maddrs) <= MAX_PROBE_ADDRS:
        raise ValueError(f"expected 1..{MAX_PROBE_ADDRS} addresses, got {len(maddrs)}")
    parsed = []
    for text in maddrs:
        if len(text) > MAX_ADDR_CHARS:
            raise ValueError(f"address longer than {MAX_ADDR_CHARS} characters")
        maddr = Multiaddr(text)  # raises ValueError on garbage
        if "tcp" not in {protocol.name for protocol in maddr.protocols()}:
            raise ValueError(f"not a TCP address: {text}")
        parsed.append(maddr)
    return parsed


def _without_peer(maddr: Multiaddr, peer_id: PeerID) -> Multiaddr:
    """``.../p2p/<peer_id>`` -> ``...``: libp2p dials addresses without the target's own id."""
    items = list(maddr.items())
    if items and items[-1][0].name == "p2p" and items[-1][1] == peer_id.to_base58():
        return maddr.decapsulate(Multiaddr(f"/p2p/{peer_id.to_base58()}"))
    return maddr


class ProbeService:
    """The prober's side, served by bootstraps and by servers that are dialable themselves.

    ``relays=False`` (``swarm.bootstrap --no-relay``) answers a probe of a circuit through this peer
    with :data:`NOT_A_RELAY` instead of dialing it. p2pd cannot be kept from relaying (hivemind's
    daemon starts a circuit-relay service with libp2p's default limits whenever relaying is on, and
    our limits race it), so a peer that offers no relay says so here: servers behind NAT then never
    announce a circuit through it, and stop with one clear line if it was their only relay.
    """

    def __init__(self, relays: bool = True) -> None:
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_PROBES)
        self.relays = relays
        self.probes = 0
        self._peer_id: Optional[PeerID] = None

    async def add_to(self, p2p: P2P) -> None:
        self._peer_id = p2p.peer_id
        await p2p.add_protobuf_handler(PROBE_PROTOCOL, self._serve, runtime_pb2.ExpertRequest)

    def _through_me(self, maddr: Multiaddr) -> bool:
        items = [(protocol.name, value) for protocol, value in maddr.items()]
        names = [name for name, _ in items]
        if self._peer_id is None or "p2p-circuit" not in names:
            return False
        relay = items[: names.index("p2p-circuit")]  # the relay's address: it ends with the relay's id
        return bool(relay) and relay[-1] == ("p2p", self._peer_id.to_base58())

    async def _serve(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=msgspec.msgpack.encode(await self._answer(request, context)))

    async def _answer(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> DialBackResult:
        try:
            ask = msgspec.msgpack.decode(request.metadata, type=DialBack)
            maddrs = [_without_peer(m, context.remote_id) for m in _check_maddrs(ask.maddrs)]
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            return DialBackResult(False, f"bad dial-back request: {e}")
        if not self.relays and any(self._through_me(m) for m in maddrs):
            return DialBackResult(False, NOT_A_RELAY)
        if self._slots.locked():
            return DialBackResult(False, "busy: too many dial-back probes at once")
        async with self._slots:
            self.probes += 1
            return await dial_fresh(context.remote_id, maddrs)


async def dial_fresh(peer_id: PeerID, maddrs: Sequence[Multiaddr], timeout: float = DIAL_TIMEOUT) -> DialBackResult:
    """Dial ``peer_id`` at ``maddrs`` from a brand-new libp2p daemon (no connection to reuse)."""
    prober = await P2P.create(host_maddrs=[], no_listen=True, dht_mode="client")
    try:
        await asyncio.wait_for(hivemind_private.connect(prober, peer_id, maddrs), timeout)
        return DialBackResult(True)
    except Exception as e:  # a refused, unroutable or timed-out dial: the answer, not a failure
        return DialBackResult(False, f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        await prober.shutdown()


async def _ask(p2p: P2P, prober: PeerID, maddrs: Sequence[str], timeout: float) -> Optional[DialBackResult]:
    """One prober's verdict on ``maddrs``; None when it gave none (unreachable, old, busy, or it
    could not read the request)."""
    request = runtime_pb2.ExpertRequest(metadata=msgspec.msgpack.encode(DialBack([str(m) for m in maddrs])))
    try:
        response = await asyncio.wait_for(
            p2p.call_protobuf_handler(prober, PROBE_PROTOCOL, request, runtime_pb2.ExpertResponse), timeout
        )
        result = msgspec.msgpack.decode(response.metadata, type=DialBackResult)
    except Exception as e:
        logger.debug(f"Dial-back probe via {prober} failed: {e}")
        return None
    if result.error.startswith(("busy", "bad dial-back")):
        logger.debug(f"Dial-back probe via {prober}: {result.error}")
        return None
    return result


async def ask_dial_back(
    p2p: P2P, probers: Sequence[PeerID], maddrs: Sequence[str], timeout: float = 30.0
) -> Optional[bool]:
    """True if any prober reached us at ``maddrs``, False if some answered and none did, None if
    no prober answered (old peers, or none reachable): the caller decides what unknown means."""
    answered = False
    for prober in probers:
        result = await _ask(p2p, prober, maddrs, timeout)
        if result is None:
            continue
        answered = True
        if result.reachable:
            return True
        logger.debug(f"{prober} could not dial us at {list(maddrs)}: {result.error}")
    return False if answered else None


async def _working_circuits(p2p: P2P, probers: Sequence[PeerID], addrs: Sequence[str], deadline: float) -> list[str]:
    """The circuit addresses some prober could dial us through before ``deadline``. A reservation
    takes a moment after connecting, so each is asked again until the deadline; one whose relay
    answers that it offers no relay is dropped at once."""
    loop = asyncio.get_running_loop()
    pending, working = list(addrs), []
    while pending and not working and loop.time() < deadline:
        for addr in list(pending):
            relay = peer_ids_of([addr.partition("/p2p-circuit")[0]])
            for prober in probers:
                result = await _ask(p2p, prober, [addr], DIAL_TIMEOUT + 5)
                if result is not None and result.reachable:
                    working.append(addr)
                    break
                if result is not None and result.error == NOT_A_RELAY and [prober] == relay:
                    logger.info(f"{prober} offers no relay")
                    pending.remove(addr)
                    break
        if pending and not working:
            await asyncio.sleep(1.0)
    return working


def peer_ids_of(maddrs: Sequence[str]) -> list[PeerID]:
    """The peer ids named by full multiaddrs (``.../p2p/<id>``), in order, without repeats."""
    ids: list[PeerID] = []
    for text in maddrs:
        if "/p2p/" in text:
            peer_id = PeerID.from_base58(text.rsplit("/p2p/", 1)[1])
            if peer_id not in ids:
                ids.append(peer_id)
    return ids


def circuit_addrs(relays: Sequence[str], peer_id: PeerID) -> list[str]:
    """Addresses through which ``peer_id`` is reachable via each relay (``<relay>/p2p-circuit/p2p/<id>``)."""
    return [f"{relay}/p2p-circuit/p2p/{peer_id.to_base58()}" for relay in relays if "/p2p/" in relay]


class Joined(msgspec.Struct):
    """A server's DHT after the reachability check, and how peers reach it."""

    dht: object  # hivemind.DHT
    using_relay: bool
    relay_addrs: list[str]


async def start_server_dht(
    *,
    initial_peers: Sequence[str],
    identity: Identity,
    host: str,
    port: int,
    announce_maddrs: Sequence[str] = (),
    reachability: str = "auto",
    relay_timeout: float = 30.0,
) -> Joined:
    """Start a server's DHT so that the swarm can dial it: directly when the dial-back probe (or
    ``reachability="public"``) says so, else through its initial peers acting as relays.

    ``auto`` with no prober answering (a swarm of older peers, or a new swarm without initial
    peers) counts as direct: the server is announced as before and the log says it was not checked.
    Raises :class:`NoRelayError` when the server is not dialable and no relay works.
    """
    from protocol.dht import make_dht

    def start(relays: Sequence[str] = ()):
        # behind NAT: a DHT client (nobody could reach its DHT server) that libp2p calls private
        mode = "private" if relays else ("public" if reachability == "public" else "auto")
        return make_dht(
            initial_peers=initial_peers,
            identity=identity,
            host=host,
            port=port,
            announce_maddrs=announce_maddrs,
            client_mode=bool(relays),
            reachability=mode,
            relays=relays,
        )

    probers = peer_ids_of(initial_peers)
    dht = start()
    if reachability != "private":
        if reachability == "public" or not probers:
            return Joined(dht, False, [])
        p2p = await dht.replicate_p2p()
        direct = await ask_dial_back(p2p, probers, [str(m) for m in await p2p.get_visible_maddrs(latest=True)])
        if direct is None:
            logger.warning("No initial peer answered the dial-back probe: assuming other peers can dial this server")
            return Joined(dht, False, [])
        if direct:
            logger.info("Other peers can dial this server directly")
            return Joined(dht, False, [])
        logger.info("Other peers cannot dial this server directly (behind NAT or a firewall): joining through a relay")
    relays = [m for m in initial_peers if "/p2p/" in m]
    if not relays:
        dht.shutdown()
        raise NoRelayError("this server cannot be dialed and has no initial peers to use as relays")
    dht.shutdown()
    dht = start(relays)
    try:
        p2p = await dht.replicate_p2p()
        deadline = asyncio.get_running_loop().time() + relay_timeout
        working = await _working_circuits(p2p, probers, circuit_addrs(relays, p2p.peer_id), deadline)
        if not working:
            raise NoRelayError(
                "this server cannot be dialed directly and no relay could be reached through its initial peers "
                f"({', '.join(relays)}); not announcing a span nobody could use (docs/nat.md)"
            )
    except BaseException:
        dht.shutdown()
        raise
    logger.info(f"Reachable through {len(working)} relay(s): {', '.join(working)}")
    return Joined(dht, True, working)
