"""A volunteer server: load a span, join the DHT, announce, serve sessions, leave cleanly.

``server = await SpanServer.create(config)`` returns a server that is already serving and announced; ``await
server.shutdown()`` marks it offline in the DHT, closes its sessions and leaves. The CLI is a thin layer over this.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Awaitable, Callable, Optional

import hivemind
import msgspec
import torch
from transformers import PretrainedConfig

from protocol.compression import CODECS
from protocol.config import InitialPeers, no_initial_peers_message, resolve_initial_peers
from protocol.dht_records import announce
from protocol.identity import load_or_create_identity
from protocol.limits import MAX_POSITIONS_PER_STEP, MIN_POSITIONS_PER_STEP
from protocol.models import ResolvedModel, config_fingerprint, hub_commit, resolve_model, weights_revision
from protocol.records import ServerInfo, ServerState
from server.adapters import SpanAdapter, load_span
from server.address_caps import AddressCaps
from server.cache_budget import CacheBudget
from server.constraints import TailConstraints
from server.drafter_attach import attach_drafter_if_it_fits, drafter_bytes
from server.handler import SessionHandler
from server.joining import claim_span, keep_announcing, leave
from server.lora import AdapterSource, attach_to_span, plan_adapters
from server.memory import MemoryPlan, batch_positions_that_fit, plan_blocks
from server.model_source import adopt_swarm_revision, hub_reachable, load_model_config
from server.moves import SpanMoves
from server.placement import check_requested_blocks, choose_blocks, fetch_same_model, measure_throughput
from server.quantization import QuantChoice, resident_bytes, resolve_quant
from server.reachability import Joined, ProbeService, start_server_dht
from server.server_config import ServerConfig
from server.upkeep import measure_next_pings, upkeep_blocks
from server.weights import Checkpoint

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["ServerConfig", "SpanServer", "resolve_device", "resolve_dtype"]


class SpanServer(SpanMoves):
    """A serving span and its announcements; placement (server/placement.py), moves
    (server/moves.py) and the tail's drafter (server/drafter_attach.py) live in modules of their own."""

    def __init__(
        self, config: ServerConfig, dht: hivemind.DHT, span: SpanAdapter, handler: SessionHandler, info: ServerInfo
    ):
        self.config, self.dht, self.span, self.handler, self.info = config, dht, span, handler, info
        self._announcer: Optional[asyncio.Task] = None
        self.model_config: Optional[PretrainedConfig] = None
        self.checkpoint: Optional[Checkpoint] = None
        self.plan: Optional[MemoryPlan] = None  # what fits in this server's memory (server/memory.py)

    @classmethod
    async def create(cls, config: ServerConfig) -> "SpanServer":
        """A server that is serving and announced ONLINE, in named steps; on failure, whatever a
        step had claimed (the DHT, a JOINING record) is given back."""
        # 1) check the settings; 2) pin the model, plan its memory, join the DHT
        initial_peers, device, dtype = _check_settings(config)
        joined, model = await _load_model(config, initial_peers, device, dtype)
        # 3) claim blocks with a JOINING record (refreshed until the ONLINE one replaces it)
        claim = await _claim_blocks(config, joined, model)
        try:  # 4) load the span, 5) start the handler, 6) describe the server for its ONLINE record
            span = await _load_span(config, model, claim.info)
            handler = await _start_handler(config, joined, model, span, claim)
            info = await _online_info(config, joined, model, span, handler, claim)
        except BaseException:
            claim.refresher.cancel()
            leave(partial(claim.publish, wait=True), claim.info)
            joined.dht.shutdown()
            raise
        claim.refresher.cancel()  # 7) announce ONLINE, and keep announcing
        server = cls(config, joined.dht, span, handler, info)
        server.model_config, server.checkpoint, server.plan = model.config, model.checkpoint, model.plan
        server._announce()
        server._announcer = asyncio.create_task(server._announce_periodically())
        logger.info(
            f"Ready: {span.cache_bytes_per_token()} cache bytes/token, budget {handler.budget.total_tokens} tokens"
        )
        return server

    def current_info(self, state: ServerState = ServerState.ONLINE) -> ServerInfo:
        return msgspec.structs.replace(
            self.info,
            state=state,
            free_cache_tokens=self.handler.budget.free_tokens,
            laps_served=self.handler.stats["runs"],
            accepted_tokens=self.handler.stats["accepted_tokens"],
            cancelled_runs=self.handler.stats["cancelled_runs"],
            open_sessions=len(self.handler.sessions),
            train_forwards=self.handler.training.stats["train_forwards"],
            max_backward_bytes=self.handler.training.announced_backward_budget,
        )

    def _announce(self, state: ServerState = ServerState.ONLINE, expiration: Optional[float] = None) -> None:
        expiration = expiration or 3 * self.config.update_period
        announce(self.dht, self.current_info(state), expiration, wait=False, num_blocks=self.span.num_blocks)

    async def _announce_periodically(self) -> None:
        """Refresh the record (with fresh RTTs to the next servers); now and then, rebalance."""
        loop = asyncio.get_running_loop()
        last_balance = loop.time()
        while True:
            await asyncio.sleep(self.config.update_period)
            try:
                total = self.span.num_blocks
                rebalance = self.config.blocks is None and loop.time() - last_balance > self.config.balance_period
                blocks = None if rebalance else upkeep_blocks(self.info, total)  # every block only to rebalance
                servers = await loop.run_in_executor(None, fetch_same_model, self.dht, self.info, total, blocks)
                self.handler.known_servers = {s.peer_id: s for s in servers}  # upstream servers vs clients
                pings = await measure_next_pings(self.handler.p2p, self.info, servers)
                self.info = msgspec.structs.replace(self.info, next_pings=pings)
                if rebalance:
                    last_balance = loop.time()
                    await self._maybe_move(servers)
            except Exception as e:  # the DHT or a peer misbehaving must not stop the announcements
                logger.warning(f"Upkeep failed: {e!r}")
            self._announce()

    async def shutdown(self) -> None:
        """Leave cleanly: stop taking sessions (DRAINING), let open ones finish for up to
        ``drain_seconds``, close the rest (their clients fail over), say OFFLINE, stop the DHT."""
        if self._announcer is not None:
            self._announcer.cancel()
        # The DHT keeps the value with the latest expiration per subkey, so a new state must
        # outlive the last "online" record (written up to one period ago for 3 periods).
        self._announce_now(ServerState.DRAINING)
        await self.handler.shutdown(grace=self.config.drain_seconds)
        self._announce_now(ServerState.OFFLINE)
        self.dht.shutdown()
        logger.info("Server stopped")

    def _announce_now(self, state: ServerState) -> None:
        try:
            info = self.current_info(state)
            announce(self.dht, info, 3 * self.config.update_period, wait=True, num_blocks=self.span.num_blocks)
        except Exception as e:
            logger.warning(f"Could not announce {state.value}: {e!r}")


