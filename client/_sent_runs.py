"""What a session's verdicts must be about: the runs this client sent and the runs it expects the
tail to have looped to the head, and the outputs each asked for (client/_remote_session.py).

A verdict counts only if its digest (protocol/digest.py, every field of the Step) is that of a Step
this client sent, or of the looped run the previous verdict announced, rebuilt here with the builder
the tail uses (protocol/looped_steps.py) and the drafts the verdict names. Everything else the
results stream may bring is a route fault, never evidence against the tail alone: a middle hop can
cause each of them and the client cannot tell which hop did (docs/reliability.md, "Every field
bound"). So: a digest that differs (a hop rewrote the Step), a verdict for a run this client never
sent nor expected or one that skips a run still due (a hop renumbered or dropped it), and outputs
(RunOutputs) for a run that asked none or missing from one that asked some.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import msgspec

from client.errors import RouteFault
from protocol.digest import digest_of
from protocol.errors import ErrorCode
from protocol.looped_steps import following_step
from protocol.messages import SamplingParams, Step, StepResult


@dataclass(frozen=True)
class _Looped:
    """A run the tail said it started at the head: after ``before``'s verdict (accepted, next_token)."""

    before: Step
    accepted: int
    next_token: int


def _fault(message: str) -> RouteFault:
    return RouteFault(message, "", ErrorCode.DOWNSTREAM_FAILED)


class SentRuns:
    def __init__(self, secret: str):
        self.secret = secret
        self._sent: dict[int, tuple[int, Step]] = {}  # run id -> (digest, the Step as sent)
        self._looped: dict[int, _Looped] = {}  # run id -> how the tail built it
        self._output_rows: dict[int, int] = {}  # run id -> rows of outputs received before its verdict

    def sent(self, step: Step, sampling: SamplingParams) -> None:
        """Record a Step as it leaves (``sampling``: the parameters in effect for it)."""
        copy = msgspec.structs.replace(step)  # the caller's object may change; what was sent may not
        self._sent[step.run_id] = (digest_of(copy, sampling, self.secret), copy)

    def due(self, run_id: int) -> bool:
        """Whether ``run_id`` was sent or announced and has no verdict yet."""
        return run_id in self._sent or run_id in self._looped

    def outputs(self, run_id: int, rows: int) -> None:
        """RunOutputs for ``run_id`` arrived (``rows`` positions); a run that asked none gets none."""
        asked = self._asked(run_id)
        if asked is None:
            raise _fault(f"outputs for run {run_id}, which this client never sent nor expected")
        if asked == 0:
            raise _fault(f"outputs for run {run_id}, whose Step asked for none")
        self._output_rows[run_id] = self._output_rows.get(run_id, 0) + rows

    def _asked(self, run_id: int) -> Optional[int]:
        if run_id in self._sent:
            return self._sent[run_id][1].return_logits
        return 0 if run_id in self._looped else None  # looped runs are never forward passes

    def judge(self, result: StepResult, waited_for: int, sampling: SamplingParams) -> None:
        """Check a verdict (for a run >= ``waited_for``) against what was sent or announced; raises
        RouteFault if it is about anything else. ``sampling``: the session's parameters now."""
        if result.run_id > waited_for and self.due(waited_for):
            raise _fault(
                f"a verdict on run {result.run_id} while run {waited_for} was due: a hop dropped or renumbered it"
            )
        if result.run_id in self._sent:
            expected, step = self._sent[result.run_id]
        elif result.run_id in self._looped:
            looped = self._looped[result.run_id]
            drafts = list(result.run_drafts or ())
            step = following_step(looped.before, looped.accepted, looped.next_token, drafts)
            expected = digest_of(step, sampling, self.secret)
        else:
            raise _fault(f"a verdict on run {result.run_id}, which this client never sent nor expected")
        rows = self._output_rows.get(result.run_id, 0)
        for table in (self._sent, self._looped, self._output_rows):
            for run_id in [r for r in table if r <= result.run_id]:
                del table[run_id]
        if result.step_digest != expected:
            raise _fault(
                f"the verdict on run {result.run_id} is about another Step than the one sent: a hop rewrote it"
            )
        if rows != step.return_logits:
            got = f"{rows} of the {step.return_logits} rows of outputs asked"
            raise _fault(f"the verdict on run {result.run_id} came after {got}")
        if result.looped:
            self._looped[result.run_id + 1] = _Looped(step, result.accepted, result.next_token)
