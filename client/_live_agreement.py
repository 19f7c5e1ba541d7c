"""Whether a spot-check's replay of a live lap agrees with what that lap committed (docs/reliability.md,
"Spot-checks": "Against the live lap").

A spot-check verifies the last live lap again on two fresh sessions, one through the checked hop and
one through a substitute, and compares the two verdicts. A hop can tell those sessions from the live
one (they repeat the generation's prompt while its session is open), so a hop that lies in the live
session alone is honest in both, the two agree, and the lie was never seen: the wrong tokens were
returned (tests/hostile/test_spot_checks.py, the two-faced head). So the verdict both sessions agree
on is also compared with the lap the generation committed: the tokens it claims with the committed
ids at their positions, its log-probs with the live ones. They differ only if a server of the live
route answered the same ids differently in two sessions. Which one, the comparison cannot say (every
hop fed the live lap), so every untrusted hop of the route is a suspect, avoided for the rest of the
generation, which re-verifies its tokens without them; nobody is convicted. Under rejection sampling
the committed tokens are not the seeded choice the replay makes, so nothing is compared.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from client._logprob_audits import first_disagreement
from protocol.messages import Hop, StepResult, TokenLogprobs


def live_contradiction(
    committed: Sequence[int],
    replayed: Sequence[int],
    drafts: int,
    verdict: StepResult,
    live_logprobs: Sequence[TokenLogprobs],
    output_start: int,
    tol: float,
) -> Optional[str]:
    """Where ``verdict`` (on ``replayed``, its last ``drafts`` ids sent as drafts) contradicts the
    ``committed`` ids, or their ``live_logprobs`` (one per committed id from ``output_start``) beyond
    ``tol``; None where it agrees or nothing it claims was committed. A differing token that the
    verdict's own top log-probs put within ``tol`` of its choice is a near tie two honest passes may
    break apart (16-bit rounding), not a contradiction."""
    base = len(replayed) - drafts
    if not 0 <= verdict.accepted <= drafts:
        return f"the replay accepted {verdict.accepted} of {drafts} drafts"
    claims = [*replayed[base : base + verdict.accepted], verdict.next_token]
    count = max(0, min(len(claims), len(committed) - base))
    entries = list(verdict.logprobs or ())
    for i in range(count):
        if claims[i] == committed[base + i]:
            continue
        if base + i < output_start:  # drafts that reached back into the prompt, which no verdict committed
            return None
        if i < len(entries) and _near_tie(entries[i], committed[base + i], tol):
            return None
        return f"position {base + i}: the live lap committed {committed[base + i]}, the replays {claims[i]}"
    if len(live_logprobs) != len(committed) - output_start:  # not one entry per committed id: nothing to pair
        return None
    skip = max(0, output_start - base)  # entries of prompt positions: no live verdict had them
    found = first_disagreement(live_logprobs, base + skip - output_start, entries[skip:], count - skip, tol)
    if found is None:
        return None
    live, replay = found[2], found[3]
    return (
        f"position {base + skip + found[0]}: log-prob {live.logprob:.4g} of token {live.token_id} live, "
        f"{replay.logprob:.4g} in the replays"
    )


def _near_tie(entry: TokenLogprobs, committed: int, tol: float) -> bool:
    """Whether ``entry`` (the replay's) lists ``committed`` within ``tol`` of its own choice."""
    return any(i == committed and value >= entry.logprob - tol for i, value in zip(entry.top_ids, entry.top_logprobs))


def suspects(route: Sequence[Hop], is_trusted: Callable[[str], bool]) -> tuple[str, ...]:
    """The route's servers that may have answered the live lap differently: every untrusted one."""
    return tuple(hop.peer_id for hop in route if not is_trusted(hop.peer_id))
