"""A session's worker: its runs, strictly in run order, each computed with the other sessions' runs
and its outputs sent on (server/handler.py dispatches what arrives; this is what happens next).

  1) take the next run (or a cancel's trim, in queue order);
  2) compute it (server/batching.py -> server/compute.py -> the span's adapter);
  3) send the outputs: a middle server's activations to the next hop, the tail's verdict to the
     client's results stream, and with ``loop_runs`` the next run to the head (server/looped_runs.py).

``SessionWorker`` is the handler's base class: the state it reads (sessions, the span, the batch
scheduler, results, stats) is the handler's, set up in ``SessionHandler.__init__``.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import msgspec
import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import LoopedRun, Step, StepResult
from protocol.streams import MessageStream
from server import looped_runs
from server.adapters import SpanCancelled
from server.replies import send_quietly
from server.session import QueuedRun, QueuedTrim, ServerSession, TailReply, Verdict

logger = logging.getLogger("server.handler")

RunOutput = Union[torch.Tensor, StepResult, TailReply]  # what a run's compute returns (server/compute.py)


class SessionWorker:
    """The worker half of SessionHandler: steps 1-3 above, and the looped runs they start."""

    async def _run_session(self, session: ServerSession, downstream: Optional[MessageStream]) -> None:
        """The session's runs, strictly in run order, until it closes (a None in its queue)."""
        # 1) take the next run (or trim: a cancel's rollback, in queue order)
        while (run := await session.queue.get()) is not None:
            if isinstance(run, QueuedTrim):
                session.trim(self.span, min(run.length, self.span.cache_length(session.cache)))
                continue
            if run.cancelled:
                self.stats["cancelled_runs"] += 1
                continue
            # 2) compute it, with whatever other sessions' runs are waiting (server/batching.py)
            output = await self._compute(session, run)
            if output is None:
                continue
            # 3) send the outputs: activations to the next hop, or the verdict to the client
            await self._send_outputs(session, run, output, downstream)

    async def _compute(self, session: ServerSession, run: QueuedRun) -> Optional[RunOutput]:
        """The run's output; None when it was cancelled or failed (the failure reported)."""
        session.running = run
        try:
            return await self.batches.compute(session, run)
        except SpanCancelled:
            self.stats["cancelled_runs"] += 1
        except ProtocolError as e:
            await self._report_run(session, e, run.step.run_id)
        except Exception as e:
            logger.exception(f"Run {run.step.run_id} of session {session.session_id} failed")
            await self._report_run(session, ProtocolError(ErrorCode.INTERNAL, repr(e)), run.step.run_id)
        finally:
            session.running = None
        return None

    async def _send_outputs(
        self, session: ServerSession, run: QueuedRun, output: RunOutput, downstream: Optional[MessageStream]
    ) -> None:
        """A middle server's activations go down the chain; the tail's outputs and verdict go to the
        client's results (a forward pass's outputs first), the next run to the head if it asked."""
        if run.cancelled or session.closed:  # cancelled while computing: never send it on
            self.stats["cancelled_runs"] += 1
            return
        self.stats["runs"] += 1
        if isinstance(output, TailReply):
            for frame in output.outputs:
                await self.results.post(session, frame)
            output = output.result
        if isinstance(output, StepResult):
            self.stats["accepted_tokens"] += output.accepted + 1
            if run.step.loop_runs > 0 or run.step.run_id in session.tail_started:
                output = await self._looped_verdict(session, run.step, output)
            await self.results.post(session, Verdict(output, run.step))  # its digest sealed as it goes out
        else:
            await send_quietly(downstream, run.step, [output], self.compression)

    async def _looped_verdict(self, session: ServerSession, step: Step, result: StepResult) -> StepResult:
        """The verdict of a Step with loop_runs, or of a run this tail started: the next run leaves
        for the head before the verdict does, and a run the tail started names its drafts."""
        if step.parents:  # a tree's verdict: never looped
            return result
        result = looped_runs.name_run_drafts(session, step, result)
        if step.loop_runs > 0:
            result = msgspec.structs.replace(result, looped=await self._loop_to_head(session, step, result))
        return result

    async def _loop_to_head(self, session: ServerSession, step: Step, result: StepResult) -> bool:
        """Start the run after ``result`` at the head (docs/protocol.md "Looped runs"); False when this
        verdict cannot be continued without the client."""
        following = looped_runs.following_run(session, step, result)
        if following is None:
            return False
        if session.hop_index == 0:  # a one-server route: the tail is the head
            try:
                started = self._admit_looped_run(session, following)
            except ProtocolError:
                started = False
        else:
            started = await looped_runs.send_to_head(self.p2p, session, following)
        return started and looped_runs.remember_started(session, following.step.run_id)

    def _admit_looped_run(self, session: ServerSession, message: LoopedRun) -> bool:
        """Queue a looped run at the head as any run; False (and counted) when it is stale."""
        step = looped_runs.looped_step(session, message, self.max_positions_per_step, self.stats)
        if step is None:
            return False
        self._enqueue(session, step, [])
        self.stats["looped_runs"] += 1
        return True
