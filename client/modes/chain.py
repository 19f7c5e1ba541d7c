"""Chain mode: synchronous speculative decoding, one run in flight.

Each run carries the committed ids the caches lack and a chain of drafts; the tail accepts a
prefix of it and adds its own next token. While the run is in flight the client hedges: it drafts
the next run for the run's likeliest refuting verdicts (a speculation cache, after Saguaro), so
that after one of them the next run leaves without drafting.
"""

from __future__ import annotations

from typing import Optional

from client._runs import HEDGE_WIDTH, MAX_HEDGES, Run
from client.modes.base import Mode


class ChainMode(Mode):
    def next_run(self, budget: int) -> Optional[Run]:
        d, state = self.decoder, self.decoder.state
        committed = state.history[state.cached :]
        # drafts and committed ids together stay within one Step's positions
        room = min(self.room(budget, 0), d.state.remote.max_positions_per_step - len(committed))
        drafts = self.drafts(room)
        d.hedges.clear()
        return Run(state.take_run_id(), state.cached, committed + drafts, drafts, None, proposed=len(drafts))

    def drafts(self, room: int) -> list[int]:
        """The drafts after the committed text: the hedge made for this verdict, or drafted now."""
        d = self.decoder
        if d.drafter is None or room <= 0:
            return []
        size = min(room, d.drafter.draft_cap)
        # a verdict's tail drafts (TailDrafts) postdate every hedge: the drafter chooses afresh
        hedged = None if d.drafter.fresh else d.hedges.take(d.state.history)
        if hedged is not None:
            d.stats.hedge_hits += 1
            return hedged[:size]
        return d.drafter.draft(size)[:size]

    async def while_in_flight(self, front: Run, budget: int) -> None:
        self.hedge(front, budget)

    def proposal_size(self, num_drafts: int) -> int:
        """Ids to ask the drafter for per run: the drafts (WindowMode adds the guess)."""
        return num_drafts

    def hedge(self, front: Run, budget: int) -> None:
        """Outcome hedging: draft, before the verdict, the next front run for the front run's
        likeliest refuting outcomes: at each draft position j, the drafter's top alternatives
        to the drafted token (accepted j, then the target said otherwise), and after the last
        draft its top alternatives to the guess. A confirmed guess needs no hedge (its run is
        already in flight). Each hedge is drafted under the size and adaptive cap its verdict
        would leave; it can differ from a draft made after the verdict only in that the
        verdict's own tokens are not yet in the drafter's statistics."""
        d = self.decoder
        if d.drafter is None or front.replay:
            return
        d.hedges.start(len(d.state.history))
        for j in range(len(front.drafts) + 1):
            expected = front.drafts[j] if j < len(front.drafts) else front.guess
            outcome_prefix = front.drafts[:j]
            for token in d.drafter.alternatives(HEDGE_WIDTH + 1, after=outcome_prefix):
                if token == expected or len(d.hedges) >= MAX_HEDGES:
                    continue
                outcome = outcome_prefix + [token]
                num_drafts = min(self.room(budget, len(outcome)), d.drafter.cap_after(len(front.drafts), j))
                d.hedges.put(outcome, d.drafter.draft(self.proposal_size(num_drafts), after=outcome))
                d.stats.hedges_prepared += 1