# ---- the steps of SpanServer.create ---------------------------------------------------------------


@dataclass
class _Model:
    """The model this server serves, pinned to one revision, and how it runs here."""

    dht_name: str
    config: PretrainedConfig
    checkpoint: Checkpoint
    identity_fields: dict  # config_fingerprint and revision, for every record this server writes
    quant: QuantChoice
    plan: MemoryPlan
    device: str
    dtype: torch.dtype
    adapters: list[AdapterSource]  # --adapters, opened and checked against the model (server/lora.py)


@dataclass
class _Claim:
    """Blocks claimed with a JOINING record: the record, how to publish one, and its refresher."""

    template: ServerInfo  # this server's record, blocks not yet chosen
    info: ServerInfo  # the JOINING record of the claimed blocks
    publish: Callable[..., object]
    refresher: asyncio.Task


def _check_settings(config: ServerConfig) -> tuple[InitialPeers, str, torch.dtype]:
    """Refuse settings that cannot work before anything starts: no peers to join (and no
    --new-swarm), a bad device, dtype, positions per step or codec."""
    initial_peers = resolve_initial_peers(config.initial_peers)
    if not initial_peers.peers and not config.new_swarm:
        raise ValueError(no_initial_peers_message() + "; or pass --new-swarm to start a new swarm")
    if initial_peers.peers:
        logger.info(initial_peers.describe())
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if not MIN_POSITIONS_PER_STEP <= config.max_positions_per_step <= MAX_POSITIONS_PER_STEP:
        raise ValueError(
            f"--max-positions-per-step must be in {MIN_POSITIONS_PER_STEP}..{MAX_POSITIONS_PER_STEP}, "
            f"got {config.max_positions_per_step}"
        )
    if config.compression not in CODECS:
        raise ValueError(f"--compression must be one of {CODECS}, got {config.compression!r}")
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    return initial_peers, device, dtype


