"""A training step through the swarm: each row's loss and the gradient of the client's prompts.

The client holds no weights, so the loss and its gradient are computed by the servers (docs/design.md,
"Fine-tuning"): one TrainForward per row goes to the head on the training protocol with the prompts,
the row's ids and its targets; the lap runs forward to the tail, which computes the loss sum and
starts the backward, and the head answers with the prompts' gradient. So one round trip per row
gives both, and ``SwarmLoss`` hands that gradient to autograd when the caller runs ``backward()``.

A row longer than the route's step limit, or whose backward is past a hop's announced budget, goes in chunks,
one lap each (``train_chunked_row``), sized so that every hop of the route takes them; the route avoids a server
whose backward budget cannot take a row at all (client/_train_routes.py).

Failover is whole-step: a retryable failure anywhere blames the route (``SwarmClient.blame``) and
runs every row again on a new route; the rows in chunks of a failed attempt are dropped on its route at once
(``drop_abandoned``), so nothing of a failed step stays on any server that can be reached.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from hivemind.p2p import PeerID

from client import _loop
from client._remote_session import _error_from
from client._swarm import SwarmClient
from client._train_routes import TrainRow, plan_training_route
from client.errors import GenerationError, ServerError, ServerTimeout
from protocol import limits, relay
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, Hop, TrainBackward, TrainDrop, TrainForward
from protocol.streams import TRAIN_PROTOCOL, MessageStream
from protocol.train_drops import hand_drop

logger = logging.getLogger(__name__)

MAX_FAILOVERS = 3
_DROPS: set[asyncio.Future] = set()  # drops under way (the reference keeps each task alive)


@dataclass
class RowGrad:
    loss_sum: float  # the sum of the row's target cross-entropies
    num_targets: int
    grad: torch.Tensor  # [num_prompts, hidden] float32: d loss_sum / d prompts
    deep_grad: Optional[torch.Tensor] = None  # [num_blocks, num_prompts, hidden]: d loss_sum / d deep prompts
    scored: Optional[torch.Tensor] = None  # classification: [hidden], the final hidden state the tail scored


@dataclass
class TrainingStats:
    """The last training step (``model.last_training_stats``): the route that computed it, the failovers
    before it (each ran the whole step again on a new route) and its seconds, failovers included."""

    route: list[Hop] = field(default_factory=list)
    failovers: int = 0
    seconds: float = 0.0


async def train_rows(
    swarm: SwarmClient,
    prompts: torch.Tensor,
    rows: Sequence[TrainRow],
    timeout: float,
    deep: Optional[torch.Tensor] = None,
    score: Optional[torch.Tensor] = None,
    config: Any = None,
) -> tuple[list[RowGrad], TrainingStats]:
    """Every row's loss sum and prompt gradient on one route (all rows at once), and the step's stats;
    a retryable failure runs the whole step again on a new route, at most MAX_FAILOVERS times.
    ``deep`` ``[num_blocks, num_prompts, hidden]``: deep prompts (each row's RowGrad.deep_grad is theirs).
    ``score`` ``[num_labels, hidden]``: classification weights the tail scores each row's last position with.
    ``config``: the model's, which sizes a long row's chunks to the route's backward budgets (:func:`split_row`)."""
    failovers, began = 0, time.perf_counter()
    while True:
        # a classification row's tail reads the score head, not the LM head's logits
        route, chunks = await plan_training_route(swarm, rows, prompts.shape[0], config, logits=score is None)
        started: list[str] = []  # this attempt's rows in chunks: dropped on the route if the attempt fails
        results = None
        try:
            coros = []
            for row, pieces in zip(rows, chunks):
                if len(pieces) <= 1:
                    coros.append(train_row(swarm, route, prompts, row, timeout, deep, score))
                else:
                    coros.append(train_chunked_row(swarm, route, prompts, row, timeout, pieces, deep, score, started))
            results = await _loop.all_or_none(coros)
            return results, TrainingStats(list(route), failovers, time.perf_counter() - began)
        except ServerError as e:
            if not e.retryable or failovers >= MAX_FAILOVERS:
                if e.retryable:
                    raise GenerationError(f"the training step failed after {failovers} failovers: {e}") from e
                raise
            failovers += 1
            logger.warning(f"Training step failed ({e}); running it again on a new route")
            await swarm.blame(route, e)
        finally:
            if results is None and started:
                drop_abandoned(swarm, route, started)
            swarm.router.release(route)


def drop_abandoned(swarm: SwarmClient, route: list[Hop], step_ids: list[str]) -> None:
    """Tell the route's hops to forget what they keep of these abandoned rows now (server/train_drops.py) rather
    than after the step timeout; in the background, so a failover goes on at once (a drop nobody takes changes
    nothing: the rows expire)."""
    for start in range(0, len(step_ids), limits.MAX_TRAIN_STEPS_IN_FLIGHT):
        message = TrainDrop(step_ids=step_ids[start : start + limits.MAX_TRAIN_STEPS_IN_FLIGHT], route=list(route))
        task = asyncio.ensure_future(_send_drop(swarm, message))
        _DROPS.add(task)
        task.add_done_callback(_DROPS.discard)


async def _send_drop(swarm: SwarmClient, message: TrainDrop) -> None:
    """The drop to the route's first hop that takes it (each passes it on to the hops after it)."""
    for hop in message.route:
        if await hand_drop(swarm.p2p, message, hop):
            return


async def train_row(
    swarm: SwarmClient,
    route: list[Hop],
    prompts: torch.Tensor,
    row: TrainRow,
    timeout: float,
    deep: Optional[torch.Tensor] = None,
    score: Optional[torch.Tensor] = None,
) -> RowGrad:
    """One row's lap: TrainForward to the head, its TrainBackward (or ErrorReply) back."""
    head = route[0].peer_id
    message = TrainForward(
        step_id=secrets.token_hex(8),
        route=route,
        hop_index=0,
        num_prompts=prompts.shape[0],
        token_ids=row.token_ids,
        targets=row.targets,
        deep_prompts=deep is not None,
        num_labels=0 if score is None else score.shape[0],
        label=0.0 if row.label is None else float(row.label),
        active_adapter=swarm.active_adapter,
        multi_labels=row.multi_labels or [],
        spares=swarm.spares(route, limits.MAX_TRAIN_SPARES),
    )
    tensors = [prompts.detach().float().cpu().contiguous()] if prompts.shape[0] else []
    if deep is not None:
        tensors.append(deep.detach().float().cpu().contiguous())
    if score is not None:
        tensors.append(score.detach().float().cpu().contiguous())
    hidden = prompts.shape[1]
    received = await _exchange(swarm, route, message, tensors, timeout, hidden, 0 if deep is None else deep.numel())
    return _row_grad(received, message, head, hidden, None if deep is None else tuple(deep.shape))


async def _exchange(
    swarm: SwarmClient,
    route: list[Hop],
    message: TrainForward,
    tensors: list[torch.Tensor],
    timeout: float,
    hidden: int,
    deep_values: int = 0,  # deep prompt values: their gradients come back in the reply
):
    """One lap: ``message`` to the head, and what comes back on its stream (None: the end of the stream)."""
    head = route[0].peer_id
    rows = max(1, message.num_prompts)
    relay.remember(head, route[0].addrs)
    stream = None
    try:
        stream = await MessageStream.open(
            swarm.p2p,
            PeerID.from_base58(head),
            TRAIN_PROTOCOL,
            max_frame_bytes=limits.train_frame_bytes((hidden,), rows, deep_values),
            max_tensor_elements=max(rows * hidden, deep_values),
        )
        await stream.send(message, tensors)
        return await asyncio.wait_for(stream.receive(), timeout)
    except asyncio.TimeoutError:
        # any hop may be the silent one (a frozen middle keeps the head waiting): no peer named, so failover
        # pings the route and excludes the hops that do not answer (SwarmClient.blame)
        raise ServerTimeout(f"no answer to a training step within {timeout:.0f} s", "", ErrorCode.DOWNSTREAM_FAILED)
    except Exception as e:  # the dial, the send, or a frame we refused
        raise ServerError(f"could not reach the server: {e!r}", head, ErrorCode.DOWNSTREAM_FAILED) from None
    finally:
        if stream is not None:
            stream.close()


async def train_chunked_row(
    swarm: SwarmClient,
    route: list[Hop],
    prompts: torch.Tensor,
    row: TrainRow,
    timeout: float,
    pieces: list[tuple[int, list[int], list[int]]],
    deep: Optional[torch.Tensor] = None,
    score: Optional[torch.Tensor] = None,
    started: Optional[list[str]] = None,
) -> RowGrad:
    """A row in chunks (``pieces``: :func:`split_row`'s; docs/design.md, "Long rows in chunks"): a forward lap
    per chunk in order (the last one runs its chunk's backward too), then a backward lap per earlier chunk in
    reverse; every hop keeps the row's chunk inputs and keys/values between the laps. The loss is the chunks'
    sum; the prompts' (and deep prompts') gradient comes with chunk 0's backward lap, which the deep prompts
    (sent with chunk 0's forward lap) sit in; a classification row's score weights go with the last chunk, whose
    last position the tail scores, and its reply carries the scored hidden state."""
    step_id, head = secrets.token_hex(8), route[0].peer_id
    if started is not None:  # the caller drops the step on the route if it is abandoned
        started.append(step_id)
    num_prompts, hidden = prompts.shape
    grad, loss_sum, num_targets = torch.zeros(num_prompts, hidden), 0.0, 0
    deep_grad = scored = None
    laps = [(k, False) for k in range(len(pieces))] + [(k, True) for k in reversed(range(len(pieces) - 1))]
    for index, backward_only in laps:
        offset, ids, targets = pieces[index]
        message = TrainForward(
            step_id=step_id,
            route=route,
            hop_index=0,
            num_prompts=num_prompts,
            token_ids=ids,
            targets=targets,
            deep_prompts=deep is not None,
            num_labels=0 if score is None else score.shape[0],
            label=0.0 if row.label is None else float(row.label),
            active_adapter=swarm.active_adapter,
            multi_labels=row.multi_labels or [],
            chunk_index=index,
            num_chunks=len(pieces),
            chunk_offset=offset,
            backward_only=backward_only,
        )
        first_forward, last = index == 0 and not backward_only, index == len(pieces) - 1
        tensors = [prompts.detach().float().cpu().contiguous()] if first_forward and num_prompts else []
        if first_forward and deep is not None:
            tensors.append(deep.detach().float().cpu().contiguous())
        if last and score is not None:
            tensors.append(score.detach().float().cpu().contiguous())
        deep_back = index == 0 and backward_only and deep is not None
        deep_values = deep.numel() if deep_back else 0
        received = await _exchange(swarm, route, message, tensors, timeout, hidden, deep_values)
        shapes = []  # what the reply carries: chunk 0's backward the gradients, the last chunk the scored state
        if index == 0 and backward_only:
            shapes = ([(num_prompts, hidden)] if num_prompts else []) + ([tuple(deep.shape)] if deep_back else [])
        elif last and score is not None:
            shapes = [(1, hidden)]
        reply, got = _chunk_reply(received, message, head, shapes)
        loss_sum, num_targets = loss_sum + reply.loss_sum, num_targets + reply.num_targets
        if index == 0 and backward_only:
            grad = got[0] if num_prompts else grad
            deep_grad = got[-1] if deep_back else None
        elif last and score is not None:
            scored = got[0][0]
    return RowGrad(loss_sum, num_targets, grad, deep_grad, scored)


def _chunk_reply(received, message: TrainForward, head: str, shapes: list[tuple[int, ...]]):
    """A chunk lap's reply from the head, checked: the TrainBackward, and its tensors, of ``shapes`` (chunk 0's
    backward: the prompts' and deep prompts' gradients; the last chunk of a classification row: the scored
    hidden state; none otherwise)."""
    reply = received.message if received is not None else None
    if isinstance(reply, ErrorReply):
        raise _error_from(reply, head)
    if not isinstance(reply, TrainBackward) or reply.step_id != message.step_id or reply.num_targets < 0:
        what = type(reply).__name__ if reply is not None else "the end of the stream"
        raise ServerError(f"the head answered chunk {message.chunk_index} with {what}", head, ErrorCode.INTERNAL)
    got = [tuple(t.shape) for t in received.tensors]
    if got != shapes:
        raise ServerError(
            f"the head sent {got} for chunk {message.chunk_index}; expected {shapes}", head, ErrorCode.INTERNAL
        )
    return reply, [t.float() for t in received.tensors]


def _row_grad(received, message: TrainForward, head: str, hidden: int, deep_shape: Optional[tuple]) -> RowGrad:
    """The head's reply, checked: an ErrorReply raised as the error it names, a gradient of the prompts' shape."""
    reply = received.message if received is not None else None
    if isinstance(reply, ErrorReply):
        raise _error_from(reply, head)
    if not isinstance(reply, TrainBackward) or reply.step_id != message.step_id:
        what = type(reply).__name__ if reply is not None else "the end of the stream"
        raise ServerError(f"the head answered a training step with {what}", head, ErrorCode.INTERNAL)
    expected = (message.num_prompts, hidden)
    grads = received.tensors
    grad = grads[0].float() if grads else torch.zeros(expected)
    wanted = [expected] + ([deep_shape] if deep_shape else []) + ([(1, hidden)] if message.num_labels else [])
    shapes = [tuple(t.shape) for t in grads]
    if shapes[1:] != wanted[1:] or len(grads) > len(wanted) or tuple(grad.shape) != expected or reply.num_targets < 0:
        raise ServerError(f"the head sent prompt gradients {shapes}; expected {wanted}", head, ErrorCode.INTERNAL)
    scored = grads[-1][0].float() if message.num_labels else None
    return RowGrad(reply.loss_sum, reply.num_targets, grad, grads[1].float() if deep_shape else None, scored)


class SwarmLoss(torch.autograd.Function):
    """The batch's mean loss as a function of the prompts (and deep prompts), with the gradients the swarm
    computed: ``backward`` scales them by the upstream gradient (the loss is a scalar, so that is exact);
    a ``loss`` that is itself differentiable (classification's, in ``score``) gets the upstream gradient."""

    @staticmethod
    def forward(ctx, prompts: torch.Tensor, deep: torch.Tensor, loss: torch.Tensor, grad, deep_grad) -> torch.Tensor:
        ctx.save_for_backward(grad, deep_grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad, deep_grad = ctx.saved_tensors
        return grad_output * grad, grad_output * deep_grad, grad_output, None, None


def batch_loss(prompts: torch.Tensor, results: Sequence[RowGrad], deep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' mean over the batch's targets (NaN when none counts), differentiable in ``prompts``
    (and ``deep``)."""
    count = sum(r.num_targets for r in results)
    total = sum(r.loss_sum for r in results)
    loss = torch.tensor(total / count if count else float("nan"), dtype=torch.float32)
    grad = sum((r.grad for r in results), torch.zeros_like(prompts, dtype=torch.float32)) / max(count, 1)
    if deep is None:
        deep, deep_grad = torch.zeros(0), torch.zeros(0)
    else:
        deep_grad = sum((r.deep_grad for r in results), torch.zeros_like(deep, dtype=torch.float32)) / max(count, 1)
    return SwarmLoss.apply(prompts, deep, loss, grad.to(prompts.dtype), deep_grad.to(deep.dtype))
