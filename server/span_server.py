"""A volunteer server: load a span, join the DHT, announce, serve sessions, leave cleanly.

``server = await SpanServer.create(config)`` returns a server that is already serving and
announced; ``await server.shutdown()`` marks it offline in the DHT, closes its sessions and
leaves. The CLI (``python -m swarm.server``) is a thin layer over this.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import msgspec

import hivemind
import torch
from transformers import AutoConfig, PretrainedConfig

from protocol.compression import CODECS
from protocol.limits import (
    DEFAULT_MAX_POSITIONS_PER_STEP, DEFAULT_MAX_SESSIONS, DEFAULT_MAX_SESSIONS_PER_PEER, MAX_POSITIONS_PER_STEP,
    MIN_POSITIONS_PER_STEP, DEFAULT_MAX_UNREAD_MIB,
)  # fmt: skip
from server.adapters import SpanAdapter, load_span
from server.cache_budget import CacheBudget
from server.handler import SessionHandler
from server.joining import claim_span, joining_throughput, keep_announcing, leave
from server.tail_drafter import DEFAULT_TAIL_DRAFTS
from server.batching import DEFAULT_GATHER_WINDOW
from server.memory import MemoryPlan, batch_positions_that_fit, plan_blocks
from server.quantization import Quant, resident_bytes, resolve_quant
from server.upkeep import measure_next_pings
from server.weights import Checkpoint
from protocol.config import no_initial_peers_message, resolve_initial_peers
from protocol.dht_records import announce, fetch_servers
from protocol.identity import load_or_create_identity
from protocol.models import config_fingerprint, hub_commit, resolve_model, weights_revision
from server.reachability import ProbeService, start_server_dht
from protocol.records import ServerInfo, ServerState

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ServerConfig:
    model: str
    initial_peers: Sequence[str] = ()
    new_swarm: bool = False
    blocks: Optional[tuple[int, int]] = None
    num_blocks: Optional[int] = None
    host: str = "0.0.0.0"
    port: int = 0
    announce_maddrs: Sequence[str] = ()
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    quant: str = "auto"  # none|int8|nf4; auto: server.quantization.default_quant
    public_name: Optional[str] = None
    cache_tokens: Optional[int] = None
    identity_path: Optional[str] = None
    update_period: float = 15.0  # seconds between DHT refreshes; records live 3x as long
    session_timeout: float = 600.0
    compression: str = "none"
    torch_threads: Optional[int] = None
    dht_prefix: Optional[str] = None
    drain_seconds: float = 30.0  # on shutdown or a move, open sessions get this long to finish
    balance_period: float = 120.0  # seconds between checks whether another span helps the swarm more
    assume_free_memory: Optional[int] = None  # bytes that stand in for the device's free memory in the plan
    max_positions_per_step: int = DEFAULT_MAX_POSITIONS_PER_STEP  # a Step's positions; frames sized by it
    max_sessions: int = DEFAULT_MAX_SESSIONS  # open sessions at most
    max_sessions_per_peer: int = DEFAULT_MAX_SESSIONS_PER_PEER  # open sessions per upstream peer at most
    max_session_tokens: Optional[int] = None  # one session's max_length at most; None: a fair share of the budget
    max_unread_mib: int = DEFAULT_MAX_UNREAD_MIB  # results held for clients that have not read them (server/unread.py)
    reachability: str = "auto"  # auto: ask initial peers to dial back; public; private (always through a relay)
    drafter: str = "auto"  # the tail's drafter: auto (the committed head for this model, if any), none, or a file
    drafter_tokens: int = DEFAULT_TAIL_DRAFTS  # ids the tail drafts per run at most
    max_batch_positions: Optional[int] = None  # positions of one batched pass; None: what the memory plan's headroom holds
    gather_window: float = DEFAULT_GATHER_WINDOW  # seconds a ready batch waits for more runs
    batching: bool = True  # False: one run per pass through the span (for comparisons)


class SpanServer:
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
        # a hub model is pinned to one commit: its config and every shard come from it, and it is announced
        pinned = None if os.path.isdir(model.source) or not _hub_reachable() else hub_commit(model.source)
        model_config = load_model_config(model.source, pinned)
        checkpoint = Checkpoint(model.source, revision=pinned)  # one: it reads the weight map once
        identity_fields = dict(config_fingerprint=config_fingerprint(model_config),
                               revision=weights_revision(model.source, pinned))  # fmt: skip
        quant = resolve_quant(config.quant, model_config, device, dtype)
        logger.info(quant.describe())
        # the plan comes before the DHT: blocks that do not fit stop here, before anything is announced
        plan = plan_blocks(
            model_config, dtype, device, model_config.num_hidden_layers, free_bytes=config.assume_free_memory,
            quant=quant.quant, drafter_bytes=drafter_bytes(config, model_config, checkpoint, dtype, quant.quant),
            cache_tokens=config.cache_tokens, batch_positions=config.max_batch_positions,
        )  # fmt: skip
        logger.info(plan.describe(device))
        check_requested_blocks(config, plan, device)
        dht_name = config.dht_prefix or model.dht_name
        identity = load_or_create_identity(config.identity_path)
        # Can peers dial us? If not, join through a relay (or stop: server/reachability.py)
        joined = await start_server_dht(
            initial_peers=initial_peers.peers, identity=identity, host=config.host, port=config.port,
            announce_maddrs=config.announce_maddrs,
            reachability="public" if config.new_swarm and config.reachability == "auto" else config.reachability,
        )  # fmt: skip
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
            template, lambda servers: _choose_blocks(config, servers, total, plan),
            fetch=lambda: loop.run_in_executor(None, _fetch_same_model, dht, template, total),
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
            handler.known_servers = {s.peer_id: s for s in await loop.run_in_executor(None, _fetch_same_model, dht, template, total)}
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
                servers = await loop.run_in_executor(None, _fetch_same_model, self.dht, self.info, self.span.num_blocks)
                self.handler.known_servers = {s.peer_id: s for s in servers}  # upstream servers vs clients
                pings = await measure_next_pings(self.handler.p2p, self.info, servers)
                self.info = msgspec.structs.replace(self.info, next_pings=pings)
                if self.config.blocks is None and loop.time() - last_balance > self.config.balance_period:
                    last_balance = loop.time()
                    await self._maybe_move(servers)
            except Exception as e:  # the DHT or a peer misbehaving must not stop the announcements
                logger.warning(f"Upkeep failed: {e!r}")
            self._announce()

    async def _maybe_move(self, servers: Sequence[ServerInfo]) -> None:
        """Move to the span that raises the swarm's max-flow the most, if the gain is large and
        the span fits this server's memory (a span at an end also holds the embeddings or the LM head)."""
        from protocol.routing import should_move

        total, me = self.span.num_blocks, self.current_info()
        target = should_move(servers, me, total)
        if target is not None and self.plan is not None and not self.plan.fits(*target, drafter=False):
            lo = 1 if target[0] == 0 else 0
            hi = total - 1 if target[1] == total else total
            target = should_move(servers, me, total, within=(lo, hi)) if me.end_block - me.start_block <= hi - lo else None
        if target is not None:
            await self.move_to(*target)

    async def move_to(self, start: int, end: int) -> bool:
        """Serve blocks [start, end) instead of the current span; True if the server moved.

        Nothing here may leave the server broken: the new span is announced only once it serves;
        it loads beside the old one when both fit the memory plan (the old keeps serving meanwhile),
        else the old one drains and is freed first; a target that does not fit at all is refused;
        on any failure the old span is kept (or loaded again), announced online and accepting."""
        old_info = self.info  # not the old span itself: freeing it must drop the last reference
        where = f"blocks {old_info.start_block}:{old_info.end_block} to {start}:{end}"
        if self.plan is not None and not self.plan.fits(start, end, drafter=False):
            logger.warning(f"Not moving from {where}: " + self.plan.shortfall(start, end, str(self.span.device)))
            return False
        beside = self.plan is None or self.plan.fits_beside((old_info.start_block, old_info.end_block), (start, end))
        logger.info(f"Moving from {where} ({'loading beside the old span' if beside else 'draining and freeing the old span first'})")
        if not beside:
            await self._drain_and_free(ServerState.DRAINING)
        try:
            span = await self._load_span(start, end, ServerState.JOINING if not beside else None)
        except Exception as e:
            logger.error(f"Could not load blocks {start}:{end} ({e!r}); keeping blocks {old_info.start_block}:{old_info.end_block}")
            span = self.span
            if not beside:  # the old span was freed: load it again, announced as joining meanwhile
                try:
                    span = await self._load_span(old_info.start_block, old_info.end_block, ServerState.JOINING)
                except Exception as again:
                    logger.error(f"Could not load blocks {old_info.start_block}:{old_info.end_block} again ({again!r}): "
                                 "this server serves nothing now; restart it")  # fmt: skip
                    self._announce(ServerState.OFFLINE)
                    return False
            self._serve(span, old_info)
            return False
        if beside:  # the old span's sessions finish (or move) before its blocks go
            self._announce(ServerState.DRAINING)
            await self.handler.drain(self.config.drain_seconds)
        self._serve(span, msgspec.structs.replace(old_info, start_block=start, end_block=end, next_pings={}))
        logger.info(f"Serving blocks {start}:{end} (moved)")
        return True

    async def _drain_and_free(self, state: ServerState) -> None:
        """Stop taking sessions, let open ones finish, and free the span's memory."""
        self._announce(state)
        await self.handler.drain(self.config.drain_seconds)
        self.span = self.handler.span = self.handler.batches.span = _FreedSpan(self.span)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    async def _load_span(self, start: int, end: int, claim: Optional[ServerState]) -> SpanAdapter:
        """Load blocks [start, end) with their drafter where it fits; with ``claim`` (JOINING) the
        span is announced as claimed while it loads (placement counts it, routing does not)."""
        loop = asyncio.get_running_loop()
        refresher = None
        if claim is not None:
            joining = msgspec.structs.replace(self.current_info(claim), start_block=start, end_block=end, next_pings={})
            self._publish(joining)
            refresher = keep_announcing(self._publish, joining, self.config.update_period)
        try:
            span = await loop.run_in_executor(
                None, load_span, self.model_config, self.checkpoint, start, end, self.span.dtype,
                str(self.span.device), Quant(self.info.quantization),
            )  # fmt: skip
            await loop.run_in_executor(
                None, attach_drafter_if_it_fits, span, self.config, self.model_config, self.checkpoint, self.plan
            )  # fmt: skip
            return span
        finally:
            if refresher is not None:
                refresher.cancel()

    def _serve(self, span: SpanAdapter, info: ServerInfo) -> None:
        """Serve ``span`` and say so: the record goes out only once the span takes sessions."""
        self.span = self.handler.span = self.handler.batches.span = span
        self.info = info
        self.handler.accepting = True
        self._announce()

    def _publish(self, info: ServerInfo) -> None:
        announce(self.dht, info, 3 * self.config.update_period, wait=False, num_blocks=self.span.num_blocks)

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