async def _load_model(
    config: ServerConfig, initial_peers: InitialPeers, device: str, dtype: torch.dtype
) -> tuple[Joined, _Model]:
    """Pin the model's revision, read its config, plan what fits in memory, and join the DHT.

    The plan comes before any announcement: blocks that do not fit stop here. A hub model may join
    the DHT first, to read the revision the swarm serves (joining announces nothing)."""
    model = resolve_model(config.model)
    dht_name = config.dht_prefix or model.dht_name
    join = partial(_join_dht, config, initial_peers, load_or_create_identity(config.identity_path))
    joined = None
    try:
        joined, pinned = await _pin_revision(config, model, dht_name, initial_peers, join)
        model_config = load_model_config(model.source, pinned)
        checkpoint = Checkpoint(model.source, revision=pinned)  # one: it reads the weight map once
        identity_fields = dict(
            config_fingerprint=config_fingerprint(model_config), revision=weights_revision(model.source, pinned)
        )
        quant = resolve_quant(config.quant, model_config, device, dtype)
        logger.info(quant.describe())
        plan, adapters = _plan_memory(config, model_config, checkpoint, quant, device, dtype)
        if joined is None:
            joined = await join()
    except BaseException:
        if joined is not None:
            joined.dht.shutdown()
        raise
    return joined, _Model(dht_name, model_config, checkpoint, identity_fields, quant, plan, device, dtype, adapters)


def _join_dht(config: ServerConfig, initial_peers: InitialPeers, identity: object) -> Awaitable[Joined]:
    """Join the DHT: can peers dial us? If not, join through a relay (or stop: server/reachability.py)."""
    return start_server_dht(
        initial_peers=initial_peers.peers,
        identity=identity,
        host=config.host,
        port=config.port,
        announce_maddrs=config.announce_maddrs,
        reachability="public" if config.new_swarm and config.reachability == "auto" else config.reachability,
    )


async def _pin_revision(
    config: ServerConfig,
    model: ResolvedModel,
    dht_name: str,
    initial_peers: InitialPeers,
    join: Callable[[], Awaitable[Joined]],
) -> tuple[Optional[Joined], Optional[str]]:
    """(the DHT if joined to read it, the revision). A hub model is pinned to one commit: its config
    and every shard come from it, and it is announced. Without --revision that is the commit the
    swarm already serves (read from the DHT), else the hub's main; a local folder has none."""
    hub = not os.path.isdir(model.source)
    if hub and config.revision is None and initial_peers.peers and hub_reachable():
        joined = await join()
        try:
            pinned = await asyncio.get_running_loop().run_in_executor(
                None, adopt_swarm_revision, joined.dht, dht_name, model.source
            )
        except BaseException:
            joined.dht.shutdown()
            raise
        return joined, pinned
    if hub and config.revision is not None:
        logger.info(f"Revision of {model.source}: {config.revision} (--revision)")
        return None, config.revision
    return None, hub_commit(model.source) if hub and hub_reachable() else None


