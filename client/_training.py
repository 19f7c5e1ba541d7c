"""A training step through the swarm: each row's loss and the gradient of the client's prompts.

The client holds no weights, so the loss and its gradient are computed by the servers (docs/design.md,
"Fine-tuning"): one TrainForward per row goes to the head on the training protocol with the prompts,
the row's ids and its targets; the lap runs forward to the tail, which computes the loss sum and
starts the backward, and the head answers with the prompts' gradient. So one round trip per row
gives both, and ``SwarmLoss`` hands that gradient to autograd when the caller runs ``backward()``.

Failover is whole-step: a retryable failure anywhere blames the route (``SwarmClient.blame``) and
runs every row again on a new route; nothing of a failed step stays on any server.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Sequence

import torch
from hivemind.p2p import PeerID

from client import _loop
from client._remote_session import _error_from
from client._swarm import SwarmClient
from client.errors import GenerationError, ServerError, ServerTimeout
from protocol import limits, relay
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, Hop, TrainBackward, TrainForward
from protocol.streams import TRAIN_PROTOCOL, MessageStream

logger = logging.getLogger(__name__)

MAX_FAILOVERS = 3


@dataclass
class RowGrad:
    loss_sum: float  # the sum of the row's target cross-entropies
    num_targets: int
    grad: torch.Tensor  # [num_prompts, hidden] float32: d loss_sum / d prompts


@dataclass
class TrainRow:
    token_ids: list[int]  # the row without padding
    targets: list[int]  # per id, the token its logits are scored against; -100: none


async def train_rows(
    swarm: SwarmClient, prompts: torch.Tensor, rows: Sequence[TrainRow], timeout: float
) -> tuple[list[RowGrad], list[Hop]]:
    """Every row's loss sum and prompt gradient on one route (all rows at once), and that route;
    a retryable failure runs the whole step again on a new route, at most MAX_FAILOVERS times."""
    failovers = 0
    while True:
        route = await swarm.plan_route()
        try:
            limit = swarm.route_step_limit(route)
            for row in rows:
                if prompts.shape[0] + len(row.token_ids) > limit:
                    raise ValueError(
                        f"a training row of {prompts.shape[0]} prompts + {len(row.token_ids)} ids exceeds the "
                        f"route's {limit} positions per step (long rows are not chunked yet)"
                    )
            coros = [train_row(swarm, route, prompts, row, timeout) for row in rows]
            return await _loop.all_or_none(coros), route
        except ServerError as e:
            if not e.retryable or failovers >= MAX_FAILOVERS:
                if e.retryable:
                    raise GenerationError(f"the training step failed after {failovers} failovers: {e}") from e
                raise
            failovers += 1
            logger.warning(f"Training step failed ({e}); running it again on a new route")
            await swarm.blame(route, e)
        finally:
            swarm.router.release(route)


async def train_row(
    swarm: SwarmClient, route: list[Hop], prompts: torch.Tensor, row: TrainRow, timeout: float
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
        active_adapter=swarm.active_adapter,
    )
    tensors = [prompts.detach().float().cpu().contiguous()] if prompts.shape[0] else []
    hidden = prompts.shape[1]
    relay.remember(head, route[0].addrs)
    stream = None
    try:
        stream = await MessageStream.open(
            swarm.p2p,
            PeerID.from_base58(head),
            TRAIN_PROTOCOL,
            max_frame_bytes=limits.train_frame_bytes((hidden,), max(1, prompts.shape[0])),
            max_tensor_elements=max(1, prompts.shape[0]) * hidden,
        )
        await stream.send(message, tensors)
        received = await asyncio.wait_for(stream.receive(), timeout)
    except asyncio.TimeoutError:
        raise ServerTimeout(f"no answer to a training step within {timeout:.0f} s", head, ErrorCode.DOWNSTREAM_FAILED)
    except Exception as e:  # the dial, the send, or a frame we refused
        raise ServerError(f"could not reach the server: {e!r}", head, ErrorCode.DOWNSTREAM_FAILED) from None
    finally:
        if stream is not None:
            stream.close()
    return _row_grad(received, message, head, hidden)


def _row_grad(received, message: TrainForward, head: str, hidden: int) -> RowGrad:
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
    if len(grads) > 1 or tuple(grad.shape) != expected or reply.num_targets < 0:
        shapes = [tuple(t.shape) for t in grads]
        raise ServerError(f"the head sent prompt gradients {shapes}; expected {expected}", head, ErrorCode.INTERNAL)
    return RowGrad(reply.loss_sum, reply.num_targets, grad)


class SwarmLoss(torch.autograd.Function):
    """The batch's mean loss as a function of the prompts, with the gradient the swarm computed:
    ``backward`` scales it by the upstream gradient (the loss is a scalar, so that is exact)."""

    @staticmethod
    def forward(ctx, prompts: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad_output * grad, None, None


def batch_loss(prompts: torch.Tensor, results: Sequence[RowGrad]) -> torch.Tensor:
    """transformers' mean over the batch's targets (NaN when none counts), differentiable in ``prompts``."""
    count = sum(r.num_targets for r in results)
    total = sum(r.loss_sum for r in results)
    loss = torch.tensor(total / count if count else float("nan"), dtype=torch.float32)
    grad = sum((r.grad for r in results), torch.zeros_like(prompts, dtype=torch.float32)) / max(count, 1)
    return SwarmLoss.apply(prompts, loss, grad.to(prompts.dtype))
