"""Rejection mode (``verification="rejection"``, DSSD): a chain of drafts sampled by the client's
draft model, verified by the rejection rule instead of token match.

Each run sends q(x) of its drafts (float16, ``Step.draft_q``); the tail accepts draft i with
probability min(1, p/q) using its (seed, position) generator, and on the first rejection sends
the top-K of its processed p there. The client, which has q, draws the token at the rejected
position from norm(max(0, p - q)) over that top-K (protocol/sampling.py). One run in flight; no
hedged drafts (a hedge is not a sample of q after the verdict's tokens).

The client draft model itself is a drafter (client/draft_model.py), usable by any mode that
verifies by token match; this mode is the one that needs its q.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from client._runs import Run
from client.errors import ServerError
from client.modes.chain import ChainMode
from client.modes.view import NextRun
from protocol.messages import StepResult, TokenLogprobs
from protocol.sampling import pack_f16, sample_correction, unpack_f16


class RejectionMode(ChainMode):
    def next_run(self, tokens_left: int) -> Optional[NextRun]:
        decision = super().next_run(tokens_left)
        run = decision.run
        if run.drafts:  # one run in flight, drafted just now: last_q is this run's
            drafter = self.view.drafter
            n = len(run.drafts)
            run.draft_q, run.q_dists = list(drafter.last_q[:n]), list(drafter.last_dists[:n])
        return decision

    def drafts(self, room: int) -> tuple[list[int], bool]:
        drafter = self.view.drafter
        if drafter is None or room <= 0:
            return [], False
        size = min(room, drafter.draft_cap)
        return drafter.draft(size)[:size], False

    def step_fields(self, run: Run) -> dict[str, Any]:
        return {"draft_q": pack_f16(run.draft_q)} if run.draft_q else {}

    def corrected(self, run: Run, result: StepResult) -> StepResult:
        """A rejection's verdict with the client's token at the rejected position: drawn from
        norm(max(0, p - q)) over the top-K of p the tail sent (protocol/sampling.py)."""
        if not run.q_dists or not 0 <= result.accepted < len(run.q_dists):
            return super().corrected(run, result)
        ids, probs = result.correction_ids, unpack_f16(result.correction_p)
        q = run.q_dists[result.accepted]
        if not ids or len(probs) != len(ids) or not all(0 <= i < q.numel() for i in ids):
            raise ServerError(
                f"a malformed correction: {len(ids)} ids, {len(probs)} probabilities", self.view.state.remote.tail_peer
            )
        token = sample_correction(ids, probs, q, self.view.sampling.seed, run.first_draft_pos + result.accepted)
        logprobs = result.logprobs
        if logprobs:  # the tail reported its own token at the rejected position: report ours
            last = logprobs[-1]
            known = dict(zip(last.top_ids, last.top_logprobs))
            fixed = TokenLogprobs(token, known.get(token, float("nan")), last.top_ids, last.top_logprobs)
            logprobs = logprobs[:-1] + [fixed]
        return msgspec.structs.replace(result, next_token=token, logprobs=logprobs)
