"""A forward pass through the swarm: logits (and final hidden states) of one sequence.

One session per sequence: open it on a route, send the sequence as prefill runs of at most
``max_positions_per_step`` positions each (chunked prefill) that ask the tail for the full logits
of the positions among the last ``num_outputs`` (``Step.return_logits``), collect the
``RunOutputs`` messages the tail sends before each verdict, close the session. The verdicts
themselves (the argmax after each chunk) are ignored. A retryable failure excludes the
server at fault and starts again on another route, as generation's failover does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from client._loop import all_or_none
from client._remote_session import RemoteSession
from client._swarm import SwarmClient
from client.errors import GenerationError, ServerError
from protocol.errors import ErrorCode
from protocol.messages import RunOutputs, Step

logger = logging.getLogger(__name__)


@dataclass
class RowOutputs:
    logits: torch.Tensor  # [num_outputs, vocab] float32
    hidden: Optional[torch.Tensor]  # [num_outputs, hidden] float32, when asked for
    route: list[tuple[str, int, int]]
    failovers: int = 0
    confirmed: str = "unaudited"  # "trusted", "untrusted", "unaudited" or "unconfirmed" (client/_output_audits.py)


async def forward_row(
    swarm: SwarmClient,
    row: list[int],
    num_outputs: int,
    *,
    vocab_size: int,
    hidden_size: int,
    return_hidden: bool = False,
    max_failovers: int = 5,
    auditor=None,
    audit: str = "warn",
) -> RowOutputs:
    """Logits (and final hidden states) of the last ``num_outputs`` positions of ``row``; with an
    ``auditor`` (client/_output_audits.py), checked on a second route at its rate (always under
    ``audit="required"``) after the live session is closed.

    Every pass asks the tail for the final hidden states as well, whether or not the caller wants
    them (they cost hidden_size / vocab_size more bytes: 1-6% on the families served): the evidence of a
    dispute must ask for them, so a tail that lied only where they are not asked could tell the
    evidence from live work and answer it alone honestly; and the live reply's own states are evidence
    against its own logits (client/_output_audits.py)."""
    if not 1 <= num_outputs <= len(row):
        raise ValueError(f"num_outputs must be in [1, {len(row)}], got {num_outputs}")
    failovers = 0
    while True:
        remote = await swarm.open_session(len(row), avoid=auditor.route_avoid() if auditor is not None else ())
        try:
            logits, hidden = await prefill_outputs(
                remote, row, num_outputs, remote.max_positions_per_step, vocab_size, hidden_size, True
            )
            hops = list(remote.route)
            break
        except ServerError as e:
            if not e.retryable or failovers >= max_failovers:
                raise GenerationError(f"the forward pass failed after {failovers} failovers: {e}") from e
            failovers += 1
            logger.warning(f"Failing over: {e}")
            await swarm.blame(remote.route, e)
        finally:
            await swarm.close_session(remote)
    confirmed = "unaudited"
    if auditor is not None:
        shape = (num_outputs, vocab_size, hidden_size, True)  # the audit's passes look like this one
        (hops, logits, hidden), confirmed = await auditor.check(row, hops, logits, hidden, shape, audit)
    route = [(hop.peer_id, hop.start, hop.end) for hop in hops]
    return RowOutputs(logits, hidden if return_hidden else None, route, failovers, confirmed)


async def forward_batch(
    swarm: SwarmClient,
    config,
    rows: list[list[int]],
    kept: list[torch.Tensor],
    keep: int,
    return_hidden: bool,
    **audits,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One prefill session per row with a kept column, all at once; the logits (and final hidden
    states) put back in the padded batch's last ``keep`` columns (``model.forward``). ``audits``:
    :func:`forward_row`'s ``auditor`` and ``audit``."""
    wanted = [i for i in range(len(rows)) if len(kept[i])]
    vocab, hidden_size = config.vocab_size, config.hidden_size
    sizes = dict(vocab_size=vocab, hidden_size=hidden_size, return_hidden=return_hidden)
    results = await all_or_none([forward_row(swarm, rows[i], len(kept[i]), **sizes, **audits) for i in wanted])
    logits = torch.zeros(len(rows), keep, vocab)
    hidden = torch.zeros(len(rows), keep, hidden_size) if return_hidden else None
    for i, result in zip(wanted, results):
        logits[i, kept[i]] = result.logits
        if hidden is not None:
            hidden[i, kept[i]] = result.hidden
    return logits, hidden


