"""Audits of the top-K log-probs that verdicts return (``num_logprobs``; docs/reliability.md,
"Forward passes and log-probs").

A tail can commit the right tokens and lie in the log-probs it returns with them (what evaluation
and ranking code reads). The verdict audits' shadow tail (client/_verdict_audits.py) asks for the
same ``top_logprobs`` as the live laps (so its Steps look the same) and its verdicts' log-probs are
compared here with the ones the live tail returned for the same positions. Two entries agree when
they name the same token, its log-probs differ by at most :func:`logprob_tolerance`, every id both
top lists name has log-probs that close, and an id only one list names is no likelier (within the
tolerance) than the other list's last: near-ties at the K-th place may swap honestly. A disagreement
is a dispute settled by the verdicts' evidence rule (a trusted shadow or tail convicts; otherwise
both tails are avoided and the generation re-verifies on another route, whose verdicts bring the
log-probs again).
"""

from __future__ import annotations

from typing import Optional, Sequence

from protocol.messages import TokenLogprobs

# about twice the largest honest absolute difference of a top-20 log-prob between two routes
# (benchmarks/forward_spread.py, SmolLM2-135M on the CPU, 4 prompts of 96 random tokens: float32 0
# exactly, bfloat16 at most 0.32); quantized weights or an unknown dtype get 1. A lie under the bound
# goes unseen: in 16-bit, log-probs are worth about half a nat (a factor 1.9 in probability) as checked.
LOGPROB_TOLERANCES = {"float32": 1e-3, "bfloat16": 0.64, "float16": 0.64}
LOGPROB_TOLERANCE_OTHER = 1.0


def logprob_tolerance(records: Sequence) -> float:
    """The loosest bound of the servers' records (None: an unknown record, the loosest)."""
    return max(
        LOGPROB_TOLERANCES.get(r.dtype, LOGPROB_TOLERANCE_OTHER)
        if r is not None and (r.quantization or "none") == "none"
        else LOGPROB_TOLERANCE_OTHER
        for r in records
    )


def entries_agree(a: TokenLogprobs, b: TokenLogprobs, tol: float) -> bool:
    if a.token_id != b.token_id or abs(a.logprob - b.logprob) > tol:
        return False
    ours, theirs = dict(zip(a.top_ids, a.top_logprobs)), dict(zip(b.top_ids, b.top_logprobs))
    if any(abs(value - theirs[i]) > tol for i, value in ours.items() if i in theirs):
        return False
    for mine, other in ((ours, theirs), (theirs, ours)):
        floor = min(other.values(), default=float("-inf"))
        if any(value > floor + tol for i, value in mine.items() if i not in other):
            return False
    return True


def verdict_difference(a, b, tol: float) -> float:
    """How far two verdicts on the same Step (StepResults) are apart: infinite when they accept
    other counts, name other next tokens, carry other numbers of log-prob entries or entries that do
    not agree within ``tol`` (:func:`entries_agree`); else the largest difference of a log-prob both
    name (spot-checks compare two routes' verdicts with this: client/_spot_checks.py)."""
    inf = float("inf")
    if a.accepted != b.accepted or a.next_token != b.next_token or len(a.logprobs or ()) != len(b.logprobs or ()):
        return inf
    worst = 0.0
    for x, y in zip(a.logprobs or (), b.logprobs or ()):
        if not entries_agree(x, y, tol):
            return inf
        theirs = dict(zip(y.top_ids, y.top_logprobs))
        shared = [abs(v - theirs[i]) for i, v in zip(x.top_ids, x.top_logprobs) if i in theirs]
        worst = max(worst, abs(x.logprob - y.logprob), *shared)
    return worst


def first_disagreement(
    live: Sequence[TokenLogprobs], offset: int, shadow: Optional[Sequence[TokenLogprobs]], count: int, tol: float
) -> Optional[tuple[int, str, TokenLogprobs, TokenLogprobs]]:
    """The first of ``count`` positions where the shadow's entries (from index 0) and the live ones
    (from ``offset``) disagree, what they said, and the two entries (the live one first: the evidence
    of client/_output_evidence.py checks them); None when they agree or either is missing (a
    re-verification refills the live ones; nothing asked: nothing to compare)."""
    for i in range(min(count, len(shadow or ()))):
        if not 0 <= offset + i < len(live):
            return None
        a, b = live[offset + i], shadow[i]
        if not entries_agree(a, b, tol):
            return i, f"log-probs {a.logprob:.4g} (live) and {b.logprob:.4g} (shadow) of token {a.token_id}", a, b
    return None
