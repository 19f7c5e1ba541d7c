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
from concurrent.futures import Executor
from typing import Callable, Mapping, Optional, Sequence

import msgspec
import torch
from hivemind.p2p import P2P, PeerID

from protocol import limits, relay
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, TrainBackward, TrainDrop, TrainForward
from protocol.records import ServerInfo
from protocol.streams import TRAIN_PROTOCOL, MessageStream, serve
from server.adapters import SpanAdapter
from server.admission import HeldBlocks, cap_owner
from server.lora import check_adapter
from server.memory import backward_bytes
from server.replies import report, send_quietly
from server.train_budget import REPLY_SHARE, KeptInputs, RowsInFlight, check_backward
from server.train_checks import IGNORE_INDEX, check_gradient, check_tensors, check_train_forward, split_train_tensors
from server.train_chunks import Backward, ChunkedSteps
from server.train_drops import serve_drop
from server.train_replay import RepliedRows, replacement, row_digest, with_hop

logger = logging.getLogger(__name__)

OPEN_TIMEOUT = 30.0  # seconds to open the stream to the next hop


async def linger(upstream: MessageStream, seconds: float = 1.0) -> None:
    """Keep a stream whose reply was just written open until the peer closes it (at most ``seconds``), so
    the reply is read before the close: a close right after the write was now and then read as a bare end of
    stream on a loaded machine (as server/subscribe.py found for refusals; seen here as a hop reporting
    "answered training step ... with the end of the stream" in benchmarks/fine_tuning.py)."""
    try:
        await asyncio.wait_for(upstream.receive(), seconds)
    except Exception:  # noqa: BLE001 - the timeout, or the peer's close: the stream closes either way
        pass


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
        max_backward_bytes: int = 0,  # one row's backward activations at most; 0: a row of max_positions_per_step's
        known_servers: Callable[[], Mapping[str, ServerInfo]] = dict,  # announced servers: upstream servers vs clients
    ):
        self.p2p, self.span, self.executor = p2p, span, executor
        self.peer_id = p2p.peer_id.to_base58()
        self.max_positions_per_step, self.step_timeout = max_positions_per_step, step_timeout
        self.kept = KeptInputs(max_kept_bytes, step_timeout)
        self.chunks = ChunkedSteps(self)  # rows longer than a step, between their laps (server/train_chunks.py)
        self.replied = RepliedRows(max_kept_bytes // REPLY_SHARE, step_timeout)  # resends (server/train_replay.py)
        # frames sized for the model's first block on, so they hold wherever a move takes this server
        deep = limits.deep_prompt_elements(span.num_blocks, span.hidden_shape[-1])
        self.max_frame_bytes = limits.train_frame_bytes(span.hidden_shape, max_positions_per_step, deep)
        steps = limits.step_tensor_elements(span.hidden_shape, max_positions_per_step)
        score = limits.MAX_NUM_LABELS * span.hidden_shape[-1]
        self.max_tensor_elements = max(steps, deep, score)  # activations, deep prompts, or score weights
        self.held = HeldBlocks(span.start, span.end, span.num_blocks)
        # train_forwards: rows (and chunks) computed forward here; train_replayed: resends answered from what was
        # replied; train_replacements: next hops replaced by a spare mid-step; train_dropped: rows forgotten on a
        # TrainDrop of their abandoned step (server/train_drops.py)
        self.stats = dict.fromkeys(("train_steps", "train_refused", "train_forwards", "train_replayed"), 0)
        self.stats["train_replacements"] = self.stats["train_dropped"] = 0
        self.rows = RowsInFlight(limits.MAX_TRAIN_STEPS_IN_FLIGHT)  # in all and per peer (server/train_budget.py)
        self.max_backward_bytes, self.known_servers = max_backward_bytes, known_servers
        self.accepting = True  # False while the server drains (SessionHandler.drain)

    @property
    def in_flight(self) -> int:
        return self.rows.total

    @property
    def max_in_flight(self) -> int:
        return self.rows.limit

    @max_in_flight.setter
    def max_in_flight(self, limit: int) -> None:
        self.rows.limit = limit

    @property
    def backward_budget(self) -> int:
        """Activation bytes one row's backward may need here (server/train_budget.py)."""
        span = self.span
        blocks, positions = span.end - span.start, self.max_positions_per_step
        return self.max_backward_bytes or backward_bytes(span.config, span.dtype, positions, blocks, span.is_tail)

    @property
    def announced_backward_budget(self) -> int:
        """What the records announce (``ServerInfo.max_backward_bytes``), so that clients size a long row's chunks
        to fit it: the budget, or 0 where the span refuses training anyway."""
        return 0 if self.span.backward_refusal() else self.backward_budget

    def use_span(self, span: SpanAdapter) -> None:
        """The span a move loaded (server/moves.py): training steps run through its blocks from now on."""
        self.span, self.held = span, HeldBlocks(span.start, span.end, span.num_blocks)

    async def start(self) -> None:
        await serve(
            self.p2p,
            TRAIN_PROTOCOL,
            self._serve,
            max_frame_bytes=self.max_frame_bytes,
            max_tensor_elements=self.max_tensor_elements,
        )

    async def _serve(self, upstream: MessageStream) -> None:
        """One request per stream: a TrainForward, answered with a TrainBackward or an ErrorReply; or a TrainDrop
        of abandoned steps (server/train_drops.py), answered in kind."""
        step_id = ""
        try:
            received = await asyncio.wait_for(upstream.receive(), limits.SESSIONLESS_TIMEOUT)
            if received is None:
                return
            message = received.message
            step_id = getattr(message, "step_id", "")
            if isinstance(message, TrainForward):
                grads, loss_sum, num_targets = await self._admitted_step(message, received.tensors, upstream)
                reply = TrainBackward(step_id=step_id, loss_sum=loss_sum, num_targets=num_targets)
                await send_quietly(upstream, reply, grads)
                self.stats["train_steps"] += 1
                await linger(upstream)
            elif isinstance(message, TrainDrop):
                await serve_drop(self, message, upstream, linger)
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
            await linger(upstream)
        except Exception as e:
            logger.exception(f"Training step {step_id!r} failed")
            await report(upstream, step_id, ProtocolError(ErrorCode.INTERNAL, repr(e)), None, self.peer_id)
            await linger(upstream)

    async def _admitted_step(
        self, message: TrainForward, tensors: list[torch.Tensor], upstream: MessageStream
    ) -> tuple[list[torch.Tensor], float, int]:
        """A step, if this server takes one now: not while it drains, and at most ``max_in_flight`` at once
        (each holds its frame, and its compute waits for the span's one compute thread), half of them for
        one client (server/train_budget.py)."""
        if not self.accepting:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "this server is shutting down")
        with self.rows.admitted(self._owner(message, upstream)):
            return await self._step(message, tensors, upstream)

    def _owner(self, message: TrainForward, upstream: Optional[MessageStream]) -> Optional[str]:
        """Whom a row counts against in the per-peer shares: its upstream peer (a client), or None for a
        server forwarding it (announced ONLINE for the route's previous hop: server/admission.py cap_owner)."""
        if upstream is None:
            return None
        upstream_peer = upstream.peer_id.to_base58()
        if 0 < message.hop_index < len(message.route):
            return cap_owner(message, upstream_peer, self.known_servers())
        return upstream_peer

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
    ) -> tuple[list[torch.Tensor], float, int]:
        """The gradients to send upstream (the input's; with deep prompts, theirs from this span's first
        block to the model's last), the row's loss sum and its target count."""
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
        hop, span = message.route[message.hop_index], self.span
        prompts_here = message.num_prompts if message.chunk_index == 0 else 0  # a long row's prompts: chunk 0 only
        positions, tail = prompts_here + len(message.token_ids), hop.end == span.num_blocks
        # a long row's chunk recomputes after its earlier positions' keys/values (server/train_chunks.py): counted;
        # a classification row's tail scores one position with the score head, it computes no logits
        logits = tail and not message.num_labels
        needed = backward_bytes(span.config, span.dtype, positions, hop.end - hop.start, logits, message.chunk_offset)
        check_backward(needed, self.backward_budget, positions, hop.end - hop.start, logits, message.chunk_offset, tail)
        if message.num_chunks > 1:
            sender = upstream.peer_id.to_base58() if upstream is not None else None
            return await self.chunks.lap(message, tensors, self._owner(message, upstream), sender)
        digest = row_digest(message, tensors)
        replied = self.replied.get(message.step_id, digest) if message.hop_index > 0 else None
        if replied is not None:  # the hop before this one was replaced and sent the same row again
            self.stats["train_replayed"] += 1
            return replied
        replied = await self._row(message, tensors, upstream)
        if message.hop_index > 0:
            self.replied.put(message.step_id, digest, replied)
        return replied

    async def _row(
        self, message: TrainForward, tensors: list[torch.Tensor], upstream: MessageStream
    ) -> tuple[list[torch.Tensor], float, int]:
        """A checked row (not in chunks) through this hop: what :meth:`_step` returns."""
        hop, hidden_size = message.route[message.hop_index], self.span.hidden_shape[0]
        inputs, deep_all, score = split_train_tensors(message, tensors)
        kept = inputs[0] if inputs else torch.zeros(0, hidden_size)
        deep = deep_rest = None  # this span's deep prompts, and those of the blocks after it
        if deep_all:
            deep, deep_rest = deep_all[0][: hop.end - hop.start], deep_all[0][hop.end - hop.start :]
        loop = asyncio.get_running_loop()
        self.stats["train_forwards"] += 1
        # 2) the tail: loss and gradient at once
        if hop.end == self.span.num_blocks:
            done = await loop.run_in_executor(self.executor, self._backward, message, kept, None, deep, score)
            return done.upstream(deep is not None, None), done.loss_sum, done.num_targets
        # 2) any other hop: forward, keep the input, wait for the next hop's gradient
        self.kept.keep(
            message.step_id, kept, *([deep] if deep is not None else []), owner=self._owner(message, upstream)
        )
        try:
            output = await loop.run_in_executor(self.executor, self._forward, message, kept, deep)
            reply, grads_out = await self._downstream_or_spare(message, output, deep_rest, score)
            kept, *deep_kept = self.kept.take_all(message.step_id)
            # 3) recompute with autograd and backpropagate
            done = await loop.run_in_executor(
                self.executor, self._backward, message, kept, grads_out[0], deep_kept[0] if deep_kept else None
            )
        finally:
            self.kept.drop(message.step_id)
        return done.upstream(deep is not None, grads_out), reply.loss_sum, reply.num_targets

    def _span_input(self, message: TrainForward, kept: torch.Tensor) -> torch.Tensor:
        """[1, positions, hidden]: at the head prompts ++ embed(ids), elsewhere the tensor received."""
        span = self.span
        kept = kept.to(span.device, span.dtype)
        if message.hop_index > 0:
            return kept.unsqueeze(0)
        with torch.no_grad():
            embedded = span.embed_tokens(torch.tensor(message.token_ids, device=span.device))
        return torch.cat([kept, embedded]).unsqueeze(0)

    def _forward(self, message: TrainForward, kept: torch.Tensor, deep: Optional[torch.Tensor]) -> torch.Tensor:
        hop = message.route[message.hop_index]
        with torch.no_grad(), self._adapter(message):
            output = self.span.train_span(self._span_input(message, kept), range(hop.start, hop.end), deep)
        return output[0].float()

    def _backward(
        self,
        message: TrainForward,
        kept: torch.Tensor,
        grad_out: Optional[torch.Tensor],
        deep: Optional[torch.Tensor] = None,
        score: Sequence[torch.Tensor] = (),
    ) -> "Backward":
        """Recompute the span from its input (and deep prompts) with autograd; backpropagate ``grad_out``
        (None at the tail: the loss sum's own gradient, from the LM head or the ``score`` weights). The
        gradients of the input (the prompts' rows at the head) and of this span's deep prompts."""
        hop, span = message.route[message.hop_index], self.span
        done = Backward()
        with torch.enable_grad(), self._adapter(message):
            leaf = kept.to(span.device, span.dtype).detach().requires_grad_(True)
            deep_leaf = None if deep is None else deep.to(span.device, span.dtype).detach().requires_grad_(True)
            output = span.train_span(self._span_input(message, leaf), range(hop.start, hop.end), deep_leaf)
            if grad_out is None:
                if score:
                    loss, done.num_targets, done.scored = self._score_loss(message, output, score[0])
                else:
                    loss, done.num_targets = self._loss_sum(message, output)
                done.loss_sum = float(loss.detach())
                if done.num_targets:
                    loss.backward()
            else:
                torch.autograd.backward(output, grad_out.to(output.device, output.dtype).unsqueeze(0))
        done.grad = (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).float().cpu()
        if deep_leaf is not None:
            deep_grad = deep_leaf.grad if deep_leaf.grad is not None else torch.zeros_like(deep_leaf)
            done.deep_grad = deep_grad.float().cpu()
        return done

    def _score_loss(
        self, message: TrainForward, output: torch.Tensor, score: torch.Tensor
    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Sequence classification: the final (normed) hidden state of the row's last position, scored with
        the client's weights; cross-entropy against the class ``label``, or the squared error of the one
        value (regression), as transformers' LlamaForSequenceClassification (one row: its sum is its mean)."""
        last = self.span.train_final_hidden(output[:, -1:])[0].float()  # [1, hidden]
        logits = last @ score.to(last.device).t()  # [1, num_labels]
        if message.multi_labels:  # mean BCE-with-logits over the labels (transformers: over batch x labels)
            targets = torch.tensor(message.multi_labels, device=last.device)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[0], targets)
        elif message.num_labels == 1:
            loss = (logits[0, 0] - message.label) ** 2
        else:
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor([int(message.label)], device=last.device))
        return loss, 1, last.detach().cpu()

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

    async def _downstream_or_spare(
        self,
        message: TrainForward,
        output: torch.Tensor,
        deep_rest: Optional[torch.Tensor],
        score: Sequence[torch.Tensor],
    ) -> tuple[TrainBackward, list[torch.Tensor]]:
        """:meth:`_downstream`; if the next hop itself fails, once more through a spare of its blocks
        (server/train_replay.py): this hop's output goes again, nothing here is computed again."""
        try:
            return await self._downstream(message, output, deep_rest, score)
        except ProtocolError as e:
            spare = replacement(message, e)
            if spare is None:
                raise
            logger.warning(f"Training step {message.step_id!r}: {e}; sending it to spare {spare.peer_id} instead")
            self.stats["train_replacements"] += 1
            return await self._downstream(with_hop(message, message.hop_index + 1, spare), output, deep_rest, score)

    async def _downstream(
        self,
        message: TrainForward,
        output: torch.Tensor,
        deep_rest: Optional[torch.Tensor],
        score: Sequence[torch.Tensor] = (),
    ) -> tuple[TrainBackward, list[torch.Tensor]]:
        """Send the row (and the deep prompts of the blocks after this span) on to the next hop and wait
        for its TrainBackward (an ErrorReply is relayed): the gradients it sent, checked."""
        tensors = [output] + ([deep_rest.contiguous()] if deep_rest is not None else []) + list(score)
        reply, grads = await self._exchange(message, tensors)
        try:
            check_tensors(grads[:1], output.shape[0], output.shape[1], "the next hop's gradient")
            expected = 1 + (deep_rest is not None) + bool(score)
            if len(grads) != expected:
                why = f"the next hop sent {len(grads)} tensors; expected {expected}"
                raise ProtocolError(ErrorCode.BAD_REQUEST, why)
            if deep_rest is not None:
                check_gradient(grads[1:2], tuple(deep_rest.shape), "the next hop's deep prompt gradient")
            if score:
                check_gradient(grads[-1:], (1, output.shape[1]), "the scored hidden state")
        except ProtocolError as e:
            next_peer = message.route[message.hop_index + 1].peer_id
            raise ProtocolError(ErrorCode.DOWNSTREAM_FAILED, e.message, peer_id=next_peer) from None
        return reply, grads

    async def _exchange(
        self, message: TrainForward, tensors: list[torch.Tensor]
    ) -> tuple[TrainBackward, list[torch.Tensor]]:
        """``message`` with ``tensors`` to the next hop, and its TrainBackward with the tensors it carries (an
        ErrorReply is relayed; a failure to reach it, or any other answer, is downstream_failed)."""
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
            await stream.send(msgspec.structs.replace(message, hop_index=message.hop_index + 1), tensors)
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
        return reply, received.tensors
