"""Rebalancing: a running server moves to the span that helps the swarm more, and no move can
leave it broken.

Every ``--balance-period`` seconds a server that chose its own blocks asks
:func:`protocol.placement.should_move` whether another span raises the swarm's max-flow by enough;
:meth:`SpanMoves.move_to` then loads that span beside the old one when the memory plan has room
for both (the old keeps serving meanwhile), else drains and frees the old one first; the new span
is announced only once it serves, and on any failure the old span is kept or loaded again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import TYPE_CHECKING, Optional, Sequence

import msgspec
import torch

from protocol.dht_records import announce
from protocol.records import ServerInfo, ServerState
from server.adapters import SpanAdapter, load_span
from server.drafter_attach import attach_drafter_if_it_fits
from server.joining import keep_announcing
from server.lora import attach_to_span, open_adapters
from server.quantization import Quant

if TYPE_CHECKING:
    import hivemind
    from transformers import PretrainedConfig

    from server.handler import SessionHandler
    from server.memory import MemoryPlan
    from server.server_config import ServerConfig
    from server.weights import Checkpoint

logger = logging.getLogger(__name__)


class SpanMoves:
    """The moves of :class:`server.span_server.SpanServer` (a mixin: it moves the server's own span,
    handler and record, and announces through the server's ``_announce`` and ``current_info``)."""

    config: "ServerConfig"
    dht: "hivemind.DHT"
    span: SpanAdapter
    handler: "SessionHandler"
    info: ServerInfo
    model_config: Optional["PretrainedConfig"]
    checkpoint: Optional["Checkpoint"]
    plan: Optional["MemoryPlan"]

    def current_info(self, state: ServerState = ServerState.ONLINE) -> ServerInfo:
        raise NotImplementedError

    def _announce(self, state: ServerState = ServerState.ONLINE, expiration: Optional[float] = None) -> None:
        raise NotImplementedError

    async def _maybe_move(self, servers: Sequence[ServerInfo]) -> None:
        """Move to the span that raises the swarm's max-flow the most, if the gain is large and
        the span fits this server's memory (a span at an end also holds the embeddings or the LM head)."""
        from protocol.placement import should_move

        total, me = self.span.num_blocks, self.current_info()
        target = should_move(servers, me, total)
        if target is not None and self.plan is not None and not self.plan.fits(*target, drafter=False):
            lo = 1 if target[0] == 0 else 0
            hi = total - 1 if target[1] == total else total
            target = (
                should_move(servers, me, total, within=(lo, hi)) if me.end_block - me.start_block <= hi - lo else None
            )
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
        logger.info(
            f"Moving from {where} "
            f"({'loading beside the old span' if beside else 'draining and freeing the old span first'})"
        )
        if not beside:
            await self._drain_and_free(ServerState.DRAINING)
        try:
            span = await self._load_span(start, end, ServerState.JOINING if not beside else None)
        except Exception as e:
            logger.error(
                f"Could not load blocks {start}:{end} ({e!r}); keeping blocks "
                f"{old_info.start_block}:{old_info.end_block}"
            )
            span = self.span
            if not beside:  # the old span was freed: load it again, announced as joining meanwhile
                try:
                    span = await self._load_span(old_info.start_block, old_info.end_block, ServerState.JOINING)
                except Exception as again:
                    logger.error(
                        f"Could not load blocks {old_info.start_block}:{old_info.end_block} again ({again!r}): "
                        "this server serves nothing now; restart it"
                    )
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
        self.span = self.handler.span = self.handler.batches.span = FreedSpan(self.span)
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
                None,
                load_span,
                self.model_config,
                self.checkpoint,
                start,
                end,
                self.span.dtype,
                str(self.span.device),
                Quant(self.info.quantization),
            )
            await loop.run_in_executor(None, self._attach_adapters, span)
            await loop.run_in_executor(
                None, attach_drafter_if_it_fits, span, self.config, self.model_config, self.checkpoint, self.plan
            )
            return span
        finally:
            if refresher is not None:
                refresher.cancel()

    def _attach_adapters(self, span: SpanAdapter) -> None:
        """The --adapters' pairs of the new span's blocks (server/lora.py), read again from their files."""
        attach_to_span(span, open_adapters(self.config.adapters, span.num_blocks))

    def _serve(self, span: SpanAdapter, info: ServerInfo) -> None:
        """Serve ``span`` and say so: the record goes out only once the span takes sessions."""
        self.span = self.handler.span = self.handler.batches.span = span
        self.handler.training.use_span(span)
        self.info = info
        self.handler.accepting = self.handler.training.accepting = True
        self._announce()

    def _publish(self, info: ServerInfo) -> None:
        announce(self.dht, info, 3 * self.config.update_period, wait=False, num_blocks=self.span.num_blocks)


class FreedSpan:
    """Stands for a span whose weights were freed during a move: keeps the facts the server reads
    (device, dtype, block count) and nothing else."""

    def __init__(self, span: SpanAdapter):
        self.device, self.dtype, self.num_blocks = span.device, span.dtype, span.num_blocks
        self.start, self.end, self.drafter, self.lora = span.start, span.end, None, None
