"""The training protocol: one row of a training step through this server's span, forward then backward.

The backward lap is the mirror of the forward one (docs/design.md, "Fine-tuning"). On a stream from the
client (head) or the previous hop:
  1) a TrainForward arrives and is checked (server/train_checks.py);
  2) the tail computes its blocks, the final norm and the LM head with autograd, the sum of the row's
     target cross-entropies after the prompt positions, and at once the gradient of its input;
     any other hop computes its blocks without autograd, keeps its input (KeptInputs: bounded in
     bytes and time), sends the output on to the next hop and waits for that hop's TrainBackward;
  3) it recomputes its span from the kept input with autograd, backpropagates the gradient it received
     (weights frozen: only the input gets a gradient) and frees the input;
  4) it replies upstream with TrainBackward and the gradient of its input; the head sends the client
     only the prompts' rows.
A failure anywhere goes back upstream as an ErrorReply, relayed hop by hop, and frees what the step held.
No session is opened and no cache is touched: inference goes on beside training unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Executor
from typing import Optional

import msgspec
import torch
from hivemind.p2p import P2P, PeerID

from protocol import limits, relay
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, TrainBackward, TrainForward
from protocol.streams import TRAIN_PROTOCOL, MessageStream, serve
from server.adapters import SpanAdapter
from server.admission import HeldBlocks
from server.lora import check_adapter
from server.replies import report, send_quietly
from server.train_checks import IGNORE_INDEX, check_tensors, check_train_forward

logger = logging.getLogger(__name__)

OPEN_TIMEOUT = 30.0  # seconds to open the stream to the next hop


class KeptInputs:
    """Span inputs kept between a step's forward and its backward, by step id: at most ``max_bytes`` in
    all (a step that does not fit is refused ``busy``), each for at most ``timeout`` seconds."""

    def __init__(self, max_bytes: int, timeout: float):
        self.max_bytes, self.timeout = max_bytes, timeout
        self._held: dict[str, tuple[torch.Tensor, float]] = {}

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._held.values())

    def __contains__(self, step_id: str) -> bool:
        self._expire()
        return step_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, step_id: str, tensor: torch.Tensor) -> None:
        self._expire()
        if step_id in self._held:
            raise ProtocolError(ErrorCode.SESSION_EXISTS, f"training step {step_id!r} is already in flight here")
        size = tensor.numel() * tensor.element_size()
        if self.bytes + size > self.max_bytes:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"no room to keep a training step's input ({size} bytes): {self.bytes} of {self.max_bytes} "
                "bytes are held for other steps",
            )
        self._held[step_id] = (tensor, time.monotonic() + self.timeout)

    def take(self, step_id: str) -> torch.Tensor:
        """The input kept for ``step_id``, freed here; unknown (expired) steps are a named error."""
        self._expire()
        if step_id not in self._held:
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"no input of training step {step_id!r} is held here (its backward came after "
                f"{self.timeout:.0f} s, or it never ran)",
            )
        return self._held.pop(step_id)[0]

    def drop(self, step_id: str) -> None:
        self._held.pop(step_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for step_id in [s for s, (_, deadline) in self._held.items() if deadline < now]:
            del self._held[step_id]


class TrainingHandler:
    """Serves the training protocol over a span, computing on the span's compute thread (``executor``)."""

    def __init__(
        self,
        p2p: P2P,
        span: SpanAdapter,
        executor: Executor,
        *,
        max_positions_per_step: int = limits.DEFAULT_MAX_POSITIONS_PER_STEP,
        max_kept_bytes: int = limits.DEFAULT_MAX_TRAIN_MIB << 20,
        step_timeout: float = limits.TRAIN_STEP_TIMEOUT,
    ):
        self.p2p, self.span, self.executor = p2p, span, executor
        self.peer_id = p2p.peer_id.to_base58()
        self.max_positions_per_step, self.step_timeout = max_positions_per_step, step_timeout
        self.kept = KeptInputs(max_kept_bytes, step_timeout)
        self.max_frame_bytes = limits.train_frame_bytes(span.hidden_shape, max_positions_per_step)
        self.max_tensor_elements = limits.step_tensor_elements(span.hidden_shape, max_positions_per_step)
        self.held = HeldBlocks(span.start, span.end, span.num_blocks)
        self.stats = {"train_steps": 0, "train_refused": 0}
        self.in_flight, self.max_in_flight = 0, limits.MAX_TRAIN_STEPS_IN_FLIGHT
        self.accepting = True  # False while the server drains (SessionHandler.drain)

    async def start(self) -> None:
        await serve(
            self.p2p,
            TRAIN_PROTOCOL,
            self._serve,
            max_frame_bytes=self.max_frame_bytes,
            max_tensor_elements=self.max_tensor_elements,
        )

    async def _serve(self, upstream: MessageStream) -> None:
        """One request per stream: a TrainForward, answered with a TrainBackward or an ErrorReply."""
        step_id = ""
        try:
            received = await asyncio.wait_for(upstream.receive(), limits.SESSIONLESS_TIMEOUT)
            if received is None:
                return
            message = received.message
            step_id = getattr(message, "step_id", "")
            if isinstance(message, TrainForward):
                grad, loss_sum, num_targets = await self._admitted_step(message, received.tensors, upstream)
                reply = TrainBackward(step_id=step_id, loss_sum=loss_sum, num_targets=num_targets)
                await send_quietly(upstream, reply, [grad])
                self.stats["train_steps"] += 1
            elif isinstance(message, TrainBackward):
                self._stray_backward(message)
            else:
                kind = type(message).__name__
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {kind} on the training protocol")
        except asyncio.TimeoutError:
            return
        except ProtocolError as e:
            self.stats["train_refused"] += 1
            await report(upstream, step_id, e, None, self.peer_id)
        except Exception as e:
            logger.exception(f"Training step {step_id!r} failed")
            await report(upstream, step_id, ProtocolError(ErrorCode.INTERNAL, repr(e)), None, self.peer_id)

    async def _admitted_step(
        self, message: TrainForward, tensors: list[torch.Tensor], upstream: MessageStream
    ) -> tuple[torch.Tensor, float, int]:
        """A step, if this server takes one now: not while it drains, and at most ``max_in_flight`` at once
        (each holds its frame, and its compute waits for the span's one compute thread)."""
        if not self.accepting:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "this server is shutting down")
        if self.in_flight >= self.max_in_flight:
            raise ProtocolError(ErrorCode.BUSY, f"{self.in_flight} training steps are in flight here already")
        self.in_flight += 1
        try:
            return await self._step(message, tensors, upstream)
        finally:
            self.in_flight -= 1

    def _stray_backward(self, message: TrainBackward) -> None:
        """A TrainBackward sent as a request: never valid (it comes back on the forward's own stream)."""
        if message.step_id in self.kept:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"the backward of training step {message.step_id!r} comes back on the stream its forward went out on",
            )
        raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"no training step {message.step_id!r} is held here")

    async def _step(
        self, message: TrainForward, tensors: list[torch.Tensor], upstream: MessageStream
    ) -> tuple[torch.Tensor, float, int]:
        """The gradient to send upstream, the row's loss sum and its target count."""
        # 1) check
        refusal = self.span.backward_refusal()
        if refusal:
            raise ProtocolError(ErrorCode.BAD_REQUEST, refusal)
        hidden_size = self.span.hidden_shape[0]
        check_train_forward(
            message,
            tensors,
            self.peer_id,
            upstream.peer_id.to_base58(),
            self.held,
            hidden_size,
            self.span.vocab_size,
            self.max_positions_per_step,
        )
        check_adapter(message.active_adapter, self.span.lora)
        kept = tensors[0] if tensors else torch.zeros(0, hidden_size)
        loop = asyncio.get_running_loop()
        # 2) the tail: loss and gradient at once
        if message.route[message.hop_index].end == self.span.num_blocks:
            return await loop.run_in_executor(self.executor, self._backward, message, kept, None)
        # 2) any other hop: forward, keep the input, wait for the next hop's gradient
        self.kept.keep(message.step_id, kept)
        try:
            output = await loop.run_in_executor(self.executor, self._forward, message, kept)
            reply, grad_out = await self._downstream(message, output)
            kept = self.kept.take(message.step_id)
            # 3) recompute with autograd and backpropagate
            grad, _, _ = await loop.run_in_executor(self.executor, self._backward, message, kept, grad_out)
        finally:
            self.kept.drop(message.step_id)
        return grad, reply.loss_sum, reply.num_targets

    def _span_input(self, message: TrainForward, kept: torch.Tensor) -> torch.Tensor:
        """[1, positions, hidden]: at the head prompts ++ embed(ids), elsewhere the tensor received."""
        span = self.span
        kept = kept.to(span.device, span.dtype)
        if message.hop_index > 0:
            return kept.unsqueeze(0)
        with torch.no_grad():
            embedded = span.embed_tokens(torch.tensor(message.token_ids, device=span.device))
        return torch.cat([kept, embedded]).unsqueeze(0)

    def _forward(self, message: TrainForward, kept: torch.Tensor) -> torch.Tensor:
        hop = message.route[message.hop_index]
        with torch.no_grad(), self._adapter(message):
            output = self.span.train_span(self._span_input(message, kept), range(hop.start, hop.end))
        return output[0].float()

    def _backward(
        self, message: TrainForward, kept: torch.Tensor, grad_out: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, float, int]:
        """Recompute the span from its input with autograd; backpropagate ``grad_out`` (None at the tail:
        the loss sum's own gradient). The gradient of the input (the prompts' rows at the head)."""
        hop, span = message.route[message.hop_index], self.span
        with torch.enable_grad(), self._adapter(message):
            leaf = kept.to(span.device, span.dtype).detach().requires_grad_(True)
            output = span.train_span(self._span_input(message, leaf), range(hop.start, hop.end))
            loss_sum, num_targets = 0.0, 0
            if grad_out is None:
                loss, num_targets = self._loss_sum(message, output)
                loss_sum = float(loss.detach())
                if num_targets:
                    loss.backward()
            else:
                torch.autograd.backward(output, grad_out.to(output.device, output.dtype).unsqueeze(0))
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        return grad.float().cpu(), loss_sum, num_targets

    def _adapter(self, message: TrainForward) -> contextlib.AbstractContextManager:
        """The LoRA adapter the row asks for, applied to its blocks (server/lora.py; checked on arrival)."""
        lora = self.span.lora
        return lora.using(message.active_adapter) if lora is not None else contextlib.nullcontext()

    def _loss_sum(self, message: TrainForward, output: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The sum of the row's target cross-entropies over the ids' positions (prompts dropped)."""
        logits = self.span.train_logits(output[:, message.num_prompts :])
        targets = torch.tensor(message.targets, device=logits.device)
        loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, int((targets != IGNORE_INDEX).sum())

    async def _downstream(self, message: TrainForward, output: torch.Tensor) -> tuple[TrainBackward, torch.Tensor]:
        """Send the row on to the next hop and wait for its TrainBackward (an ErrorReply is relayed)."""
        next_hop = message.route[message.hop_index + 1]
        relay.remember(next_hop.peer_id, next_hop.addrs)
        stream: Optional[MessageStream] = None
        try:
            stream = await asyncio.wait_for(
                MessageStream.open(
                    self.p2p,
                    PeerID.from_base58(next_hop.peer_id),
                    TRAIN_PROTOCOL,
                    max_frame_bytes=self.max_frame_bytes,
                    max_tensor_elements=self.max_tensor_elements,
                ),
                OPEN_TIMEOUT,
            )
            await stream.send(msgspec.structs.replace(message, hop_index=message.hop_index + 1), [output])
            received = await asyncio.wait_for(stream.receive(), self.step_timeout)
        except Exception as e:
            raise ProtocolError(
                ErrorCode.DOWNSTREAM_FAILED,
                f"next server {next_hop.peer_id} failed in training step {message.step_id!r}: {e!r}",
                peer_id=next_hop.peer_id,
            ) from None
        finally:
            if stream is not None:
                stream.close()
        reply = received.message if received is not None else None
        if isinstance(reply, ErrorReply):
            raise ProtocolError(reply.code, reply.message, peer_id=reply.peer_id or next_hop.peer_id)
        if not isinstance(reply, TrainBackward) or reply.step_id != message.step_id:
            what = type(reply).__name__ if reply is not None else "the end of the stream"
            raise ProtocolError(
                ErrorCode.DOWNSTREAM_FAILED,
                f"next server {next_hop.peer_id} answered training step {message.step_id!r} with {what}",
                peer_id=next_hop.peer_id,
            )
        try:
            check_tensors(received.tensors, output.shape[0], output.shape[1], "the next hop's gradient")
        except ProtocolError as e:
            raise ProtocolError(ErrorCode.DOWNSTREAM_FAILED, e.message, peer_id=next_hop.peer_id) from None
        return reply, received.tensors[0]