def attach_drafter(span: SpanAdapter, config: ServerConfig, model_config: PretrainedConfig, checkpoint: Checkpoint) -> None:
    """``--drafter``: give a tail span its tail drafter (server/tail_drafter.py). ``auto`` picks the
    head committed for this model (matched by config fingerprint) and drafts nothing without one;
    ``none`` never drafts; a path loads that head file, and a file that does not fit is an error.
    A DeepSeek-V4 tail drafts with its checkpoint's own MTP module instead (server/adapters/deepseek_v4_mtp.py)."""
    from server.tail_drafter import build_tail_drafter

    span.drafter = None
    if config.drafter == "none" or not span.is_tail:
        return
    if model_config.model_type == "deepseek_v4":
        from server.adapters.deepseek_v4_mtp import build_mtp_drafter

        span.drafter = build_mtp_drafter(span, model_config, checkpoint, config.drafter, max_drafts=config.drafter_tokens)
        return
    path = _drafter_file(config, model_config)
    if path is None:
        logger.info("Tail drafter: none (no committed head for this model)")
        return
    span.drafter = build_tail_drafter(span, model_config, checkpoint, path, max_drafts=config.drafter_tokens)
    logger.info(f"Tail drafter: {path} (up to {config.drafter_tokens} ids per run)")


