"""Which blocks a server takes: the span that raises the swarm's max-flow most among those that fit
its memory plan, the check that blocks the volunteer asked for fit before anything is announced, the
records placement counts, and the throughput a server measures and claims.

The choice itself is :func:`protocol.placement.choose_best_span` (pure, over records); this module
joins it to the memory plan (server/memory.py): a span at an end of the model also holds the
embeddings or the LM head (and a tail's drafter), so it may be shorter or stay off that end.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import hivemind
import torch

from protocol.dht_records import fetch_servers
from protocol.records import ServerInfo
from server.adapters import SpanAdapter
from server.joining import joining_throughput
from server.memory import MemoryPlan
from server.server_config import ServerConfig


def fetch_same_model(
    dht: hivemind.DHT, mine: ServerInfo, total: int, blocks: Optional[Sequence[int]] = None
) -> list[ServerInfo]:
    """The records placement counts: servers of this exact model (config and weights revision);
    another revision under the same name covers no block for us. ``blocks``: read only these
    blocks' keys (default: every block)."""
    servers = fetch_servers(dht, mine.model, total, blocks=blocks)
    return [s for s in servers if (s.config_fingerprint, s.revision) == (mine.config_fingerprint, mine.revision)]


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
        if most_blocks(plan, anywhere=True, automatic=False) < n:
            start = 1 if n <= total - 2 else 0  # the cheapest place: the middle, where no end is held
            raise ValueError(f"--num-blocks {n}: " + plan.shortfall(start, start + n, device))
        return
    if plan.blocks < 1:
        raise ValueError("cannot serve here, not even one block fits: " + plan.describe(device))


def most_blocks(
    plan: MemoryPlan, head: bool = False, tail: bool = False, *, automatic: bool, anywhere: bool = False
) -> int:
    """The longest span with these ends this server takes; a tail planned automatically keeps room
    for the drafter when one block fits beside it, one the volunteer sized (``--num-blocks``) drops it."""
    if anywhere:
        return max(most_blocks(plan, h, t, automatic=automatic) for h in (False, True) for t in (False, True))
    if tail and not (automatic and plan.tail_drafter):
        return plan.most_blocks(head, tail, drafter=False)
    return plan.most_blocks(head, tail)


def choose_blocks(
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
    from protocol.placement import choose_best_span

    automatic = config.num_blocks is None
    length = min(config.num_blocks or (plan.blocks if plan else total), total)
    lo, hi = 0, total  # the span stays inside [lo, hi): an end that does not fit is left out
    for _ in range(4):  # each round shortens the span or narrows [lo, hi); four rounds settle both ends
        span = choose_best_span(
            servers, total, length, my_throughput=joining_throughput(servers, length), within=(lo, hi)
        )
        start, end = span
        if plan is None:
            return span
        room = most_blocks(plan, start == 0, end == total, automatic=automatic)
        if room >= end - start:
            return span
        if room >= 1 and automatic:
            length = room  # fewer blocks at this end, wherever they go then
            continue
        lo, hi = (1 if start == 0 else lo), (total - 1 if end == total else hi)  # this end does not fit: stay off it
        length = min(length, hi - lo)
        if length < 1:
            break
    raise ValueError(
        f"no span of {config.num_blocks or plan.blocks} blocks fits this server's memory: "
        + plan.describe("this device")
    )


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
