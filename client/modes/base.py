"""The one interface between the lap loop and a decoding mode.

The lap loop (``SpeculativeDecoder._lap``, client/_generation.py) is the same for every mode:
build Steps and send them, wait for the front run's verdict, commit it, cancel what it refutes.
What differs (what a run carries, what a verdict may say, what follows it) is a :class:`Mode`'s,
and a mode says it by returning decisions (client/modes/view.py): it never changes the decoder.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

from client._runs import Run
from client.errors import ServerError
from client.modes.view import DecoderView, NextRun, VerdictAction, WorkAhead
from protocol.messages import StepResult


class Mode(abc.ABC):
    """One decoding mode. Per lap the loop calls, in this order:

    1) ``next_run(tokens_left)`` until it returns None or ``window`` runs are in flight, and
       ``step_fields(run)`` for the Step of each (the fields this mode adds to a plain chain Step);
    2) ``while_in_flight(front, tokens_left)`` once, while the network computes the front run;
    3) ``check_verdict(front, result)`` when the front run's verdict arrives: it checks what only
       this mode can check and returns the run as the verdict says it went; then ``corrected``
       if the verdict carries a correction (the rejection rule's);
    4) ``accepted_drafts`` and ``on_commit`` while the verdict is committed, then ``follow_up``
       (once runs it refutes are cancelled).

    A mode reads the decoder through a read-only :class:`DecoderView` and keeps only its own
    memory (hedges, a tree sizer, the last offer); the decoder acts on what it returns.
    """

    window = 1  # runs in flight at most

    def __init__(self, view: DecoderView) -> None:
        self.view = view

    @abc.abstractmethod
    def next_run(self, tokens_left: int) -> Optional[NextRun]:
        """The next run to send, or None when nothing more may be sent now."""

    def step_fields(self, run: Run) -> dict[str, Any]:
        """Step fields beyond a plain chain's that this mode sets for ``run``."""
        return {}

    def while_in_flight(self, front: Run, tokens_left: int) -> WorkAhead:
        """Work done while the network computes ``front`` (hedging)."""
        return WorkAhead()

    def forget(self) -> None:
        """Drop what was made ahead for verdicts that will not come (a failover, a liar caught)."""

    def check_verdict(self, run: Run, result: StepResult) -> Run:
        """Check what only this mode can check in a verdict on ``run``; the run as it went."""
        return run

    def corrected(self, run: Run, result: StepResult) -> StepResult:
        """A verdict with a correction (the rejection rule's): no run of this mode can take one."""
        raise ServerError(
            f"a correction after {result.accepted} accepted drafts, for a run that cannot be corrected",
            self.view.state.remote.tail_peer,
        )

    def accepted_drafts(self, run: Run, result: StepResult) -> list[int]:
        """The drafts a verdict accepts: a prefix of the run's chain."""
        return run.drafts[: result.accepted]

    def on_commit(self, run: Run, result: StepResult, base: int) -> VerdictAction:
        """What the committed verdict means beyond its tokens; ``base`` is the position of the
        run's first draft."""
        return VerdictAction(drafter_feedback=self.drafter_feedback(run, result))

    def drafter_feedback(self, run: Run, result: StepResult) -> Optional[tuple[int, int]]:
        """How the drafter's proposal fared, (drafted, accepted): once per proposal (a split
        front's is told by the run that carries its rest)."""
        if run.split and run.confirmed_by(result):
            return None
        return max(run.proposed, run.prefix_drafts + len(run.drafts)), run.prefix_drafts + result.accepted

    def follow_up(self, run: Run, result: StepResult, tail_drafts: list[int]) -> Optional[Run]:
        """After the commit: the run the tail started at the head, if the verdict says it did
        (which no run of this mode asks for)."""
        if result.looped:
            raise ServerError(f"run {result.run_id + 1} started at the head unasked", self.view.state.remote.tail_peer)
        return None

    def room(self, tokens_left: int, assumed: int) -> int:
        """How many drafts a run may carry after ``assumed`` uncommitted tokens."""
        v = self.view
        end_of_context = len(v.state.history) + assumed  # position of the run's first draft
        return min(tokens_left - assumed - 1, v.state.max_length - end_of_context - 1, v.num_draft_tokens)
