"""Async window mode (``async_speculation=True``): up to ``max_inflight_runs`` runs in flight.

Each new run assumes every run before it is accepted whole and guesses its bonus token (the
drafter's next token after its drafts). A run sent into an empty window carries only
``front_drafts`` of its proposal (none by default) and the rest rides in the run behind it, so
the front verdict never waits for the drafts' compute: where the first draft is wrong, the lap is
as short as a lap without speculation. The oldest run always starts from committed tokens, so
every lap commits at least one token; a verdict that refutes what later runs assumed cancels them
(the lap loop does, with one ID-only message).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from client._runs import Run
from client.modes.chain import ChainMode

if TYPE_CHECKING:
    from client._generation import SpeculativeDecoder


class WindowMode(ChainMode):
    def __init__(self, decoder: "SpeculativeDecoder", window: int, front_drafts: Optional[int]) -> None:
        super().__init__(decoder)
        self.window = window
        self.front_drafts = front_drafts  # drafts a run sent into an empty window keeps (None: all)

    def next_run(self, budget: int) -> Optional[Run]:
        d, state = self.decoder, self.decoder.state
        if d.inflight:
            last = d.inflight[-1]
            if last.guess is None:
                return None
            start_pos, committed, assumed = last.start_pos + len(last.token_ids), [last.guess], self.assumed()
        else:
            start_pos, committed, assumed = state.cached, state.history[state.cached :], []
        # drafts and committed ids together stay within one Step's positions
        room = min(self.room(budget, len(assumed)), d.state.remote.max_positions_per_step - len(committed))
        if d.inflight and room < 1:
            return None
        proposal: list[int] = []
        num_drafts = 0
        if d.drafter is not None and room > 0:
            num_drafts = min(room, d.drafter.draft_cap)
            size = self.proposal_size(num_drafts)
            # a verdict's tail drafts (TailDrafts) postdate every hedge: the drafter chooses afresh
            fresh = d.drafter.fresh
            hedged = None if d.inflight or fresh else d.hedges.take(state.history)
            if hedged is not None:
                d.stats.hedge_hits += 1
                proposal = hedged[:size]
            else:
                proposal = d.drafter.draft(size, after=assumed)
        d.hedges.clear()
        # the drafts are what synchronous speculation would send; the guess is one more token,
        # made only where the drafter continues past them (else nothing is sent behind this run)
        drafts, guess = proposal[:num_drafts], (proposal[num_drafts] if len(proposal) > num_drafts else None)
        if d.inflight and not drafts and guess is None:
            return None
        proposed = len(drafts)
        if self.light_front(drafts, budget):
            drafts, guess = drafts[: self.front_drafts], drafts[self.front_drafts]
        if guess is not None and guess in d.eos_token_ids:
            guess = None  # nothing follows an end of sequence
        prefix = len(d.inflight[-1].drafts) + 1 if d.inflight and d.inflight[-1].split else 0
        return Run(state.take_run_id(), start_pos, committed + drafts, drafts, guess, prefix, proposed)

    def proposal_size(self, num_drafts: int) -> int:
        """The drafts, plus the guess: runs may follow this one."""
        return num_drafts + 1

    def assumed(self) -> list[int]:
        """The tokens the runs in flight add if each is accepted whole with its guess."""
        return [tok for run in self.decoder.inflight for tok in (*run.drafts, run.guess)]

    def light_front(self, drafts: list[int], budget: int) -> bool:
        """Whether a run sent into an empty window keeps only ``front_drafts`` of its drafts, the
        rest riding in the run behind it (its verdict then comes back sooner when its first drafts
        fail): only if the draft at the cut, the guess, is no EOS (something must follow it) and
        the budget leaves room for a run behind it."""
        cut = self.front_drafts
        if self.decoder.inflight or cut is None or len(drafts) <= cut:
            return False
        return drafts[cut] not in self.decoder.eos_token_ids and self.room(budget, cut + 1) >= 1
