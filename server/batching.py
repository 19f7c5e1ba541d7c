"""Continuous batching: the runs of all sessions waiting at a server go through its span together.

Decoding reads every weight of the span for a handful of positions, so computing many sessions'
positions in one pass costs about what one costs (docs/design.md, "Batching sessions at a
server"). Each session's worker (server/handler.py) hands its next run to :meth:`BatchScheduler.
compute` and waits for the result, so a session has at most one run here and its runs stay in
run order. The scheduler's loop:
  1) takes the waiting runs in arrival order while their positions fit ``max_batch_positions``
     (a long chain run is cut into chunks: the rest of it waits at the back of the line, so a
     prefill rides beside decode runs instead of stalling them);
  2) runs them through the span in the compute thread, each with its own cache, positions and
     mask (``SpanAdapter.forward_batch``); at the tail, the first logits row of every run is
     computed in one call of the LM head;
  3) hands each finished run its output (activations for the next hop, or the verdict).
A batch never waits for a late run: it starts with what is ready, after at most ``gather_window``
seconds (default 5 ms) spent waiting for runs of the server's other open sessions; it starts at
once when every open session already has a run waiting (a session alone never waits). A run
cancelled while waiting or between blocks leaves the batch; the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from protocol.limits import DEFAULT_GATHER_WINDOW
from server import deep_prompts
from server.adapters import SpanAdapter, SpanCancelled
from server.adapters.base import BatchMember
from server.boundary_state import forward_split, wants_boundary
from server.compute import begin_run, finish_run, first_logits_row, planned_rows
from server.memory import DEFAULT_MAX_BATCH_POSITIONS
from server.session import QueuedRun, ServerSession
from server.tail_costs import CostMeter

logger = logging.getLogger(__name__)

REPORT_PERIOD = 5.0  # seconds between log lines of the batching counters (when they changed)


@dataclass
class Job:
    """A run waiting for (or part way through) the span."""

    session: ServerSession
    run: QueuedRun
    future: "asyncio.Future"
    hidden: Optional[torch.Tensor] = None  # the run's input activations, once begun
    done: int = 0  # positions computed so far (a chunked run)
    outputs: list[torch.Tensor] = field(default_factory=list)  # output activations of the chunks computed
    blocks_s: float = 0.0  # the span's blocks' time on this run so far (its share of each pass)
    boundary: list = field(default_factory=list)  # states at the Step's ``hidden_at`` of the chunks computed

    @property
    def size(self) -> int:
        return len(self.run.step.token_ids)

    @property
    def cancelled(self) -> bool:
        return self.run.cancelled or self.session.closed

    def chunkable(self) -> bool:
        """Chains can be cut anywhere; a tree goes whole (its mask spans all of its drafts)."""
        return not self.run.step.parents


@dataclass
class Outcome:
    """What one batch did to one job: finished with ``output``, failed with ``error``, or computed
    a chunk and waits for the next (both None)."""

    output: object = None
    error: Optional[BaseException] = None


class BatchScheduler:
    def __init__(
        self,
        span: SpanAdapter,
        executor: Executor,
        *,
        max_batch_positions: int = DEFAULT_MAX_BATCH_POSITIONS,
        gather_window: float = DEFAULT_GATHER_WINDOW,
        open_sessions: Optional[Callable[[], int]] = None,
    ):
        """``open_sessions``: how many sessions are open at the server now (the handler's count);
        the gather window ends once each of them has a run waiting. None: the window always runs
        to its end."""
        if max_batch_positions < 1 or gather_window < 0:
            raise ValueError(
                f"max_batch_positions must be >= 1 and gather_window >= 0, got {max_batch_positions}, {gather_window}"
            )
        self.span, self.executor = span, executor
        self.max_batch_positions, self.gather_window = max_batch_positions, gather_window
        self.open_sessions = open_sessions
        self._arrived = asyncio.Event()  # set by every run handed in (the gather window watches it)
        self.enabled = True  # False: one run per pass (what every server did before; benchmarks compare)
        self._waiting: list[Job] = []  # arrival order
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.stats = {"batches": 0, "batched_runs": 0, "batched_positions": 0, "max_batch_runs": 0, "chunks": 0}
        self.batch_sizes: list[tuple[int, int]] = []  # (runs, positions) of recent batches, for benchmarks

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop()), asyncio.create_task(self._report())]

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for job in self._waiting:
            if not job.future.done():
                job.future.set_exception(SpanCancelled())
        self._waiting.clear()

    async def compute(self, session: ServerSession, run: QueuedRun) -> object:
        """The run's output once computed with whatever else is waiting: activations for the next
        hop, or the tail's verdict. Raises SpanCancelled for a run cancelled on the way, and
        ProtocolError (or any error) the run's computation raised."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(Job(session, run, future))
        self._ready.set()
        self._arrived.set()
        return await future

    async def _gather(self) -> None:
        """Wait up to ``gather_window`` for runs of the other open sessions, and not at all once
        every open session has a run waiting: whom the batch could still gain is known."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gather_window
        while self.open_sessions is None or len({id(job.session) for job in self._waiting}) < self.open_sessions():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._ready.wait()
            if self.gather_window:
                await self._gather()
            batch = self._take()  # 1) what is ready, in arrival order, within the cap
            if not batch:
                self._ready.clear()
                continue
            try:  # 2) one pass through the span
                outcomes = await loop.run_in_executor(self.executor, self._compute, batch)
            except Exception as e:  # noqa: BLE001 - each waiting worker reports it for its run
                outcomes = [Outcome(error=e) for _ in batch]
            for (job, _), outcome in zip(batch, outcomes):  # 3) outputs to their sessions
                self._settle(job, outcome)

    async def _report(self) -> None:
        """Log the counters (cumulative, so a reader can diff two lines: benchmarks/load.py does)."""
        last = dict(self.stats)
        while True:
            await asyncio.sleep(REPORT_PERIOD)
            now = dict(self.stats)
            passes = now["batches"] - last["batches"]
            if passes:
                runs, positions = (
                    now["batched_runs"] - last["batched_runs"],
                    now["batched_positions"] - last["batched_positions"],
                )
                logger.info(
                    f"Batching: {now['batches']} passes, {now['batched_runs']} runs, "
                    f"{now['batched_positions']} positions "
                    f"in all (last {REPORT_PERIOD:.0f} s: {runs / passes:.1f} runs, "
                    f"{positions / passes:.1f} positions per pass)"
                )
            last = now

    def _take(self) -> list[tuple[Job, int]]:
        """Jobs for one pass and how many positions of each: in arrival order, all over the same
        blocks and with the same LoRA adapter as the first (runs of another adapter wait for a pass of
        their own: adapters never mix inside a pass), positions within the cap (the first job is taken
        even if larger, as one pass of its own, or a chunk of the cap when it is a chain)."""
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            if job.hidden is not None:  # part way through a chunked run; no pass is running now
                try:
                    self.span.trim_cache(job.session.cache, job.run.step.start_pos)
                except Exception:  # noqa: BLE001 - the session's next run trims to its start_pos anyway
                    logger.exception(f"Could not trim the cache of cancelled run {job.run.step.run_id}")
            self._settle(job, Outcome(error=SpanCancelled()))
        if not self._waiting:
            return []
        if not self.enabled:  # one run per pass, whole, as before batching
            job = self._waiting.pop(0)
            return [(job, job.size - job.done)]
        batch, room, first = [], self.max_batch_positions, self._waiting[0].session
        for job in list(self._waiting):
            if batch and (job.session.blocks, job.session.adapter) != (first.blocks, first.adapter):
                continue  # a pass computes one range of blocks with one LoRA adapter (server/lora.py)
            left = job.size - job.done
            take = min(left, room) if job.chunkable() else (left if left <= room or not batch else 0)
            if take <= 0:
                if room <= 0:
                    break
                continue
            batch.append((job, take))
            self._waiting.remove(job)
            room -= take
            if room <= 0:
                break
        return batch

    def _settle(self, job: Job, outcome: Outcome) -> None:
        if job.future.done():
            return
        if outcome.error is not None:
            job.future.set_exception(outcome.error)
        elif job.done < job.size:
            self._waiting.append(job)  # the rest of a chunked run: at the back of the line
            self._ready.set()
        else:
            job.future.set_result(outcome.output)

    # ---- the compute thread -----------------------------------------------------------------

    def _compute(self, batch: list[tuple[Job, int]]) -> list[Outcome]:
        """One pass of ``batch`` through the span (in the compute thread)."""
        outcomes = [Outcome() for _ in batch]
        members, moving = [], []
        for i, (job, take) in enumerate(batch):
            try:
                if job.hidden is None:
                    job.hidden = begin_run(self.span, job.session, job.run)
            except Exception as e:  # noqa: BLE001 - the run's own failure, reported to its session
                outcomes[i].error = e
                continue
            members.append(self._member(job, take))
            moving.append(i)
        self._count(batch)
        sessions, blocks = [batch[i][0].session for i in moving], batch[0][0].session.blocks
        started = time.perf_counter()
        split = {j for j, i in enumerate(moving) if wants_boundary(sessions[j], batch[i][0].run.step.hidden_at)}
        with _adapter(self.span, batch[0][0].session.adapter):
            plain = [j for j in range(len(members)) if j not in split]
            found = deep_prompts.forward_batch(
                self.span, [members[j] for j in plain], [sessions[j] for j in plain], blocks
            )
            results = [None] * len(members)
            for j, result in zip(plain, found):
                results[j] = result
            for j in split:  # a dispute's evidence run: alone, keeping one boundary's state (server/boundary_state.py)
                job = batch[moving[j]][0]
                at = job.run.step.hidden_at
                results[j], state = forward_split(self.span, members[j], sessions[j], blocks, at)
                if state is not None:
                    job.boundary.append(state)
        if any(r is not None and r.is_cuda for r in results):
            torch.cuda.synchronize()  # the pass's time is its work's, not its launch's
        per_position = (time.perf_counter() - started) / max(1, sum(batch[i][1] for i in moving))
        for i in moving:  # the pass's time, shared by positions (server/tail_costs.py)
            batch[i][0].blocks_s += per_position * batch[i][1]
        finishing = []
        for i, result in zip(moving, results):
            job, take = batch[i]
            if result is None:  # cancelled between blocks: no positions of it stay
                self.span.trim_cache(job.session.cache, job.run.step.start_pos)
                outcomes[i].error = SpanCancelled()
                continue
            job.outputs.append(result)
            job.done += take
            if job.done == job.size:
                finishing.append(i)
        self._finish(batch, finishing, outcomes)
        return outcomes

    def _member(self, job: Job, take: int) -> BatchMember:
        step, a = job.run.step, job.done
        return BatchMember(
            hidden=job.hidden[:, a : a + take],
            token_ids=torch.tensor([step.token_ids[a : a + take]], dtype=torch.long),
            start_pos=step.start_pos + a,
            cache=job.session.cache,
            tree=list(step.parents) if step.parents else None,  # trees are never chunked
            cancelled=lambda job=job: job.cancelled,
        )

    def _finish(self, batch: list[tuple[Job, int]], finishing: list[int], outcomes: list[Outcome]) -> None:
        """Finish the runs whose last positions this pass computed: at the tail, the LM head's
        planned first rows of each (every verdict reads its first; server/verify_rows.py) in one
        call, then each run's verdict."""
        hiddens = {i: torch.cat(batch[i][0].outputs, dim=1) for i in finishing}
        for i in finishing:  # a run that asked a boundary's state (server/boundary_state.py) carries it to its outputs
            if batch[i][0].boundary:
                batch[i][0].run.boundary = torch.cat(batch[i][0].boundary, dim=1)
        first_rows: dict[int, torch.Tensor] = {}
        meters = {i: CostMeter(batch[i][0].blocks_s) for i in finishing}
        tails = [i for i in finishing if batch[i][0].session.next_hop is None]
        if len(tails) > 1:
            spans = {}
            for i in tails:
                job = batch[i][0]
                first = first_logits_row(job.run.step)
                spans[i] = (first, min(first + planned_rows(job.session, job.run.step), hiddens[i].shape[1]))
            rows = [hiddens[i][:, a:b] for i, (a, b) in spans.items()]
            whole = CostMeter()
            logits = whole.logits(self.span, torch.cat(rows, dim=1))  # [rows of every tail run, V]
            for i, (a, b) in spans.items():  # each run's share of the call, by its rows
                total_rows, seconds = whole.calls[0]
                meters[i].call(b - a, seconds * (b - a) / total_rows, whole.calls[0])
            first_rows = dict(zip(tails, logits.split([b - a for a, b in spans.values()])))
        for i in finishing:
            job = batch[i][0]
            try:
                outcomes[i].output = finish_run(
                    self.span, job.session, job.run, hiddens[i], first_rows.get(i), meters[i]
                )
            except Exception as e:  # noqa: BLE001 - reported to the run's session
                outcomes[i].error = e

    def _count(self, batch: list[tuple[Job, int]]) -> None:
        positions = sum(take for _, take in batch)
        self.stats["batches"] += 1
        self.stats["batched_runs"] += len(batch)
        self.stats["batched_positions"] += positions
        self.stats["max_batch_runs"] = max(self.stats["max_batch_runs"], len(batch))
        self.stats["chunks"] += sum(1 for job, take in batch if take < job.size)
        self.batch_sizes.append((len(batch), positions))
        del self.batch_sizes[:-1000]


def _adapter(span: SpanAdapter, name: str) -> contextlib.AbstractContextManager:
    """The LoRA adapter ``name`` applied to the pass (server/lora.py); nothing to apply without one."""
    return span.lora.using(name) if span.lora is not None else contextlib.nullcontext()


__all__ = ["BatchScheduler", "DEFAULT_GATHER_WINDOW", "DEFAULT_MAX_BATCH_POSITIONS"]