async def prefill_outputs(
    remote: RemoteSession,
    row: list[int],
    num_outputs: int,
    chunk: int,
    vocab_size: int,
    hidden_size: int,
    return_hidden: bool = False,
    hidden_at: int = -1,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Prefill ``row`` on an open session in runs of at most ``chunk`` positions, all sent at once;
    the logits (and final hidden states) of its last ``num_outputs`` positions, float32; with
    ``hidden_at`` (and ``return_hidden``), no logits (None) and the states entering that block."""
    first_output = len(row) - num_outputs
    wanted = []  # outputs asked of each chunk: the chunk's positions >= first_output
    for run_id, start in enumerate(range(0, len(row), chunk)):
        end = min(start + chunk, len(row))
        wanted.append(max(0, end - max(start, first_output)))
        step = Step(
            session_id=remote.session_id,
            run_id=run_id,
            start_pos=start,
            token_ids=list(row[start:end]),
            return_logits=wanted[-1],
            return_hidden=return_hidden and wanted[-1] > 0,
            hidden_at=hidden_at if return_hidden and wanted[-1] > 0 else -1,
        )
        await remote.send_step(step)
    parts = []
    for run_id, count in enumerate(wanted):
        frames: list[tuple[RunOutputs, list[torch.Tensor]]] = []
        await remote.next_result(run_id, outputs=frames)
        if count:
            frames = [f for f in frames if f[0].run_id == run_id]
            state_only = return_hidden and hidden_at != -1
            parts.append(_assemble(frames, count, vocab_size, hidden_size, return_hidden, remote.tail_peer, state_only))
    logits = torch.cat([p[0] for p in parts]) if parts[0][0] is not None else None
    hidden = torch.cat([p[1] for p in parts]) if return_hidden else None
    return logits, hidden


def _assemble(frames, num_outputs, vocab_size, hidden_size, return_hidden, tail_peer, state_only=False):
    """Concatenate the tail's chunks, checking that they are exactly what was asked for (the tail
    is another peer: a wrong shape is its fault, and failover routes around it). ``state_only``: a
    ``hidden_at`` run's, the states alone (logits None)."""
    logits, hidden, expected_offset = [], [], 0
    widths = [hidden_size] if state_only else [vocab_size] + [hidden_size] * return_hidden
    for message, tensors in frames:
        count = tensors[0].shape[0] if tensors and tensors[0].ndim == 2 else -1
        shapes_ok = (
            len(tensors) == len(widths)
            and message.offset == expected_offset
            and 0 < count <= num_outputs - expected_offset
            and all(tuple(t.shape) == (count, w) for t, w in zip(tensors, widths))
        )
        if not shapes_ok:
            raise ServerError(
                f"the tail sent outputs {[tuple(t.shape) for t in tensors]} at row {message.offset}; expected rows "
                f"from {expected_offset} of {num_outputs}, {vocab_size} logits"
                f"{' and the hidden state' * return_hidden} each",
                tail_peer,
                ErrorCode.INTERNAL,
            )
        if not state_only:
            logits.append(tensors[0].float())
        if return_hidden:
            hidden.append(tensors[-1].float())
        expected_offset += count
    if expected_offset != num_outputs:
        message = f"the tail sent {expected_offset} of {num_outputs} rows of outputs"
        raise ServerError(message, tail_peer, ErrorCode.INTERNAL)
    return (torch.cat(logits) if logits else None), (torch.cat(hidden) if return_hidden else None)
