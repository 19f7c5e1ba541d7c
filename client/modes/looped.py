"""Looped runs (``loop_runs=True``, on by default where it applies): the tail starts each next run
at the head itself, one link sooner than a round trip through the client allows
(docs/protocol.md, "Looped runs").

The client's Step asks for ``loop_runs``; after the verdict the tail sends the head the next run
(the verdict's next token and the tail's drafts) and says so in the verdict (``looped``). While a
run is in flight the client offers the head its hedged drafts for the run's likeliest verdicts
(DraftOffer); the head uses the one matching the verdict in place of the tail's. A looped run's
verdict names the drafts it carried (``run_drafts``), since the client did not choose them. One
chain in flight, verified by token match; the client stays the authority: it receives every
verdict, and the lap loop cancels a looped run it does not need.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from client._runs import Run
from client.errors import ServerError
from client.modes.chain import ChainMode
from client.modes.view import DecoderView, WorkAhead
from protocol.limits import MAX_OFFER_OPTIONS
from protocol.messages import DraftOffer, StepResult


class LoopedMode(ChainMode):
    def __init__(self, view: DecoderView) -> None:
        super().__init__(view)
        self.offered: dict[tuple[int, int], list[int]] = {}  # the last DraftOffer's options by verdict
        self.offered_for = -1  # the run whose verdicts they follow

    def step_fields(self, run: Run) -> dict[str, Any]:
        loop_runs = 0 if run.replay else max(0, self.view.tokens_left - 1)
        return {"loop_runs": loop_runs} if loop_runs else {}

    def while_in_flight(self, front: Run, tokens_left: int) -> WorkAhead:
        hedges = self.hedge(front, tokens_left)
        if not front.looped:
            return WorkAhead(hedges)
        return WorkAhead(hedges, self.offer(front))  # the run after it starts at the head: offer the hedges there

    def offer(self, run: Run) -> Optional[DraftOffer]:
        """The head's offer of the hedged drafts for the verdicts of ``run``, for the run the tail
        starts after it (None: no hedges to offer)."""
        options = self.hedges.options()[:MAX_OFFER_OPTIONS]
        self.offered, self.offered_for = {(a, t): drafts for a, t, drafts in options}, run.run_id
        if not options:
            return None
        return DraftOffer(session_id=self.view.state.remote.session_id, run_id=run.run_id, options=options)

    def check_verdict(self, run: Run, result: StepResult) -> Run:
        """A looped run: the head chose its drafts (the tail's or an offer), which the verdict names;
        its lap began at the tail when the previous verdict left it (timed from that verdict's
        arrival at the client: ``SpeculativeDecoder._time_lap``)."""
        if not run.looped:
            return super().check_verdict(run, result)
        drafts, remote = result.run_drafts, self.view.state.remote
        if drafts is None or not 0 <= result.accepted <= len(drafts) or len(drafts) > remote.max_positions_per_step:
            raise ServerError(f"the verdict on looped run {run.run_id} does not name its drafts", remote.tail_peer)
        token_ids = [run.token_ids[0], *drafts]
        return dataclasses.replace(run, drafts=list(drafts), token_ids=token_ids, proposed=len(drafts))

    def follow_up(self, run: Run, result: StepResult, tail_drafts: list[int]) -> Optional[Run]:
        """The tail has started the next run at the head: [next_token, *its tail drafts] from the
        position after next_token's. The decoder tracks it as in flight; the client sends nothing for it."""
        if not result.looped:
            return None
        state = self.view.state
        if result.correction_ids is not None or run.run_id + 1 != state.next_run_id:
            raise ServerError(f"run {result.run_id + 1} started at the head unasked", state.remote.tail_peer)
        # what the head most likely sent (the offer for this verdict, else the tail's drafts): the
        # hedges for its verdict build on it; its own verdict says what it really carried
        offered = self.offered if self.offered_for == run.run_id else {}
        drafts = offered.get((result.accepted, result.next_token), tail_drafts)
        return Run(
            state.next_run_id,
            run.first_draft_pos + result.accepted,
            [result.next_token, *drafts],
            list(drafts),
            None,
            proposed=len(drafts),
            sent_at=self.view.verdict_at,
            looped=True,
        )