def _drafter_file(config: ServerConfig, model_config: PretrainedConfig) -> Optional[str]:
    """The head file ``--drafter`` names for a Llama-family tail (auto: the committed one, if any)."""
    from server.adapters import adapter_class
    from server.adapters.llama import LlamaFamilyAdapter
    from server.tail_drafter import committed_drafter

    llama = issubclass(adapter_class(model_config), LlamaFamilyAdapter)
    if config.drafter == "auto":
        path = committed_drafter(model_config) if llama else None
        return None if path is None else str(path)
    if not llama:
        raise ValueError(f"--drafter {config.drafter}: tail drafters exist only for Llama-family models so far")
    return config.drafter


def attach_drafter_if_it_fits(
    span: SpanAdapter, config: ServerConfig, model_config: PretrainedConfig, checkpoint: Checkpoint,
    plan: Optional[MemoryPlan],
) -> None:
    """:func:`attach_drafter`, unless the memory plan leaves a tail of this length no room for the
    drafter: then the span serves without one (coverage first, drafting is only speed)."""
    if span.is_tail and plan is not None and config.drafter != "none" and not plan.fits(span.start, span.end):
        span.drafter = None
        logger.info(f"Tail drafter: none (blocks {span.start}:{span.end} leave no memory for it, by the memory plan)")
        return
    attach_drafter(span, config, model_config, checkpoint)


