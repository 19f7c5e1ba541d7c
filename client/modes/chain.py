"""Chain mode: synchronous speculative decoding, one run in flight.

Each run carries the committed ids the caches lack and a chain of drafts; the tail accepts a
prefix of it and adds its own next token. While the run is in flight the client hedges: it drafts
the next run for the run's likeliest refuting verdicts (a speculation cache, after Saguaro), so
that after one of them the next run leaves without drafting.
"""

from __future__ import annotations

from typing import Optional

from client._runs import HEDGE_WIDTH, MAX_HEDGES, HedgeCache, Run
from client.modes.base import Mode
from client.modes.view import DecoderView, NextRun, WorkAhead


class ChainMode(Mode):
    def __init__(self, view: DecoderView) -> None:
        super().__init__(view)
        self.hedges = HedgeCache()  # drafts made for the front run's likeliest refuting verdicts

    def next_run(self, tokens_left: int) -> Optional[NextRun]:
        state = self.view.state
        committed = state.history[state.cached :]
        # drafts and committed ids together stay within one Step's positions
        room = min(self.room(tokens_left, 0), state.remote.max_positions_per_step - len(committed))
        drafts, hedged = self.drafts(room)
        self.hedges.clear()
        run = Run(state.next_run_id, state.cached, committed + drafts, drafts, None, proposed=len(drafts))
        return NextRun(run, hedged)

    def drafts(self, room: int) -> tuple[list[int], bool]:
        """The drafts after the committed text: the hedge made for this verdict (True), or drafted now."""
        drafter = self.view.drafter
        if drafter is None or room <= 0:
            return [], False
        size = min(room, drafter.draft_cap)
        # a verdict's tail drafts (TailDrafts) postdate every hedge: the drafter chooses afresh
        hedged = None if drafter.fresh else self.hedges.take(self.view.state.history)
        if hedged is not None:
            return hedged[:size], True
        return drafter.draft(size)[:size], False

    def while_in_flight(self, front: Run, tokens_left: int) -> WorkAhead:
        return WorkAhead(hedges=self.hedge(front, tokens_left))

    def forget(self) -> None:
        self.hedges.clear()

    def proposal_size(self, num_drafts: int) -> int:
        """Ids to ask the drafter for per run: the drafts (WindowMode adds the guess)."""
        return num_drafts

    def hedge(self, front: Run, tokens_left: int) -> int:
        """Outcome hedging: draft, before the verdict, the next front run for the front run's
        likeliest refuting outcomes: at each draft position j, the drafter's top alternatives
        to the drafted token (accepted j, then the target said otherwise), and after the last
        draft its top alternatives to the guess. A confirmed guess needs no hedge (its run is
        already in flight). Each hedge is drafted under the size and adaptive cap its verdict
        would leave; it can differ from a draft made after the verdict only in that the
        verdict's own tokens are not yet in the drafter's statistics. Returns the hedges made."""
        drafter, made = self.view.drafter, 0
        if drafter is None or front.replay:
            return made
        self.hedges.start(len(self.view.state.history))
        for j in range(len(front.drafts) + 1):
            expected = front.drafts[j] if j < len(front.drafts) else front.guess
            outcome_prefix = front.drafts[:j]
            for token in drafter.alternatives(HEDGE_WIDTH + 1, after=outcome_prefix):
                if token == expected or len(self.hedges) >= MAX_HEDGES:
                    continue
                outcome = outcome_prefix + [token]
                num_drafts = min(self.room(tokens_left, len(outcome)), drafter.cap_after(len(front.drafts), j))
                self.hedges.put(outcome, drafter.draft(self.proposal_size(num_drafts), after=outcome))
                made += 1
        return made
