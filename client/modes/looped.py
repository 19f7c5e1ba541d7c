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

from typing import TYPE_CHECKING, Any

from client._runs import Run
from client.errors import ServerError
from client.modes.chain import ChainMode
from protocol.limits import MAX_OFFER_OPTIONS
from protocol.messages import DraftOffer, StepResult

if TYPE_CHECKING:
    from client._generation import SpeculativeDecoder


class LoopedMode(ChainMode):
    def __init__(self, decoder: "SpeculativeDecoder") -> None:
        super().__init__(decoder)
        self.offered: dict[tuple[int, int], list[int]] = {}  # the last DraftOffer's options by verdict
        self.offered_for = -1  # the run whose verdicts they follow

    def step_fields(self, run: Run) -> dict[str, Any]:
        loop_runs = 0 if run.replay else max(0, self.decoder.budget - 1)
        return {"loop_runs": loop_runs} if loop_runs else {}

    async def while_in_flight(self, front: Run, budget: int) -> None:
        self.hedge(front, budget)
        if front.looped:  # the run after it starts at the head: offer the hedges there
            await self.offer(front)

    async def offer(self, run: Run) -> None:
        """Send the head the hedged drafts for the verdicts of ``run``, for the run the tail starts after it."""
        d = self.decoder
        options = d.hedges.options()[:MAX_OFFER_OPTIONS]
        self.offered, self.offered_for = {(a, t): drafts for a, t, drafts in options}, run.run_id
        if options:
            await d.state.remote.offer(DraftOffer(session_id=d.state.remote.session_id, run_id=run.run_id, options=options))
            d.stats.offers_sent += 1

    def observe_verdict(self, run: Run, result: StepResult) -> None:
        """A looped run: the head chose its drafts (the tail's or an offer), which the verdict names;
        its lap began at the tail when the previous verdict left it (timed from that verdict's
        arrival at the client: ``Mode.time_lap``)."""
        if not run.looped:
            return super().observe_verdict(run, result)
        drafts, d = result.run_drafts, self.decoder
        if drafts is None or not 0 <= result.accepted <= len(drafts) or len(drafts) > d.state.remote.max_positions_per_step:
            raise ServerError(f"the verdict on looped run {run.run_id} does not name its drafts", d.state.remote.tail_peer)
        run.drafts, run.token_ids, run.proposed = list(drafts), [run.token_ids[0], *drafts], len(drafts)
        self.time_lap(run)

    def after_verdict(self, run: Run, result: StepResult, tail_drafts: list[int]) -> None:
        """The tail has started the next run at the head: [next_token, *its tail drafts] from the
        position after next_token's. Track it as in flight; the client sends nothing for it."""
        if not result.looped:
            return
        d, state = self.decoder, self.decoder.state
        if result.correction_ids is not None or run.run_id + 1 != state.next_run_id:
            raise ServerError(f"run {result.run_id + 1} started at the head unasked", state.remote.tail_peer)
        # what the head most likely sent (the offer for this verdict, else the tail's drafts): the
        # hedges for its verdict build on it; its own verdict says what it really carried
        offered = self.offered if self.offered_for == run.run_id else {}
        drafts = offered.get((result.accepted, result.next_token), tail_drafts)
        following = Run(state.take_run_id(), run.first_draft_pos + result.accepted, [result.next_token, *drafts],
                        list(drafts), None, proposed=len(drafts), sent_at=d.verdict_at, looped=True)  # fmt: skip
        d.inflight.append(following)
        d.stats.looped_runs += 1