class _FreedSpan:
    """Stands for a span whose weights were freed during a move: keeps the facts the server reads
    (device, dtype, block count) and nothing else."""

    def __init__(self, span: SpanAdapter):
        self.device, self.dtype, self.num_blocks = span.device, span.dtype, span.num_blocks
        self.start, self.end, self.drafter = span.start, span.end, None


def drafter_bytes(
    config: ServerConfig, model_config: PretrainedConfig, checkpoint: Optional[Checkpoint], dtype: torch.dtype,
    quant: Quant,
) -> int:
    """Memory the drafter of ``attach_drafter`` takes on a tail beyond its blocks (0: none), so that
    the memory plan can keep room for it (MemoryPlan.tail_blocks). A file that cannot be read counts
    0 here: loading it later says what is wrong. Without a ``checkpoint`` (``--plan-only`` before
    any weights are reachable) the config alone decides."""
    if config.drafter == "none":
        return 0
    if model_config.model_type == "deepseek_v4":
        from server.adapters.deepseek_v4_mtp import mtp_bytes

        return mtp_bytes(model_config, checkpoint, dtype, quant) if config.drafter == "auto" else 0
    from safetensors import SafetensorError

    from server.tail_drafter import drafter_file_bytes

    path = _drafter_file(config, model_config)
    if path is None:
        return 0
    try:
        tied = (bool(getattr(model_config, "tie_word_embeddings", False)) if checkpoint is None
                else "lm_head.weight" not in checkpoint.weight_map())  # fmt: skip
        return drafter_file_bytes(path, model_config, dtype, tied=tied)
    except (OSError, SafetensorError):  # missing or no safetensors file: attach_drafter names it
        return 0


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


def _fetch_same_model(dht: hivemind.DHT, mine: ServerInfo, total: int) -> list[ServerInfo]:
    """The records placement counts: servers of this exact model (config and weights revision);
    another revision under the same name covers no block for us."""
    servers = fetch_servers(dht, mine.model, total)
    return [s for s in servers if (s.config_fingerprint, s.revision) == (mine.config_fingerprint, mine.revision)]


def load_model_config(source: str, revision: Optional[str] = None) -> PretrainedConfig:
    """The model's config, or a ValueError naming the repo (or folder) that could not be read.

    Without network the hub client retries for half a minute before giving up; when the hub's host
    does not even resolve (or HF_HUB_OFFLINE is set) only the local cache is tried, so the server
    fails at once with a clear message instead of a stack trace.
    """
    local_only = not os.path.isdir(source) and not _hub_reachable()
    try:
        return AutoConfig.from_pretrained(source, local_files_only=local_only, revision=revision)
    except Exception as e:  # OSError, huggingface_hub and httpx errors, unknown model types
        if local_only:
            reason = (
                "the Hugging Face hub is unreachable (no network, or HF_HUB_OFFLINE is set) "
                "and it is not in the local cache"
            )
        else:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load the config of {source!r}: {reason}") from None


def _hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the hub's host name resolves (a DNS lookup only: no connection is made)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=timeout)
        return True
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)


