"""The Step of a looped run (docs/protocol.md, "Looped runs"), built by one function for both ends.

The tail builds the run it starts at the head after a verdict (server/looped_runs.py), and the
client, which never sees that Step, must compute the digest of exactly what the tail will verify
(protocol/digest.py binds every field): one builder for both, so the two cannot drift apart. The
head may swap the drafts for the client's offered ones; the verdict names the drafts the run
carried (``StepResult.run_drafts``), which the client passes here as ``drafts``.
"""

from __future__ import annotations

from typing import Sequence

from protocol.messages import Step


def following_step(step: Step, accepted: int, next_token: int, drafts: Sequence[int]) -> Step:
    """The run after ``step``'s verdict (``accepted`` drafts, then ``next_token``), with ``drafts``:
    from the verdict's end, the next run id, one loop fewer, and the same log-prob and tail-draft asks;
    every other field (outputs, trees, rejection q, bisection boundary) at its default, as those runs
    are never looped."""
    return Step(
        session_id=step.session_id,
        run_id=step.run_id + 1,
        start_pos=step.start_pos + len(step.token_ids) - step.n_draft + accepted,
        token_ids=[next_token, *drafts],
        n_draft=len(drafts),
        top_logprobs=step.top_logprobs,
        tail_drafts=step.tail_drafts,
        loop_runs=step.loop_runs - 1,
    )
