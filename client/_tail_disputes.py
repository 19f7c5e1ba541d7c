"""Where two verdicts of a spot-check of the tail hop differ, and the evidence that settles it
(client/_spot_checks.py; docs/reliability.md, "Disputes settled by evidence").

A spot-check of the tail replays the same Step on two routes that differ only in the tail. Two
honest tails name the same tokens and log-probs within the dtype's bound; where they do not, one of
them lies, and a stranger's vote cannot say which (one operator can run both the substitute and the
third). The client settles it itself with the verdict audits' evidence rule (client/_evidence_disputes.py):

- the verdicts name different tokens (:func:`first_difference`): each tail's final hidden state at the
  first differing position and the two tokens' LM-head rows (client/_evidence.py);
- they name the same tokens but other log-probs (:func:`first_disagreeing_entry`): the two entries at
  the first position that disagrees, recomputed from each tail's hidden state over the whole head
  (client/_output_evidence.py). Without this a log-prob liar's spot-check stayed undecided, and the
  honest substitute was avoided with it.

The refuted tail is convicted only when every hop before it is trusted (strangers fed both tails'
hidden states); otherwise it is avoided with its machine group, and the other side is not.
"""

from __future__ import annotations

from typing import Optional, Sequence

from client._logprob_audits import first_disagreement
from protocol.messages import Hop, StepResult, TokenLogprobs


def first_difference(ids: Sequence[int], drafts: int, a: StepResult, b: StepResult) -> Optional[tuple[int, int, int]]:
    """Where two verdicts on ``ids`` (its last ``drafts`` ids sent as drafts) first name different
    tokens: (position t, ``a``'s token there, ``b``'s); None where they name the same tokens (only
    their log-probs differ) or one accepts more drafts than were sent."""
    base = len(ids) - drafts
    if not (0 <= a.accepted <= drafts and 0 <= b.accepted <= drafts):
        return None
    claims_a = [*ids[base : base + a.accepted], a.next_token]
    claims_b = [*ids[base : base + b.accepted], b.next_token]
    for i, (x, y) in enumerate(zip(claims_a, claims_b)):
        if x != y:
            return base + i, x, y
    return None


def first_disagreeing_entry(
    ids: Sequence[int], drafts: int, a: StepResult, b: StepResult, tol: float
) -> Optional[tuple[int, TokenLogprobs, TokenLogprobs]]:
    """Two verdicts that name the same tokens: the first position whose top-K log-prob entries disagree
    beyond ``tol`` (client/_logprob_audits.py ``entries_agree``) and the two entries (``a``'s first).
    Entry i of a verdict is the distribution of the token at position len(ids) - drafts + i. None where
    the tokens differ, a count is out of range, or the two carry other numbers of entries (nothing to pair)."""
    base = len(ids) - drafts
    if not 0 <= a.accepted <= drafts or (a.accepted, a.next_token) != (b.accepted, b.next_token):
        return None
    entries_a, entries_b = list(a.logprobs or ()), list(b.logprobs or ())
    if not entries_a or len(entries_a) != len(entries_b):
        return None
    found = first_disagreement(entries_a, 0, entries_b, len(entries_a), tol)
    return None if found is None else (base + found[0], found[2], found[3])


async def settle_by_evidence(
    checker, route: list[Hop], alt_route: list[Hop], ids, drafts: int, verdicts, tol: float, result, stats
) -> None:
    """The two tails' verdicts differ (``verdicts``: the route's, the substitute's): ``checker.evidence``
    (the verdict auditor) settles which one no honest tail gives, and ``result`` (client/_spot_checks.py
    ``AuditResult``) says who is refuted; left as it was where nothing is settled."""
    evidence = checker.evidence
    if evidence is None:
        return
    found = first_difference(ids, drafts, *verdicts)
    if found is not None:
        t, said, claim = found
        settled = await evidence.settle_tails(route, alt_route, [*ids[:t], said], t, claim, stats)
        what = f"evidence at position {t} ({said} against {claim})"
    else:
        entry = first_disagreeing_entry(ids, drafts, *verdicts, tol)
        if entry is None:
            return
        t, said, claim = entry
        settled = await evidence.settle_tail_logprobs(route, alt_route, list(ids[:t]), t, (said, claim), stats)
        numbers = f"{said.logprob:.4g} against {claim.logprob:.4g}"
        what = f"evidence at position {t} (log-probs of token {said.token_id}: {numbers})"
    if settled is None:
        return
    result.detail += f"; {what}: {settled.detail}"
    if settled.refuted is None:  # a near tie may lean against one side: the generation falls back on it last
        result.against = {"tail": route[-1].peer_id, "shadow": alt_route[-1].peer_id}.get(settled.leans)
        result.detail += f"; the near tie leans against {result.against}" if result.against else ""
        return
    refuted = route[-1].peer_id if settled.refuted == "tail" else alt_route[-1].peer_id
    trusted_before = all(checker.witnesses.is_trusted(hop.peer_id) for hop in route[:-1])
    result.verdict, result.disputed = "convicted" if trusted_before else "refuted", ()
    result.liar, result.by_evidence = refuted, True
    result.detail += f"; {refuted} refuted" + ("" if trusted_before else " (hops before the tail not all trusted)")
    await checker.witnesses.refresh(checker.swarm.p2p)  # its group-mates' addresses, for the avoidance