def check_requested_blocks(config: ServerConfig, plan: MemoryPlan, device: str) -> None:
    """Stop with one line before announcing anything when the blocks asked for (or, without
    ``--blocks``/``--num-blocks``, even one block) do not fit the memory plan."""
    total = plan.total_blocks
    if config.blocks is not None:
        start, end = config.blocks
        if not 0 <= start < end <= total:
            raise ValueError(f"--blocks {start}:{end} is outside the model's 0:{total}")
        if not plan.fits(start, end, drafter=False):
            raise ValueError(f"--blocks {start}:{end}: " + plan.shortfall(start, end, device))
        return
    if config.num_blocks is not None:
        n = config.num_blocks
        if n <= 0:
            raise ValueError(f"--num-blocks must be positive, got {n}")
        if n > total:
            raise ValueError(f"--num-blocks {n}: the model has {total} blocks")
        if _most_blocks(plan, anywhere=True, automatic=False) < n:
            start = 1 if n <= total - 2 else 0  # the cheapest place: the middle, where no end is held
            raise ValueError(f"--num-blocks {n}: " + plan.shortfall(start, start + n, device))
        return
    if plan.blocks < 1:
        raise ValueError("cannot serve here, not even one block fits: " + plan.describe(device))


def _most_blocks(plan: MemoryPlan, head: bool = False, tail: bool = False, *, automatic: bool, anywhere: bool = False) -> int:
    """The longest span with these ends this server takes; a tail planned automatically keeps room
    for the drafter when one block fits beside it, one the volunteer sized (``--num-blocks``) drops it."""
    if anywhere:
        return max(_most_blocks(plan, h, t, automatic=automatic) for h in (False, True) for t in (False, True))
    if tail and not (automatic and plan.tail_drafter):
        return plan.most_blocks(head, tail, drafter=False)
    return plan.most_blocks(head, tail)


def _choose_blocks(
    config: ServerConfig, servers: Sequence[ServerInfo], total: int, plan: Optional[MemoryPlan] = None
) -> tuple[int, int]:
    """``--blocks`` as given, else the span that raises the max-flow most over ``servers`` (the
    others' records; placement counts JOINING and ONLINE ones) among the spans that fit the memory
    plan: a span at an end holds the embeddings or the LM head (and drafter) too, so it may be
    shorter, or, where an end does not fit at all, the span stays off it."""
    if config.blocks is not None:
        start, end = config.blocks
        if not 0 <= start < end <= total:
            raise ValueError(f"--blocks {start}:{end} is outside the model's 0:{total}")
        return start, end
    if config.num_blocks is not None and config.num_blocks <= 0:
        raise ValueError(f"--num-blocks must be positive, got {config.num_blocks}")
    from protocol.routing import choose_best_span

    automatic = config.num_blocks is None
    length = min(config.num_blocks or (plan.blocks if plan else total), total)
    lo, hi = 0, total  # the span stays inside [lo, hi): an end that does not fit is left out
    for _ in range(4):  # each round shortens the span or narrows [lo, hi); four rounds settle both ends
        span = choose_best_span(servers, total, length, my_throughput=joining_throughput(servers, length), within=(lo, hi))
        start, end = span
        if plan is None:
            return span
        room = _most_blocks(plan, start == 0, end == total, automatic=automatic)
        if room >= end - start:
            return span
        if room >= 1 and automatic:
            length = room  # fewer blocks at this end, wherever they go then
            continue
        lo, hi = (1 if start == 0 else lo), (total - 1 if end == total else hi)  # this end does not fit: stay off it
        length = min(length, hi - lo)
        if length < 1:
            break
    raise ValueError(f"no span of {config.num_blocks or plan.blocks} blocks fits this server's memory: "
                     + plan.describe("this device"))  # fmt: skip


def measure_throughput(span: SpanAdapter, num_steps: int = 8) -> float:
    """Decode tokens/s of this span on its device (one position at a time, as in generation)."""
    cache = span.new_cache()
    hidden = torch.zeros(1, 1, *span.hidden_shape)
    ids = torch.zeros(1, 1, dtype=torch.long)
    blocks = range(span.start, span.end)
    span.forward(hidden, ids, 0, cache, blocks)  # warm-up
    began = time.perf_counter()
    for position in range(1, num_steps + 1):
        span.forward(hidden, ids, position, cache, blocks)
    return num_steps / max(time.perf_counter() - began, 1e-9)


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("specswarm")
    except Exception:
        return "0+unknown"
