"""Reading the swarm: one DHT client turns the registry and block records into events.

Every method of :class:`SwarmReader` blocks (hivemind's ``DHT`` is a synchronous facade over its
own process), so the dashboard calls them from a worker thread. Nothing here raises to the
caller: a failed read becomes a :class:`PollFailed` event, a server that cannot be dialled a
:class:`PeerProbed` event with the reason, and the page shows both.

The registry (``MODELS_KEY``) can be written by anyone, so a poll reads at most
``MAX_MODELS_PER_POLL`` models and ``MAX_KEYS_PER_POLL`` block keys in all, whatever it lists (a
DHT read of 256 keys takes ~2 s on a loaded machine, 1,024 keys ~12 s). Models whose config the
dashboard was given (``--model``) are read first, with the config's number of blocks, so a
hostile entry can neither resize them nor crowd them out; any other model is read, in name order,
while the key budget lasts, with the registry's number of blocks (at most ``MAX_MODEL_BLOCKS``).
A model that does not fit what is left of the budget is left out of that poll. Each model read
also costs one key more: its clients' spot-check reports (``"{model}.reports"``, bounded by
``fetch_reports``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from functools import partial
from typing import Mapping, Optional, Sequence

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2

from protocol import relay
from protocol.dht_records import fetch_model_registry, fetch_reports, fetch_servers
from protocol.records import MAX_MODEL_BLOCKS, ServerInfo, ServerState
from protocol.streams import ping
from swarm.dashboard.events import Event, ModelSnapshot, PeerProbed, PollFailed, SwarmPolled

logger = logging.getLogger(__name__)

MAX_DISCOVERY_ROUNDS = 8  # block-key reads to find the length of a model whose servers did not say
MAX_MODELS_PER_POLL = 32  # registry entries read per poll (known models first, then by name)
MAX_KEYS_PER_POLL = 512  # block keys read per poll, all models together
MAX_CONCURRENT_PROBES = 32  # pings in flight at once when the dashboard probes every server


class SwarmReader:
    """Polls one swarm through ``dht`` (a client-mode DHT with the swarm's record validators).

    ``known_blocks`` maps DHT model names to their number of blocks from the models' own configs
    (see :func:`protocol.models.model_num_blocks`); registry entries that disagree are ignored.
    """

    def __init__(
        self,
        dht: DHT,
        probe_timeout: float = 5.0,
        known_blocks: Optional[Mapping[str, int]] = None,
        max_concurrent_probes: int = MAX_CONCURRENT_PROBES,
    ):
        if max_concurrent_probes < 1:
            raise ValueError(f"max_concurrent_probes must be 1 or more, got {max_concurrent_probes}")
        self.dht, self.probe_timeout = dht, probe_timeout
        self.max_concurrent_probes = max_concurrent_probes
        self.known_blocks = dict(known_blocks or {})

    def poll(self) -> Event:
        """Every listed model's servers, or why they could not be read."""
        at = time.time()
        try:
            registry = fetch_model_registry(self.dht, self.known_blocks)
            listed = sorted(registry.items(), key=lambda item: (item[0] not in self.known_blocks, item[0]))
            if len(listed) > MAX_MODELS_PER_POLL:
                logger.debug(f"The registry lists {len(listed)} models; reading the first {MAX_MODELS_PER_POLL}")
            budget, snapshots = MAX_KEYS_PER_POLL, []
            for name, num_blocks in listed[:MAX_MODELS_PER_POLL]:
                if (num_blocks or 1) + 1 > budget:
                    logger.debug(f"Skipping model {name} this poll: {num_blocks} blocks, {budget} keys left")
                    continue
                snapshot, used = self._snapshot(name, num_blocks, budget - 1)
                disputes = fetch_reports(self.dht, name)
                snapshots += [replace(part, disputes=disputes) for part in split_by_weights(snapshot)]
                budget -= used + 1
        except Exception as e:
            logger.warning(f"Reading the DHT failed: {e!r}")
            return PollFailed(at, f"could not read the swarm's records from the DHT: {_describe(e)}")
        return SwarmPolled(at, tuple(sorted(snapshots, key=lambda snapshot: snapshot.name)))

    def _snapshot(self, model: str, num_blocks: Optional[int], budget: int) -> tuple[ModelSnapshot, int]:
        """The model's snapshot and the block keys read for it (at most ``budget``)."""
        if num_blocks is not None:  # from the config, or a registry number within MAX_MODEL_BLOCKS
            return ModelSnapshot(model, num_blocks, tuple(fetch_servers(self.dht, model, num_blocks))), num_blocks
        # Older servers do not announce the model's length: follow spans from block 0 until no
        # record reaches further. A gap hides the blocks after it, so num_blocks stays unknown.
        # Spans are checked against MAX_MODEL_BLOCKS only; every round's keys count against the budget.
        known, used, servers = 1, 0, []
        for _ in range(MAX_DISCOVERY_ROUNDS):
            if used + known > budget:
                break
            servers = fetch_servers(self.dht, model, MAX_MODEL_BLOCKS, read_blocks=known)
            used += known
            reach = max((s.end_block for s in servers), default=0)
            if reach <= known:
                break
            known = reach
        return ModelSnapshot(model, None, tuple(servers)), used

    def probe(self, model: str, servers: Sequence[ServerInfo]) -> list[PeerProbed]:
        """Dial every server that claims to be up, as any client would, and time a DHT ping."""
        peers = [s.peer_id for s in servers if s.state != ServerState.OFFLINE]
        if not peers:
            return []
        # a server behind NAT is a DHT client (it answers no DHT ping): dial it through its relays
        # and time specswarm's own Ping instead (docs/nat.md)
        relayed = {s.peer_id: list(s.relay_addrs) for s in servers if s.using_relay and s.relay_addrs}
        at = time.time()
        try:
            results = self.dht.run_coroutine(
                partial(
                    _ping_many,
                    peer_ids=peers,
                    timeout=self.probe_timeout,
                    relayed=relayed,
                    limit=self.max_concurrent_probes,
                )
            )
        except Exception as e:
            return [PeerProbed(at, model, peer, None, f"probe could not run: {_describe(e)}") for peer in peers]
        return [PeerProbed(at, model, peer, *results[peer]) for peer in peers]


async def _ping_many(
    dht: DHT, node: DHTNode, peer_ids: list[str], timeout: float, relayed: dict, limit: int = MAX_CONCURRENT_PROBES
) -> dict:
    """Runs inside the DHT's process: peer id -> (rtt seconds or None, error or None). At most
    ``limit`` pings are in flight: 1,000 servers pinged at once would open 1,000 streams together
    and time the queue, not the servers."""
    gate = asyncio.Semaphore(limit)

    async def one(peer: str) -> tuple[Optional[float], Optional[str]]:
        async with gate:
            if peer in relayed:
                return await _ping_relayed(node, peer, relayed[peer], timeout)
            return await _ping(node, peer, timeout)

    return dict(zip(peer_ids, await asyncio.gather(*(one(p) for p in peer_ids))))


async def _ping_relayed(
    node: DHTNode, peer_id: str, addrs: list[str], timeout: float
) -> tuple[Optional[float], Optional[str]]:
    relay.remember(peer_id, addrs)  # this process's address book (the DHT's fork has its own)
    rtt = await ping(node.protocol.p2p, PeerID.from_base58(peer_id), timeout)
    return (rtt, None) if rtt is not None else (None, f"no answer through its relay within {timeout:g} s")


async def _ping(node: DHTNode, peer_id: str, timeout: float) -> tuple[Optional[float], Optional[str]]:
    request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False)
    began = time.perf_counter()
    try:
        stub = node.protocol.get_stub(PeerID.from_base58(peer_id))
        await asyncio.wait_for(stub.rpc_ping(request, timeout=timeout), timeout)
    except asyncio.TimeoutError:
        return None, f"no answer to a ping within {timeout:g} s"
    except Exception as e:
        return None, f"unreachable: {_describe(e)}"
    return time.perf_counter() - began, None


def _describe(e: BaseException) -> str:
    """One line for the page: the message, or the exception's name when it has none."""
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__


def split_by_weights(snapshot: ModelSnapshot) -> list[ModelSnapshot]:
    """One snapshot per exact model under one DHT name (config fingerprint and weights revision,
    protocol.routing.same_model): clients never route them together, so the dashboard shows them
    apart. The group with the most servers keeps the name; the others are named ``name @revision``."""
    groups: dict[tuple[str, str], list[ServerInfo]] = {}
    for info in snapshot.servers:
        groups.setdefault((info.config_fingerprint, info.revision), []).append(info)
    if len(groups) <= 1:
        return [snapshot]
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    parts = [replace(snapshot, servers=tuple(ordered[0][1]))]
    for (fingerprint, revision), servers in ordered[1:]:
        label = (revision.removeprefix("sha256:")[:12] or "no revision") + (
            "" if fingerprint == ordered[0][0][0] else f", config {fingerprint[:8] or 'unknown'}"
        )
        parts.append(replace(snapshot, name=f"{snapshot.name} @{label}", servers=tuple(servers)))
    return parts
