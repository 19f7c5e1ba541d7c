"""A volunteer server: load a span, join the DHT, announce, serve sessions, leave cleanly.

``server = await SpanServer.create(config)`` returns a server that is already serving and
announced; ``await server.shutdown()`` marks it offline in the DHT, closes its sessions and
leaves. The CLI (``python -m swarm.server``) is a thin layer over this.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from typing import Optional

import msgspec

import hivemind
import torch
from transformers import PretrainedConfig

from protocol.compression import CODECS
from protocol.config import no_initial_peers_message, resolve_initial_peers
from protocol.dht_records import announce
from protocol.identity import load_or_create_identity
from protocol.limits import MAX_POSITIONS_PER_STEP, MIN_POSITIONS_PER_STEP
from protocol.models import config_fingerprint, hub_commit, resolve_model, weights_revision
from protocol.records import ServerInfo, ServerState
from server.adapters import SpanAdapter, load_span
from server.cache_budget import CacheBudget
from server.drafter_attach import attach_drafter_if_it_fits, drafter_bytes
from server.handler import SessionHandler
from server.joining import claim_span, keep_announcing, leave
from server.memory import MemoryPlan, batch_positions_that_fit, plan_blocks
from server.model_source import adopt_swarm_revision, hub_reachable, load_model_config
from server.moves import SpanMoves
from server.placement import check_requested_blocks, choose_blocks, fetch_same_model, measure_throughput
from server.quantization import resident_bytes, resolve_quant
from server.reachability import ProbeService, start_server_dht
from server.server_config import ServerConfig
from server.upkeep import measure_next_pings, upkeep_blocks
from server.weights import Checkpoint

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["ServerConfig", "SpanServer", "resolve_device", "resolve_dtype"]


class SpanServer(SpanMoves):
    """A serving span and its announcements; placement (server/placement.py), moves
    (server/moves.py) and the tail's drafter (server/drafter_attach.py) live in modules of their own."""

    def __init__(self, config: ServerConfig, dht: hivemind.DHT, span: SpanAdapter, handler: SessionHandler, info: ServerInfo):
        self.config, self.dht, self.span, self.handler, self.info = config, dht, span, handler, info
        self._announcer: Optional[asyncio.Task] = None
        self.model_config: Optional[PretrainedConfig] = None
        self.checkpoint: Optional[Checkpoint] = None
        self.plan: Optional[MemoryPlan] = None  # what fits in this server's memory (server/memory.py)

    @classmethod
    async def create(cls, config: ServerConfig) -> "SpanServer":
        initial_peers = resolve_initial_peers(config.initial_peers)
        if not initial_peers.peers and not config.new_swarm:
            raise ValueError(no_initial_peers_message() + "; or pass --new-swarm to start a new swarm")
        if initial_peers.peers:
            logger.info(initial_peers.describe())
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if not MIN_POSITIONS_PER_STEP <= config.max_positions_per_step <= MAX_POSITIONS_PER_STEP:
            raise ValueError(f"--max-positions-per-step must be in {MIN_POSITIONS_PER_STEP}..{MAX_POSITIONS_PER_STEP}, "
                             f"got {config.max_positions_per_step}")  # fmt: skip
        if config.compression not in CODECS:
            raise ValueError(f"--compression must be one of {CODECS}, got {config.compression!r}")
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        model = resolve_model(config.model)
        dht_name = config.dht_prefix or model.dht_name
        identity = load_or_create_identity(config.identity_path)

        def join_dht():  # can peers dial us? If not, join through a relay (or stop: server/reachability.py)
            return start_server_dht(
                initial_peers=initial_peers.peers, identity=identity, host=config.host, port=config.port,
                announce_maddrs=config.announce_maddrs,
                reachability="public" if config.new_swarm and config.reachability == "auto" else config.reachability,
            )  # fmt: skip

        # A hub model is pinned to one commit: its config and every shard come from it, and it is
        # announced. Without --revision that is the commit the swarm already serves (read from the
        # DHT, so a hub model joins the DHT first: joining announces nothing), else the hub's main.
        joined = None
        hub = not os.path.isdir(model.source)
        try:
            if hub and config.revision is None and initial_peers.peers and hub_reachable():
                joined = await join_dht()
                pinned = await asyncio.get_running_loop().run_in_executor(
                    None, adopt_swarm_revision, joined.dht, dht_name, model.source
                )
            elif hub and config.revision is not None:
                pinned = config.revision
                logger.info(f"Revision of {model.source}: {pinned} (--revision)")
            else:
                pinned = hub_commit(model.source) if hub and hub_reachable() else None
            model_config = load_model_config(model.source, pinned)
            checkpoint = Checkpoint(model.source, revision=pinned)  # one: it reads the weight map once
            identity_fields = dict(config_fingerprint=config_fingerprint(model_config),
                                   revision=weights_revision(model.source, pinned))  # fmt: skip
            quant = resolve_quant(config.quant, model_config, device, dtype)
            logger.info(quant.describe())
            # the plan comes before any announcement: blocks that do not fit stop here
            plan = plan_blocks(
                model_config, dtype, device, model_config.num_hidden_layers, free_bytes=config.assume_free_memory,
                quant=quant.quant, drafter_bytes=drafter_bytes(config, model_config, checkpoint, dtype, quant.quant),
                cache_tokens=config.cache_tokens, batch_positions=config.max_batch_positions,
            )  # fmt: skip
            logger.info(plan.describe(device))
            check_requested_blocks(config, plan, device)
            if joined is None:
                joined = await join_dht()
        except BaseException:
            if joined is not None:
                joined.dht.shutdown()
            raise
        dht = joined.dht
        probes = ProbeService()  # lets peers that use this one as an initial peer check themselves
        if not joined.using_relay:
            await probes.add_to(await dht.replicate_p2p())
        # Claim the span before loading it: a JOINING record that placement counts and routing
        # ignores (server/joining.py), refreshed until the ONLINE one replaces it.
        total = model_config.num_hidden_layers
        template = ServerInfo(
            peer_id=dht.peer_id.to_base58(), model=dht_name, start_block=0, end_block=1, version=_package_version(),
            public_name=config.public_name, dtype=str(dtype).removeprefix("torch."), quantization=quant.quant.value,
            using_relay=joined.using_relay, relay_addrs=joined.relay_addrs, **identity_fields,
        )  # fmt: skip
        loop = asyncio.get_running_loop()

        def publish(info: ServerInfo, wait: bool = False):
            return announce(dht, info, 3 * config.update_period, wait=wait, num_blocks=total)

        claimed = await claim_span(
            template, lambda servers: choose_blocks(config, servers, total, plan),
            fetch=lambda: loop.run_in_executor(None, fetch_same_model, dht, template, total),
            publish=lambda info: loop.run_in_executor(None, partial(publish, info, wait=True)),
            automatic=config.blocks is None,
        )  # fmt: skip
        start, end = claimed.start_block, claimed.end_block
        logger.info(f"Serving blocks {start}:{end} of {dht_name} as peer {dht.peer_id} (announced as joining)")
        refresher = keep_announcing(publish, claimed, config.update_period)
        try:
            span = await loop.run_in_executor(
                None, load_span, model_config, checkpoint, start, end, dtype, device, quant.quant
            )
            await loop.run_in_executor(None, attach_drafter_if_it_fits, span, config, model_config, checkpoint, plan)
            logger.info(f"Blocks {start}:{end} hold {resident_bytes(span.layers) / 2**20:.1f} MiB of weights ({quant.quant.value})")
            budget = CacheBudget(plan.cache_budget_tokens(end - start))
            p2p = await dht.replicate_p2p()
            handler = SessionHandler(
                p2p,
                span,
                budget,
                session_timeout=config.session_timeout,
                compression=config.compression,
                max_positions_per_step=config.max_positions_per_step,
                max_sessions=config.max_sessions,
                max_sessions_per_peer=config.max_sessions_per_peer,
                max_batch_positions=config.max_batch_positions
                or batch_positions_that_fit(model_config, dtype, plan.free_bytes),
                gather_window=config.gather_window,
                max_session_tokens=config.max_session_tokens,
                max_unread_bytes=config.max_unread_mib << 20,
            )
            handler.batches.enabled = config.batching
            handler.known_servers = {s.peer_id: s for s in await loop.run_in_executor(None, fetch_same_model, dht, template, total)}
            await handler.start()
            info = ServerInfo(
                peer_id=dht.peer_id.to_base58(),
                model=dht_name,
                start_block=start,
                end_block=end,
                state=ServerState.ONLINE,
                throughput=await loop.run_in_executor(None, measure_throughput, span),
                cache_tokens=budget.total_tokens,
                free_cache_tokens=budget.free_tokens,
                version=_package_version(),
                public_name=config.public_name,
                dtype=str(dtype).removeprefix("torch."),
                quantization=quant.quant.value,
                started_at=time.time(),
                using_relay=joined.using_relay,
                relay_addrs=joined.relay_addrs,
                max_positions_per_step=config.max_positions_per_step,
                **identity_fields,
                max_session_tokens=handler.max_session_tokens,
            )
        except BaseException:
            refresher.cancel()
            leave(partial(publish, wait=True), claimed)
            dht.shutdown()
            raise
        refresher.cancel()
        server = cls(config, dht, span, handler, info)
        server.model_config, server.checkpoint, server.plan = model_config, checkpoint, plan
        server._announce()
        server._announcer = asyncio.create_task(server._announce_periodically())
        logger.info(f"Ready: {span.cache_bytes_per_token()} cache bytes/token, budget {budget.total_tokens} tokens")
        return server

    def current_info(self, state: ServerState = ServerState.ONLINE) -> ServerInfo:
        stats = self.handler.stats
        return msgspec.structs.replace(
            self.info, state=state, free_cache_tokens=self.handler.budget.free_tokens, laps_served=stats["runs"],
            accepted_tokens=stats["accepted_tokens"], cancelled_runs=stats["cancelled_runs"],
            open_sessions=len(self.handler.sessions),
        )  # fmt: skip

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


def resolve_device(requested: str) -> str:
    """``--device``: auto is cuda when torch sees a GPU, else cpu; an explicit cuda without one fails."""
    if requested == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        logger.info(f"Device: {device} (auto: {'a CUDA GPU is' if device == 'cuda' else 'no CUDA GPU is'} available)")
        return device
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: CUDA is not available on this machine (torch.cuda.is_available() is False)")
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
