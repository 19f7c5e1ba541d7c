"""Re-verification: a generation leaves a route with a convicted or disputed server and re-verifies
every token it generated on a route without it (docs/reliability.md, "Verdict audits", "Disputes").

A mixin of :class:`client._generation.SpeculativeDecoder` (its lap loop calls these between laps):
apart because it is one job, what a caught liar or an unsettled dispute costs the generation, and
the decoder's module stays readable. The replay is sent as live-sized runs (at most
``num_draft_tokens`` drafts a Step), so a tail cannot tell a re-verification from a live lap.
"""

from __future__ import annotations

import logging
from typing import Optional

from client._runs import Run
from client.modes import NextRun

logger = logging.getLogger(__name__)


class Reverification:
    async def _react_to_liars(self) -> None:
        """A server of this generation's routes was caught lying (by an audit of this or any
        generation of the client), or disputed without settlement (``avoid``, this generation's):
        leave the route, and re-verify every token this call generated on the new one (routed
        around both). The prompt goes as committed ids, the generated tokens as drafts, so the
        new tail accepts exactly those its own choices (the exact rule) reproduce."""
        caught = ((self.swarm.liars | self.avoid) & self._route_peers) - self._handled_liars
        if not caught:
            return
        self._handled_liars |= caught
        state = self.state
        generated = len(state.history) - self._prompt_len + len(self._replay)
        what = f"re-verifying {generated} generated tokens without {sorted(caught)}"
        self.stats.spot_check_events.append(f"lap {self.stats.laps}: {what}")
        logger.warning(f"A server of this generation was caught lying or disputed: {what}")
        self._forget_inflight()  # the session closes below, on every server
        self.mode.forget()
        self.verdict_at = None
        if state.remote is not None:
            await self.swarm.close_session(state.remote)
            state.remote = None
        self._replay = state.history[self._prompt_len :] + self._replay
        state.history, state.cached = state.history[: self._prompt_len], 0
        self.live_logprobs.clear()  # the re-verification's verdicts bring them again
        self.trusted_tail.clear()  # the re-verification's tail commits them again
        if self.audits is not None:
            self.audits.forget_runs()  # replayed by token match: no rejection run's record holds
        if self.drafter is not None:
            self.drafter.reset(state.history)

    def _replay_run(self, tokens_left: int) -> Optional[NextRun]:
        """A re-verification run, alone in the window: the committed ids the caches lack, then as
        many of the tokens to re-verify as drafts as one Step takes (the rest in later laps)."""
        if self.inflight:
            return None
        state = self.state
        committed = state.history[state.cached :]
        room = min(
            tokens_left - 1,
            state.max_length - len(state.history) - 1,
            state.remote.max_positions_per_step - len(committed),
        )
        drafts = self._replay[: max(0, min(room, max(1, self.num_draft_tokens)))]  # live-sized
        return NextRun(Run(state.next_run_id, state.cached, committed + drafts, drafts, None, replay=True))

    def _reconcile(self, new: list[int]) -> list[int]:
        """The tokens of a verdict that are news to the caller: those re-confirming tokens committed
        before a re-verification are not; at the first that differs, the rest of them is retracted."""
        for i, token in enumerate(new):
            if self._replay and token == self._replay[0]:
                self._replay.pop(0)
                continue
            if self._replay:
                self.stats.tokens_retracted += len(self._replay)
                logger.warning(
                    f"Re-verification replaced {len(self._replay)} tokens committed before a liar was caught"
                )
                self._replay = []
            return new[i:]
        return []
