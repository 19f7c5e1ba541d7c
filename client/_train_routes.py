"""A training step's route: one whose every hop's backward budget takes the step's rows, and their chunks.

Servers announce their backward budgets (``ServerInfo.max_backward_bytes``, ``--max-backward-mib``) and a client
sizes each row's chunks to the smallest on its route (``split_row``). A server whose budget cannot take even a
row's first chunk (its prompts), or whose chunks would pass ``limits.MAX_TRAIN_CHUNKS``, would make the step
impossible on a route through it, though another server of the same blocks may take it: so the planner routes
around such servers for this step (``plan_training_route``), and only where no route avoids them is the row a
``ValueError`` naming them and their blocks. Like generation's ``open_session``, planning retries (bounded, with
a fresh DHT read each time) when the swarm's records leave a block uncovered: a record that lapsed under load
is announced again within a server's update period (docs/fine_tuning.md, "Limits").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from client._swarm import SwarmClient
from client.errors import RoutingError
from protocol import limits
from protocol.messages import Hop
from protocol.train_memory import HopBudget, backward_bytes, chunk_positions, route_chunk_positions

Pieces = list[tuple[int, list[int], list[int]]]  # a row's chunks: (offset, ids, targets)


@dataclass
class TrainRow:
    token_ids: list[int]  # the row without padding
    targets: list[int]  # per id, the token its logits are scored against; -100: none
    label: Optional[float] = None  # classification: the row's class (or value, regression); targets all -100
    multi_labels: Optional[list[float]] = None  # multi-label classification: one target in [0, 1] per label


class ChunkBudgetError(ValueError):
    """A row that the route cannot take in chunks; ``hop``: the server whose backward budget decides (None: the
    route's step limit does), which a planner may route around."""

    def __init__(self, message: str, hop: Optional[HopBudget] = None):
        super().__init__(message)
        self.hop = hop


def route_budgets(swarm: SwarmClient, route: Sequence[Hop], limit: int, config: Any) -> list[HopBudget]:
    """What each hop of ``route`` checks a lap's backward against, from the records the route was planned from
    (``ServerInfo.max_backward_bytes``). A record that announces none (an older server) counts as that server's
    default, a row of ``limit`` positions through the hop (its own step limit is at least the route's: so at least
    this); a dtype that is not a torch floating type counts as float32."""
    hops = []
    for index, hop in enumerate(route):
        info = swarm.records.get(hop.peer_id)
        dtype = getattr(torch, info.dtype, None) if info is not None else None
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        blocks, tail = hop.end - hop.start, index == len(route) - 1
        budget = info.max_backward_bytes if info is not None else 0
        budget = budget or backward_bytes(config, dtype, limit, blocks, tail)
        hops.append(HopBudget(budget, blocks, tail, dtype, hop.peer_id))
    return hops


def split_row(
    row: TrainRow,
    num_prompts: int,
    limit: int,
    config: Any = None,
    hops: Optional[Sequence[HopBudget]] = None,
    logits: bool = True,
) -> Pieces:
    """A row's chunks of at most ``limit`` positions each, as (offset, ids, targets): the first chunk holds the
    prompts and up to ``limit - num_prompts`` ids; ``offset`` counts the row's positions before the chunk. With the
    model's ``config`` and the route's ``hops`` (:func:`route_budgets`) every chunk, the first included, is as large
    as the smallest backward budget on the route allows after its offset (``logits`` False: a classification row,
    whose tail computes no logits), so no hop refuses a chunk it was sized for and chunks shrink as the row's
    earlier keys/values grow; with ``config`` alone, as a row of ``limit`` positions holds (protocol/train_memory.py
    ``chunk_positions``: the servers' default budget). A row past that, or past limits.MAX_TRAIN_CHUNKS chunks, is a
    ValueError naming it (and the server whose budget decides)."""
    if num_prompts >= limit:
        raise ValueError(f"{num_prompts} prompts leave no room for ids in the route's {limit} positions per step")
    chunks, start = [], 0
    while start < len(row.token_ids):
        offset = 0 if not chunks else num_prompts + start
        prompts_here, size, decider = (0 if chunks else num_prompts), limit, None
        if hops is not None and config is not None:
            size, decider = route_chunk_positions(config, offset, limit, hops, logits)
        elif chunks and config is not None:
            size = chunk_positions(config, offset, limit)
        size -= prompts_here
        if size <= 0 or len(chunks) == limits.MAX_TRAIN_CHUNKS:
            where = "the backward of a step"
            if decider is not None:
                where = (
                    f"the backward budget of server {decider.peer_id} ({decider.budget / (1 << 20):.1f} MiB through "
                    f"{decider.blocks} blocks, --max-backward-mib)"
                )
            what = f"its chunk after {offset} positions" if chunks else f"its first chunk ({num_prompts} prompts)"
            raise ChunkBudgetError(
                f"a training row of {num_prompts} prompts + {len(row.token_ids)} ids is too long for the route's "
                f"{limit} positions per step: "
                + (f"{what} has no room in {where}" if size <= 0 else f"{what} would be past {len(chunks)} chunks")
                + " (docs/fine_tuning.md, Limits); shorten the row",
                decider,
            )
        chunks.append((offset, row.token_ids[start : start + size], row.targets[start : start + size]))
        start += size
    return chunks


async def plan_training_route(
    swarm: SwarmClient, rows: Sequence[TrainRow], num_prompts: int, config: Any, logits: bool = True
) -> tuple[list[Hop], list[Pieces]]:
    """A route for a step of ``rows`` and each row's chunks on it (:func:`split_row`). A server whose backward
    budget cannot take a row's chunks is left out and the route planned again without it (for this step only:
    it serves every row that fits it); where no route avoids the servers left out, a ValueError names them,
    their blocks and the row. The caller gives the route back with ``router.release``."""
    avoided: dict[str, tuple[int, int]] = {}  # peer id -> its first and last block on the route it was left out of
    first: Optional[ChunkBudgetError] = None
    while True:
        try:
            # once servers are left out, a missing block is theirs, not a lapsed record: one read, no waiting
            route = await swarm.plan_route(also_exclude=avoided, attempts=1 if avoided else None)
        except RoutingError as e:
            if first is None:
                raise
            servers = ", ".join(f"{peer} (blocks {start}..{end})" for peer, (start, end) in avoided.items())
            blocks = ", ".join(str(block) for block in e.missing_blocks)
            raise ValueError(
                f"{first}; no route avoids the servers whose backward budget is too small for it: {servers} "
                f"(no other server takes block(s) {blocks})"
            ) from e
        try:
            limit = swarm.route_step_limit(route)
            hops = route_budgets(swarm, route, limit, config) if config is not None else None
            return route, [split_row(row, num_prompts, limit, config, hops, logits) for row in rows]
        except ChunkBudgetError as e:
            swarm.router.release(route)
            if e.hop is None or not e.hop.peer_id or e.hop.peer_id in avoided:
                raise
            first = first or e
            hop = next(h for h in route if h.peer_id == e.hop.peer_id)
            avoided[hop.peer_id] = (hop.start, hop.end - 1)
