"""The one interface between the lap loop and a decoding mode.

The lap loop (``SpeculativeDecoder._lap``, client/_generation.py) is the same for every mode:
build Steps and send them, wait for the front run's verdict, commit it, cancel what it refutes.
What differs (what a run carries, what a verdict may say, what follows it) is a :class:`Mode`'s.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Optional

from client._runs import Run
from client._throughput import MAX_MEASURED_POSITIONS
from client.errors import ServerError
from protocol.messages import StepResult

if TYPE_CHECKING:
    from client._generation import SpeculativeDecoder


class Mode(abc.ABC):
    """One decoding mode. Per lap the loop calls, in this order:

    1) ``next_run(budget)`` until it returns None or ``window`` runs are in flight, and
       ``step_fields(run)`` for the Step of each (the fields this mode adds to a plain chain Step);
    2) ``while_in_flight(front, budget)`` once, while the network computes the front run;
    3) ``read_verdict(front, result)`` when the front run's verdict arrives: it checks what only
       this mode can check and may replace the verdict (the rejection rule's correction);
    4) ``accepted_drafts``, ``on_commit`` and ``observe_drafter`` while the verdict is committed,
       then ``after_verdict`` (once runs it refutes are cancelled).

    A mode reads and updates the decoder's shared state (session, drafter, runs in flight, hedges,
    stats) and nothing of another mode's.
    """

    window = 1  # runs in flight at most

    def __init__(self, decoder: "SpeculativeDecoder") -> None:
        self.decoder = decoder

    @abc.abstractmethod
    def next_run(self, budget: int) -> Optional[Run]:
        """The next run to send (its run id taken), or None when nothing more may be sent now."""

    def step_fields(self, run: Run) -> dict[str, Any]:
        """Step fields beyond a plain chain's that this mode sets for ``run``."""
        return {}

    async def while_in_flight(self, front: Run, budget: int) -> None:
        """Work done while the network computes ``front`` (hedging)."""

    def read_verdict(self, run: Run, result: StepResult) -> StepResult:
        """The verdict on ``run`` as the client commits it."""
        self.observe_verdict(run, result)
        return self.corrected(run, result) if result.correction_ids is not None else result

    def observe_verdict(self, run: Run, result: StepResult) -> None:
        """Check what only this mode can check in a verdict, and time the lap."""
        self.time_lap(run)

    def time_lap(self, run: Run) -> None:
        """Time ``run``'s lap for the throughput meter (client/_throughput.py), in every mode.

        A lap is ``run.sent_at`` to its verdict: for a run the client sent, from sending it; for a
        looped run, from the previous verdict's arrival (the tail started it then). Only a lap that
        had the route to itself says what its hops deliver, so these are not timed: a run sent
        while an earlier run of the session was in flight (it queued behind it at every hop, and
        the client cannot tell queueing from computing), and a lap beside an audit of this
        generation (its sessions share the route's head and middles), and a prefill or replay (more
        positions than a decode lap: ``MAX_MEASURED_POSITIONS``)."""
        d = self.decoder
        if run.overlapped or len(run.token_ids) > MAX_MEASURED_POSITIONS or not d.audits_quiet_since(run.sent_at):
            d.stats.laps_untimed += 1
            return
        d.stats.laps_timed += 1
        d.swarm.observe_lap(d.state.remote.route, d.verdict_at - run.sent_at, len(run.token_ids), looped=run.looped)

    def corrected(self, run: Run, result: StepResult) -> StepResult:
        """A verdict with a correction (the rejection rule's): no run of this mode can take one."""
        raise ServerError(f"a correction after {result.accepted} accepted drafts, for a run that cannot be corrected",
                          self.decoder.state.remote.tail_peer)  # fmt: skip

    def accepted_drafts(self, run: Run, result: StepResult) -> list[int]:
        """The drafts a verdict accepts: a prefix of the run's chain."""
        return run.drafts[: result.accepted]

    def on_commit(self, run: Run, result: StepResult, base: int) -> None:
        """The verdict is committed; ``base`` is the position of the run's first draft."""

    def observe_drafter(self, run: Run, result: StepResult) -> None:
        """Tell the drafter how its proposal fared: once per proposal (a split front's is told by
        the run that carries its rest)."""
        if run.split and run.confirmed_by(result):
            return
        drafted = max(run.proposed, run.prefix_drafts + len(run.drafts))
        self.decoder.drafter.observe(drafted, run.prefix_drafts + result.accepted)

    def after_verdict(self, run: Run, result: StepResult, tail_drafts: list[int]) -> None:
        """After the commit: a verdict may say the tail started the next run, which no run of this
        mode asks for."""
        if result.looped:
            raise ServerError(f"run {result.run_id + 1} started at the head unasked", self.decoder.state.remote.tail_peer)

    def room(self, budget: int, assumed: int) -> int:
        """How many drafts a run may carry after ``assumed`` uncommitted tokens."""
        d = self.decoder
        end_of_context = len(d.state.history) + assumed  # position of the run's first draft
        return min(budget - assumed - 1, d.state.max_length - end_of_context - 1, d.num_draft_tokens)
