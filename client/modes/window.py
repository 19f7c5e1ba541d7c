"""Async window mode (``async_speculation=True``): up to ``max_inflight_runs`` runs in flight.

Each new run assumes every run before it is accepted whole and guesses its bonus token (the
drafter's next token after its drafts). A run sent into an empty window carries only
``front_drafts`` of its proposal (none by default) and the rest rides in the run behind it, so
the front verdict never waits for the drafts' compute: where the first draft is wrong, the lap is
as short as a lap without speculation. The oldest run always starts from committed tokens, so
every lap commits at least one token; a verdict that refutes what later runs assumed cancels them
(the lap loop does, with one ID-only message). Where the drafter's cap is 0 (the cost model finds
that no draft pays), no guess is made either: a guess is a draft that rides in the run behind.
"""

from __future__ import annotations

from typing import Optional

from client._runs import Run
from client.modes.chain import ChainMode
from client.modes.view import DecoderView, NextRun


class WindowMode(ChainMode):
    def __init__(self, view: DecoderView, window: int, front_drafts: Optional[int]) -> None:
        super().__init__(view)
        self.window = window
        self.front_drafts = front_drafts  # drafts a run sent into an empty window keeps (None: all)

    def next_run(self, tokens_left: int) -> Optional[NextRun]:
        v, state = self.view, self.view.state
        if v.inflight:
            last = v.inflight[-1]
            if last.guess is None:
                return None
            start_pos, committed, assumed = last.start_pos + len(last.token_ids), [last.guess], self.assumed()
        else:
            start_pos, committed, assumed = state.cached, state.history[state.cached :], []
        # drafts and committed ids together stay within one Step's positions
        room = min(self.room(tokens_left, len(assumed)), state.remote.max_positions_per_step - len(committed))
        if v.inflight and room < 1:
            return None
        proposal, num_drafts, hedged = self.proposal(room, assumed)
        self.hedges.clear()
        # the drafts are what synchronous speculation would send; the guess is one more token,
        # made only where the drafter continues past them (else nothing is sent behind this run)
        drafts, guess = proposal[:num_drafts], (proposal[num_drafts] if len(proposal) > num_drafts else None)
        if v.inflight and not drafts and guess is None:
            return None
        proposed = len(drafts)
        if self.light_front(drafts, tokens_left):
            drafts, guess = drafts[: self.front_drafts], drafts[self.front_drafts]
        if guess is not None and guess in v.eos_token_ids:
            guess = None  # nothing follows an end of sequence
        prefix = len(v.inflight[-1].drafts) + 1 if v.inflight and v.inflight[-1].split else 0
        return NextRun(Run(state.next_run_id, start_pos, committed + drafts, drafts, guess, prefix, proposed), hedged)

    def proposal(self, room: int, assumed: list[int]) -> tuple[list[int], int, bool]:
        """The drafter's proposal after ``assumed`` (the drafts and the guess), how many of it are
        drafts, and whether it is a hedge made before the last verdict (only into an empty window)."""
        drafter = self.view.drafter
        if drafter is None or room <= 0:
            return [], 0, False
        num_drafts = min(room, drafter.draft_cap)
        if num_drafts == 0:  # the cost model says no draft pays: nor does a guess, a draft in the run behind
            return [], 0, False
        size = self.proposal_size(num_drafts)
        # a verdict's tail drafts (TailDrafts) postdate every hedge: the drafter chooses afresh
        hedged = None if self.view.inflight or drafter.fresh else self.hedges.take(self.view.state.history)
        if hedged is not None:
            return hedged[:size], num_drafts, True
        return drafter.draft(size, after=assumed), num_drafts, False

    def proposal_size(self, num_drafts: int) -> int:
        """The drafts, plus the guess: runs may follow this one."""
        return num_drafts + 1

    def assumed(self) -> list[int]:
        """The tokens the runs in flight add if each is accepted whole with its guess."""
        return [tok for run in self.view.inflight for tok in (*run.drafts, run.guess)]

    def light_front(self, drafts: list[int], tokens_left: int) -> bool:
        """Whether a run sent into an empty window keeps only ``front_drafts`` of its drafts, the
        rest riding in the run behind it (its verdict then comes back sooner when its first drafts
        fail): only if the draft at the cut, the guess, is no EOS (something must follow it) and
        the tokens left leave room for a run behind it."""
        cut = self.front_drafts
        if self.view.inflight or cut is None or len(drafts) <= cut:
            return False
        return drafts[cut] not in self.view.eos_token_ids and self.room(tokens_left, cut + 1) >= 1
