"""Verdict audits under rejection sampling (``verification="rejection"``; docs/reliability.md,
"Verdict audits", "Rejection sampling").

Under the rejection exchange a committed token is not the seeded choice a token-match shadow
reproduces: an accepted draft was drawn by the client from its draft model's q, and at the first
rejection the client draws the token from norm(max(0, p - q)) over the tail's top-K of p
(client/modes/rejection.py). But every decision is deterministic given the target's p, the drafts,
their q and the seed: draft i at position t is accepted when u * q(x) < p(x), with u from the
(seed, t, "accept") stream; the correction is drawn from the (seed, t, "correct") stream; the bonus
token from (seed, t). So the client records each live run's drafts with their q (``RejectionRuns``),
and the shadow replays the same drafts with the same ``draft_q`` and seed: an honest shadow of the
same precision accepts the same drafts, and the client, drawing the correction from the shadow's
top-K with its own q, gets the same token. Runs without q (a re-verification's replay, a run with no
drafts) are plain token match. A Step of the audit is then the live run's own Step (its drafts, q,
sampling), so a tail cannot tell them apart either.

Log-probs are not compared under rejection (the client rewrites the one at a correction), and a
dispute is settled by the shadow or the tail being trusted (a trusted third verifies by token match,
which the rejection rule is not) or by evidence: the client records the shadow's decision on a disputed
draft (``shadow_accepted``) beside the live run's, and, where both rejected it, both tails' top-K of p
(``RecordedRun.correction``, ``shadow_corrections``); client/_processed_evidence.py refutes a decision
or a top-K only where no honest p allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import msgspec
import torch

from client._runs import Run
from client.errors import ServerError
from protocol.messages import StepResult
from protocol.sampling import pack_f16, sample_correction, unpack_f16


@dataclass
class RecordedRun:
    """A live rejection run: its first draft's position, its drafts, q(x) of each, q at each, and
    how many drafts its verdict accepted."""

    first: int
    drafts: list[int]
    q: list[float]
    dists: list[torch.Tensor]
    accepted: int
    correction: Optional[tuple[list[int], list[float]]] = None  # the tail's top-K of p at a rejection

    @property
    def end(self) -> int:
        """The position after the last draft whose verdict this run decided (a rejected one's included)."""
        return self.first + min(self.accepted + 1, len(self.drafts))


class RejectionRuns:
    """The generation's live rejection runs, by the position of their first draft."""

    def __init__(self) -> None:
        self.runs: dict[int, RecordedRun] = {}
        self.shadow_accepted: dict[int, bool] = {}  # a disputed draft's position: whether the shadow accepted it
        self.shadow_corrections: dict[int, tuple[list[int], list[float]]] = {}  # there: the shadow's top-K of p

    def record(self, run: Run, result: StepResult) -> None:
        """A live run's verdict (after the client's correction): its accepted count and, at a rejection,
        the top-K of p the tail sent (evidence settles two tails' different corrections by it)."""
        if run.draft_q and not run.replay:
            first, accepted = run.first_draft_pos, result.accepted
            correction = _claim(result)
            recorded = RecordedRun(first, list(run.drafts), list(run.draft_q), list(run.q_dists), accepted, correction)
            self.runs[first] = recorded

    def forget(self) -> None:
        """A re-verification re-commits every generated token by token match: no record holds."""
        self.runs.clear()
        self.shadow_accepted.clear()
        self.shadow_corrections.clear()

    def covering(self, position: int) -> Optional[tuple[RecordedRun, int]]:
        """The recorded run whose drafts include ``position``, and the index of that draft there."""
        for first, run in self.runs.items():
            if first <= position < run.end:
                return run, position - first
        return None

    def next_start(self, position: int) -> Optional[int]:
        later = [first for first in self.runs if first > position]
        return min(later) if later else None

    def drafts_at(self, position: int) -> int:
        """How many drafts the recorded run covering ``position`` still has there (0: none covers it)."""
        found = self.covering(position)
        return len(found[0].drafts) - found[1] if found else 0

    def replay(self, ids: Sequence[int], position: int, room: int) -> tuple[list[int], Optional[bytes], bool]:
        """The drafts (at most ``room``) a shadow Step from ``position`` carries, their q (float16;
        None: token match), and whether ``room`` cut a recorded run's drafts short (then the token
        after the last one is the seeded choice, not the live run's: not comparable): the recorded
        run's drafts from there, else the committed ids up to the next recorded run."""
        found = self.covering(position)
        if found is not None:
            run, i = found
            drafts, q = run.drafts[i : i + room], run.q[i : i + room]
            return drafts, pack_f16(q) if drafts else None, len(run.drafts) - i > room
        start = self.next_start(position)  # a recorded run's first draft: its token is no seeded choice
        end = min(len(ids), start - 1 if start is not None else len(ids))  # the verdict's own token lands there
        return list(ids[position : min(end, position + room)]), None, False

    def chosen(self, result: StepResult, drafts: list[int], position: int, seed: int) -> list[int]:
        """What the live client would commit after the shadow's verdict: the accepted drafts, then
        the client's correction from the shadow's top-K (with its own q) or the bonus token."""
        a = result.accepted
        if result.correction_ids is None or a >= len(drafts):
            return [*drafts[:a], result.next_token]
        found = self.covering(position + a)
        if found is None:
            raise ValueError(f"a correction at position {position + a}, where no rejection run was sent")
        run, i = found
        probs = unpack_f16(result.correction_p)
        ids = list(result.correction_ids)
        q = run.dists[i]
        if not ids or len(probs) != len(ids) or not all(0 <= t < q.numel() for t in ids):
            raise ValueError(f"a malformed correction: {len(ids)} ids, {len(probs)} probabilities")
        return [*drafts[:a], sample_correction(ids, probs, q, seed, position + a)]


async def confirm(auditor, route, ids: list[int], position: int, limit: int, stats, first: int) -> None:
    """``VerdictAuditor._confirm`` under rejection sampling: confirm ids[position:] by replaying the
    live runs' Steps (drafts, q, seed) on the shadow, one verdict at a time (rejection runs never
    loop); the first Step carries ids[first:position], the context the shadow lacks."""
    shadow, runs, seed = auditor._shadow, auditor.rejection, auditor.sampling.seed
    while position < len(ids):
        if position - first > 1 and position - first + runs.drafts_at(position) > limit:
            await auditor._step(first, ids[first : position - 1], 0, stats)  # the context first, then the run
            first = position - 1
        context = ids[first:position]
        drafts, q, cut = runs.replay(ids, position, max(0, limit - len(context)))
        run_id = auditor._next_run
        step = auditor._shaped(shadow, run_id, position - len(context), [*context, *drafts], len(drafts))
        stats.verdict_audit_positions += len(step.token_ids) * len(shadow.route)
        await shadow.send_step(step if q is None else _with_q(step, q))
        result = await shadow.next_result(run_id)
        auditor._next_run = run_id + 1
        if result.run_id != run_id or not 0 <= result.accepted <= len(drafts):
            raise ServerError(f"the shadow's verdict {result.run_id} for run {run_id} is amiss", shadow.tail_peer)
        try:
            chosen = runs.chosen(result, drafts, position, seed)
            chosen = chosen[: len(ids) - position][: len(drafts) if cut and result.accepted == len(drafts) else None]
        except ValueError as e:
            raise ServerError(f"the shadow's verdict on run {run_id}: {e}", shadow.tail_peer) from None
        for i, token in enumerate(chosen):
            if token != ids[position + i]:  # the shadow's decision there, for client/_processed_evidence.py
                runs.shadow_accepted[position + i] = i < result.accepted
                claim = _claim(result)
                if i == result.accepted and claim is not None:
                    runs.shadow_corrections[position + i] = claim
                await auditor._dispute(route, ids, position + i, token, stats)
                return
        auditor.confirmed_by(shadow.tail_peer, range(position, position + len(chosen)))
        position += len(chosen)
        first = position - 1  # the next Step carries the last confirmed token (it may overwrite a rejected draft)
        auditor._held = auditor._verified = position
        auditor.audited = ids[: max(position, len(auditor.audited))]


def _claim(result: StepResult) -> Optional[tuple[list[int], list[float]]]:
    """A verdict's top-K of p at its rejection (ids, float16 probabilities as read); None without one."""
    if result.correction_ids is None:
        return None
    return list(result.correction_ids), unpack_f16(result.correction_p)


def _with_q(step, q: bytes):
    return msgspec.structs.replace(step, draft_q=q)