def _plan_memory(
    config: ServerConfig,
    model_config: PretrainedConfig,
    checkpoint: Checkpoint,
    quant: QuantChoice,
    device: str,
    dtype: torch.dtype,
) -> tuple[MemoryPlan, list[AdapterSource]]:
    """What fits in this machine's memory (server/memory.py), --adapters counted; fails if the asked blocks do not."""
    adapters, adapter_bytes = plan_adapters(config.adapters, config.model, model_config.num_hidden_layers, dtype)
    plan = plan_blocks(
        model_config,
        dtype,
        device,
        model_config.num_hidden_layers,
        free_bytes=config.assume_free_memory,
        quant=quant.quant,
        drafter_bytes=drafter_bytes(config, model_config, checkpoint, dtype, quant.quant),
        cache_tokens=config.cache_tokens,
        batch_positions=config.max_batch_positions,
        adapter_bytes=adapter_bytes,
        training=config.train_plan(),
    )
    logger.info(plan.describe(device))
    check_requested_blocks(config, plan, device)
    return plan, adapters


async def _claim_blocks(config: ServerConfig, joined: Joined, model: _Model) -> _Claim:
    """Choose blocks and claim them before loading them: a JOINING record that placement counts and
    routing ignores (server/joining.py), refreshed until the ONLINE one replaces it."""
    dht, total = joined.dht, model.config.num_hidden_layers
    probes = ProbeService()  # lets peers that use this one as an initial peer check themselves
    if not joined.using_relay:
        await probes.add_to(await dht.replicate_p2p())
    template = ServerInfo(
        peer_id=dht.peer_id.to_base58(),
        model=model.dht_name,
        start_block=0,
        end_block=1,
        version=_package_version(),
        public_name=config.public_name,
        dtype=str(model.dtype).removeprefix("torch."),
        quantization=model.quant.quant.value,
        using_relay=joined.using_relay,
        relay_addrs=joined.relay_addrs,
        **model.identity_fields,
    )
    loop = asyncio.get_running_loop()

    def publish(info: ServerInfo, wait: bool = False):
        return announce(dht, info, 3 * config.update_period, wait=wait, num_blocks=total)

    claimed = await claim_span(
        template,
        lambda servers: choose_blocks(config, servers, total, model.plan),
        fetch=lambda: loop.run_in_executor(None, fetch_same_model, dht, template, total),
        publish=lambda info: loop.run_in_executor(None, partial(publish, info, wait=True)),
        automatic=config.blocks is None,
        jitter=config.join_jitter,
        settle=config.join_settle,
    )
    where = f"{claimed.start_block}:{claimed.end_block} of {model.dht_name}"
    logger.info(f"Serving blocks {where} as peer {dht.peer_id} (announced as joining)")
    return _Claim(template, claimed, publish, keep_announcing(publish, claimed, config.update_period))


async def _load_span(config: ServerConfig, model: _Model, claimed: ServerInfo) -> SpanAdapter:
    """Load the claimed blocks' weights (and the tail's drafter, if it fits)."""
    loop, start, end = asyncio.get_running_loop(), claimed.start_block, claimed.end_block
    span = await loop.run_in_executor(
        None, load_span, model.config, model.checkpoint, start, end, model.dtype, model.device, model.quant.quant
    )
    await loop.run_in_executor(None, attach_to_span, span, model.adapters)
    await loop.run_in_executor(
        None, attach_drafter_if_it_fits, span, config, model.config, model.checkpoint, model.plan
    )
    if span.is_tail:  # the tokenizer loads on the first constrained session
        span.constraints = TailConstraints.of(model.checkpoint, span.vocab_size, config.compile_budget())
    weights_mib = resident_bytes(span.layers) / 2**20
    logger.info(f"Blocks {start}:{end} hold {weights_mib:.1f} MiB of weights ({model.quant.quant.value})")
    return span


