"""A training row longer than a step, in chunks: what a hop keeps between the row's laps, and how it runs them.

docs/design.md, "Long rows in chunks". A row of ``num_chunks`` chunks is one step id and ``2 * num_chunks - 1``
laps, each a TrainForward on its own stream from the client through the route:
  - forward laps 0..n-2: each hop runs the chunk through its blocks without autograd after the keys and values
    it keeps of the row's earlier chunks, keeps the chunk's input and its keys/values, and sends the output on;
    the tail keeps them too and answers with an empty TrainBackward;
  - the last chunk's lap runs forward to the tail, which computes that chunk's loss and its backward, and each
    hop then recomputes the chunk with autograd from its kept input and the earlier keys/values as leaves: the
    gradient of its input goes upstream, the gradients of the earlier keys/values are added to what it keeps;
  - backward laps n-2..0 (``backward_only``, no tensors): each hop first asks the next hop, then recomputes the
    chunk and backpropagates both the gradient of its output and the gradients later chunks gave its keys and
    values. After chunk 0's lap the hop frees the row.
So every gradient is exact (the same sums as one pass over the whole row, in other orders), each lap computes at
most one step's positions, and what a row holds here counts against --max-train-mib (server/train_budget.py).
Deep prompts sit at the row's start: chunk 0's forward lap brings them (each hop keeps its span's rows and sends
the rest on), and chunk 0's backward lap, the last, returns their gradients, which by then hold every later
chunk's share through the keys/values. A classification row's scored position is its last: the last chunk's lap
brings the score weights to the tail, which scores that chunk's last position and sends the hidden state back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import msgspec
import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import TrainBackward, TrainForward
from server.admission import check_tensors
from server.train_checks import check_gradient, split_train_tensors
from server.train_drops import DroppedSteps


@dataclass
class Backward:
    """What one hop's backward computed: the gradients of its input and of its deep prompts, and at the
    tail the row's loss sum, its target count and the hidden state it scored (classification)."""

    grad: Optional[torch.Tensor] = None
    deep_grad: Optional[torch.Tensor] = None
    loss_sum: float = 0.0
    num_targets: int = 0
    scored: Optional[torch.Tensor] = None  # [1, hidden]

    def upstream(self, deep: bool, downstream: Optional[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The TrainBackward's tensors: the input's gradient, the deep prompts' gradients of this span and
        of every block after it (``downstream``: what the next hop sent), and the scored hidden state."""
        tensors = [self.grad]
        if deep:
            tensors.append(self.deep_grad if downstream is None else torch.cat([self.deep_grad, downstream[1]]))
        scored = self.scored if downstream is None else (downstream[-1] if len(downstream) > 1 + deep else None)
        return tensors + ([scored] if scored is not None else [])


class TrainCache:
    """The cache one chunk's pass runs with, duck-typed as transformers' ``Cache.update`` (the one call a decoder
    layer makes): each block's keys and values of the ``offset`` earlier positions, before the chunk's own, which
    it records as the pass makes them (under autograd when the hop recomputes the chunk)."""

    def __init__(self, offset: int, past: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.offset, self.past = offset, past
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.new[layer_idx] = (key, value)
        if layer_idx not in self.past:
            return key, value
        past_key, past_value = self.past[layer_idx]
        return torch.cat([past_key, key], dim=-2), torch.cat([past_value, value], dim=-2)


@dataclass
class ChunkedRow:
    """What a hop keeps of one row between its laps."""

    num_chunks: int
    owner: Optional[str]  # whom its kept tensors count against (None: a server forwarding it), as chunk 0 found
    kind: tuple = ()  # what every lap of the row must repeat: prompts, deep prompts, labels (:func:`row_kind`)
    sender: Optional[str] = None  # the peer chunk 0 came from: every later lap must come from it too
    deep: Optional[torch.Tensor] = None  # this span's deep prompts (chunk 0's), for chunk 0's backward lap
    ids: list[list[int]] = field(default_factory=list)  # each forwarded chunk's ids and targets
    targets: list[list[int]] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)  # each chunk's input (the head: its prompts, or none)
    positions: int = 0  # positions forwarded so far (prompts included)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # per block: keys of the forwarded positions
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    key_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # their gradients from later chunks
    value_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    next_backward: int = -1  # the chunk whose backward lap comes next (-1: still forwarding)
    busy: bool = False
    dropped: bool = False  # its client abandoned the step while a lap was in flight: forgotten when it ends

    def tensors(self) -> list[torch.Tensor]:
        deep = [self.deep] if self.deep is not None else []
        return [*self.inputs, *deep, *self.keys.values(), *self.values.values(), *self.key_grads.values()] + list(
            self.value_grads.values()
        )


def row_kind(message: TrainForward) -> tuple:
    """What a row's laps must agree on: its prompts, deep prompts and classification labels."""
    return (
        message.num_prompts,
        message.deep_prompts,
        message.num_labels,
        message.label,
        tuple(message.multi_labels),
        message.active_adapter,
    )


class ChunkedSteps:
    """The rows in chunks that pass through one training handler's span."""

    def __init__(self, handler: Any):  # server/training.py TrainingHandler (which imports this module)
        self.handler = handler
        self.rows: dict[str, ChunkedRow] = {}
        self.dropped = DroppedSteps(handler.step_timeout)  # steps their clients abandoned (server/train_drops.py)

    def __len__(self) -> int:
        self._expire()
        return len(self.rows)

    async def lap(
        self, message: TrainForward, tensors: list[torch.Tensor], owner: Optional[str], sender: Optional[str] = None
    ) -> tuple[list[torch.Tensor], float, int]:
        """One lap of a row in chunks: the tensors to send upstream, and the loss sum and target count the tail
        found for this lap's chunk (0 on forward-only laps). A failure frees the row here. ``owner``: whom a new
        row counts against; ``sender``: the upstream peer, which a later lap must share with chunk 0 (the owner
        is not compared: whether the sender reads as a server comes from the DHT records, which may lapse)."""
        row = self._row(message, owner, sender)
        row.busy = True
        try:
            return await self._lap(message, tensors, row)
        except BaseException:
            self.forget(message.step_id)
            raise
        finally:
            row.busy = False
            if row.dropped:
                self.forget(message.step_id)

    def forget(self, step_id: str) -> None:
        self.rows.pop(step_id, None)
        self.handler.kept.drop(step_id)

    def owner_of(self, step_id: str):
        """The owner of the row held for ``step_id``; False when none is."""
        row = self.rows.get(step_id)
        return False if row is None else row.owner

    def drop(self, step_id: str) -> None:
        """The client abandoned the step (server/train_drops.py): forget its row now, or when its lap ends."""
        row = self.rows.get(step_id)
        if row is not None and row.busy:
            row.dropped = True
        else:
            self.forget(step_id)

    def _expire(self) -> None:
        """Rows whose kept tensors expired (server/train_budget.py KeptInputs) are gone."""
        kept = self.handler.kept
        for step_id in [s for s, row in self.rows.items() if not row.busy and s not in kept]:
            self.rows.pop(step_id)

    def _row(self, message: TrainForward, owner: Optional[str], sender: Optional[str] = None) -> ChunkedRow:
        """The row this lap belongs to, checked to be the lap that comes next."""
        self._expire()
        step_id, index = message.step_id, message.chunk_index
        if step_id in self.dropped:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"training step {step_id!r} was dropped by its client")
        row = self.rows.get(step_id)
        if row is None or row.sender != sender:
            if index == 0 and not message.backward_only and row is None:
                row = self.rows[step_id] = ChunkedRow(message.num_chunks, owner, row_kind(message), sender=sender)
                return row
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"no training step {step_id!r} is held here for chunk {index} (its earlier laps never came here, "
                f"or it expired after {self.handler.kept.timeout:.0f} s)",
            )
        if row.busy:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a lap of training step {step_id!r} is in flight here already")
        if message.backward_only:
            expected = f"the backward lap of chunk {row.next_backward}"
            ok = index == row.next_backward and row.ids[index] == message.token_ids
            ok = ok and row.targets[index] == message.targets
        else:
            expected = f"chunk {len(row.ids)} at offset {row.positions}"
            ok = row.next_backward < 0 and index == len(row.ids) and message.chunk_offset == row.positions
        if ok and row_kind(message) != row.kind:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"training step {step_id!r}: chunk {index}'s prompts, deep prompts, labels or adapter differ from "
                "its chunk 0's",
            )
        if not ok or message.num_chunks != row.num_chunks:
            lap = "backward lap" if message.backward_only else "chunk"
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"training step {step_id!r}: {lap} {index} of {message.num_chunks} at offset {message.chunk_offset} "
                f"is out of order; expected {expected} of {row.num_chunks}",
            )
        return row

    def _keep(self, step_id: str, row: ChunkedRow) -> None:
        """Count the row's tensors against --max-train-mib (busy past it) and restart its timeout."""
        kept = self.handler.kept
        kept.drop(step_id)
        tensors = row.tensors()
        kept.keep(step_id, *tensors, owner=row.owner)

    async def _lap(
        self, message: TrainForward, tensors: list[torch.Tensor], row: ChunkedRow
    ) -> tuple[list[torch.Tensor], float, int]:
        handler = self.handler
        span, hop = handler.span, message.route[message.hop_index]
        tail, index = hop.end == span.num_blocks, message.chunk_index
        last = index == message.num_chunks - 1
        run = asyncio.get_running_loop().run_in_executor
        downstream, loss_sum, num_targets, score = None, 0.0, 0, []
        if message.backward_only:
            if not tail:
                rows = len(message.token_ids) + self._prompts(message)
                deep_rest = [self._deep_rest_shape(message)] if index == 0 and row.deep is not None else []
                reply, downstream = await self._next(message, [], rows, deep_rest)
                loss_sum, num_targets = reply.loss_sum, reply.num_targets
        else:
            handler.stats["train_forwards"] += 1
            inputs, deep_all, score = split_train_tensors(message, tensors)
            row.ids.append(list(message.token_ids))
            row.targets.append(list(message.targets))
            row.inputs.append(inputs[0] if inputs else torch.zeros(0, span.hidden_shape[0]))
            row.positions += self._prompts(message) + len(message.token_ids)
            extra = []  # what goes on beside the output: the later blocks' deep prompts, the score weights
            if deep_all:
                own = hop.end - hop.start
                row.deep, extra = deep_all[0][:own], [deep_all[0][own:].contiguous()]
            extra += score
            output = None
            if not (tail and last):
                output = await run(handler.executor, self._forward, message, row, not last)
            if not last:
                if not tail:
                    await self._next(message, [output, *extra], None)
                self._keep(message.step_id, row)
                return [], 0.0, 0
            if not tail:
                scored = [(1, span.hidden_shape[0])] if score else []
                reply, downstream = await self._next(message, [output, *extra], output.shape[0], scored)
                loss_sum, num_targets = reply.loss_sum, reply.num_targets
        grad_out = downstream[0] if downstream is not None else None
        done = await run(handler.executor, self._backward, message, row, grad_out, score)
        if tail:
            loss_sum, num_targets = done.loss_sum, done.num_targets
        deep_here = index == 0 and row.deep is not None
        row.next_backward = index - 1
        if row.next_backward < 0:
            self.forget(message.step_id)
        else:
            self._keep(message.step_id, row)
        upstream = done.upstream(deep_here, downstream)
        if message.hop_index == 0 and not done.grad.shape[0]:  # the head without prompts in this chunk
            upstream = upstream[1:]
        return upstream, loss_sum, num_targets

    def _deep_rest_shape(self, message: TrainForward) -> tuple[int, ...]:
        """The shape of the deep prompts' gradient the next hop returns: those of the blocks after this span."""
        span = self.handler.span
        return (span.num_blocks - message.route[message.hop_index].end, message.num_prompts, span.hidden_shape[0])

    @staticmethod
    def _prompts(message: TrainForward) -> int:
        return message.num_prompts if message.chunk_index == 0 else 0

    async def _next(
        self,
        message: TrainForward,
        tensors: list[torch.Tensor],
        grad_rows: Optional[int],
        more: Sequence[tuple[int, ...]] = (),
    ) -> tuple[TrainBackward, Optional[list[torch.Tensor]]]:
        """The lap sent on to the next hop; its reply, with the gradient of this hop's output (``grad_rows`` rows;
        None: a forward-only lap, whose reply carries no tensor) and then one tensor of each shape in ``more``
        (the later blocks' deep prompt gradients, the scored hidden state), checked."""
        reply, grads = await self.handler._exchange(message, tensors)
        try:
            if grad_rows is None:
                if grads:
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST, f"a forward-only lap's reply carried {len(grads)} tensors"
                    )
                return reply, None
            if len(grads) != 1 + len(more):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"the next hop sent {len(grads)} tensors; expected {1 + len(more)}"
                )
            check_tensors(grads[:1], grad_rows, self.handler.span.hidden_shape[0], "the next hop's gradient")
            for tensor, shape in zip(grads[1:], more):
                check_gradient([tensor], shape, "the next hop's deep prompt gradient or scored hidden state")
        except ProtocolError as e:
            next_peer = message.route[message.hop_index + 1].peer_id
            raise ProtocolError(ErrorCode.DOWNSTREAM_FAILED, e.message, peer_id=next_peer) from None
        return reply, grads

    def _forward(self, message: TrainForward, row: ChunkedRow, keep: bool) -> torch.Tensor:
        """The chunk through this hop's blocks after the row's kept keys/values, without autograd; with ``keep``
        its own keys/values are kept for the chunks after it."""
        handler, span = self.handler, self.handler.span
        hop = message.route[message.hop_index]
        cache = TrainCache(message.chunk_offset, {i: (row.keys[i], row.values[i]) for i in row.keys})
        deep = row.deep if message.chunk_index == 0 else None
        with torch.no_grad(), handler._adapter(message):
            hidden = handler._span_input(message, row.inputs[message.chunk_index])
            output = span.train_span(hidden, range(hop.start, hop.end), deep, cache)
        if keep:
            for i, (key, value) in cache.new.items():
                row.keys[i] = torch.cat([row.keys[i], key], dim=-2) if i in row.keys else key
                row.values[i] = torch.cat([row.values[i], value], dim=-2) if i in row.values else value
        return output[0].float()

    def _backward(
        self, message: TrainForward, row: ChunkedRow, grad_out: Optional[torch.Tensor], score: list[torch.Tensor]
    ) -> Backward:
        """Recompute the chunk with autograd, the earlier keys/values as leaves (chunk 0: its deep prompts too);
        backpropagate the gradient of its output (None at the tail: its loss sum's, or with ``score`` the
        classification loss of the chunk's last position) and what later chunks gave its own keys/values. The
        gradients of its input (and deep prompts) come back; the earlier keys/values' are added to the row's."""
        handler, span = self.handler, self.handler.span
        hop, index, offset = message.route[message.hop_index], message.chunk_index, message.chunk_offset
        done = Backward()
        with torch.enable_grad(), handler._adapter(message):
            leaf = row.inputs[index].to(span.device, span.dtype).detach().requires_grad_(True)
            deep_leaf = None
            if index == 0 and row.deep is not None:
                deep_leaf = row.deep.to(span.device, span.dtype).detach().requires_grad_(True)
            past = {
                i: (row.keys[i][..., :offset, :].detach().requires_grad_(True), row.values[i][..., :offset, :])
                for i in row.keys
            }
            past = {i: (k, v.detach().requires_grad_(True)) for i, (k, v) in past.items()} if offset else {}
            cache = TrainCache(offset, past)
            output = span.train_span(handler._span_input(message, leaf), range(hop.start, hop.end), deep_leaf, cache)
            roots, grads = [], []
            if grad_out is None and message.num_labels:  # classification: only the last chunk scores
                if score:
                    loss, done.num_targets, done.scored = handler._score_loss(message, output, score[0])
                    done.loss_sum = float(loss.detach())
                    roots, grads = [loss], [torch.ones_like(loss)]
            elif grad_out is None:
                here = msgspec.structs.replace(message, num_prompts=self._prompts(message))
                loss, done.num_targets = handler._loss_sum(here, output)
                done.loss_sum = float(loss.detach())
                if done.num_targets:
                    roots, grads = [loss], [torch.ones_like(loss)]
            else:
                roots, grads = [output], [grad_out.to(output.device, output.dtype).unsqueeze(0)]
            if row.key_grads:  # what later chunks' laps gave this chunk's keys and values
                for i, (key, value) in cache.new.items():
                    end = offset + key.shape[-2]
                    roots += [key, value]
                    grads += [row.key_grads[i][..., offset:end, :], row.value_grads[i][..., offset:end, :]]
            if roots:
                torch.autograd.backward(roots, grads)
        for i, (key, value) in past.items():
            if i not in row.key_grads:
                row.key_grads[i], row.value_grads[i] = torch.zeros_like(row.keys[i]), torch.zeros_like(row.values[i])
            for leaf_kv, store in ((key, row.key_grads[i]), (value, row.value_grads[i])):
                if leaf_kv.grad is not None:
                    store[..., :offset, :] += leaf_kv.grad
        done.grad = (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).float().cpu()
        if deep_leaf is not None:
            deep_grad = deep_leaf.grad if deep_leaf.grad is not None else torch.zeros_like(deep_leaf)
            done.deep_grad = deep_grad.float().cpu()
        return done