async def _start_handler(
    config: ServerConfig, joined: Joined, model: _Model, span: SpanAdapter, claim: _Claim
) -> SessionHandler:
    """Serve sessions over the span, under the cache budget the plan leaves for its blocks."""
    loop, total = asyncio.get_running_loop(), model.config.num_hidden_layers
    budget = CacheBudget(model.plan.cache_budget_tokens(claim.info.end_block - claim.info.start_block))
    handler = SessionHandler(
        await joined.dht.replicate_p2p(),
        span,
        budget,
        session_timeout=config.session_timeout,
        compression=config.compression,
        max_positions_per_step=config.max_positions_per_step,
        max_sessions=config.max_sessions,
        max_sessions_per_peer=config.max_sessions_per_peer,
        max_batch_positions=config.max_batch_positions
        or batch_positions_that_fit(model.config, model.dtype, model.plan.free_bytes),
        gather_window=config.gather_window,
        max_session_tokens=config.max_session_tokens,
        max_unread_bytes=config.max_unread_mib << 20,
        **config.train_limits(),
        address_caps=AddressCaps(config.max_share_per_address, config.cap_loopback),
    )
    handler.batches.enabled = config.batching
    servers = await loop.run_in_executor(None, fetch_same_model, joined.dht, claim.template, total)
    handler.known_servers = {s.peer_id: s for s in servers}
    await handler.start()
    return handler


async def _online_info(
    config: ServerConfig, joined: Joined, model: _Model, span: SpanAdapter, handler: SessionHandler, claim: _Claim
) -> ServerInfo:
    """The ONLINE record: the claimed blocks, the measured throughput, the cache and the limits."""
    budget = handler.budget
    return ServerInfo(
        peer_id=joined.dht.peer_id.to_base58(),
        model=model.dht_name,
        start_block=claim.info.start_block,
        end_block=claim.info.end_block,
        state=ServerState.ONLINE,
        throughput=await asyncio.get_running_loop().run_in_executor(None, measure_throughput, span),
        cache_tokens=budget.total_tokens,
        free_cache_tokens=budget.free_tokens,
        version=_package_version(),
        public_name=config.public_name,
        dtype=str(model.dtype).removeprefix("torch."),
        quantization=model.quant.quant.value,
        started_at=time.time(),
        using_relay=joined.using_relay,
        relay_addrs=joined.relay_addrs,
        max_positions_per_step=config.max_positions_per_step,
        **model.identity_fields,
        max_session_tokens=handler.max_session_tokens,
        adapters=list(span.lora.names) if span.lora is not None else [],
    )


def resolve_device(requested: str) -> str:
    """``--device``: auto is cuda when torch sees a GPU, else cpu; an explicit cuda without one fails."""
    if requested == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        logger.info(f"Device: {device} (auto: {'a CUDA GPU is' if device == 'cuda' else 'no CUDA GPU is'} available)")
        return device
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {requested}: CUDA is not available on this machine (torch.cuda.is_available() is False)"
        )
    try:
        torch.device(requested)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {requested!r}") from None
    return requested


def resolve_dtype(requested: str, device: str) -> torch.dtype:
    """``--dtype``: auto is bfloat16 on CUDA (what GPUs compute fast, and half of float32's memory)
    and float32 on the CPU (exact against a float32 reference, and fast there)."""
    if requested == "auto":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        logger.info(f"Dtype: {str(dtype).removeprefix('torch.')} (auto on {device})")
        return dtype
    if requested not in DTYPES:
        raise ValueError(f"--dtype must be one of {['auto', *DTYPES]}, got {requested!r}")
    return DTYPES[requested]


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("specswarm")
    except Exception:
        return "0+unknown"
