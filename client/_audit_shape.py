"""What a generation's live laps look like to a tail, which every audit Step copies
(docs/reliability.md, "Audits look like live laps").

A tail that can tell an audit's Step from a live lap's can lie only where no audit looks, or frame
only where audits look (tests/kit/faults.py ``frame``). So the verdict audits and third opinions
send Steps with what a tail sees of a live lap: the verdict audits' runs replay the live laps' own
drafts, rejected ones too (:meth:`LiveShape.drafts_at`), so an honest tail accepts as many as it did
live; a third opinion's Step carries one draft (the disputed token); a next token is confirmed per Step
as a live lap commits one; and the generation's session ``max_length`` (client/_verdict_audits.py).
Live laps ask for at least ``LIVE_TOP_LOGPROBS`` top log-prob per committed token (a few bytes each),
so that spot-checks verify through an ordinary verdict and compare its log-probs, never asking for the
returned logits no live lap asks for (client/_spot_checks.py). And ``loop_runs``: where the live laps
ask the tail to start each next run itself, the shadow's Steps ask for as many looped runs as a live lap
at the same position would (:meth:`LiveShape.loop_runs_at`), and consume the runs the tail starts as the
live client does: it offers the next live lap's drafts as the next run's (DraftOffer), compares each
looped verdict's tokens with the committed ones, and cancels the looped run past the last committed
token (Cancel).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

LIVE_TOP_LOGPROBS = 1  # the fewest top log-probs a live Step asks for (num_logprobs may ask more)


@dataclass
class LiveShape:
    num_draft_tokens: int = 8  # the most drafts a live lap carries (generate(num_draft_tokens=...))
    drafts: list[int] = field(default_factory=list)  # drafts each live lap carried, in order
    num_logprobs: int = 0  # top log-probs each live Step asks for (audit Steps ask for as many)
    logprobs: list = field(default_factory=list)  # the live verdicts' log-probs, one per generated token
    # every live verdict's log-probs (LIVE_TOP_LOGPROBS at least), asked for by the caller or not, one per
    # generated token: spot-checks compare their replays with them (client/_live_agreement.py)
    committed_logprobs: list = field(default_factory=list)
    loop_end: int = 0  # live laps loop: a lap from history length h asks for loop_end - h - 1 runs (0: no loops)
    laps: dict[int, list[int]] = field(default_factory=dict)  # a live lap's first draft position -> its drafts

    def saw_lap(self, first: int, drafts: list[int]) -> None:
        """A live lap's verdict arrived; it carried ``drafts`` from position ``first``. A lap at or before
        one already seen (a re-verification replays the generation from a disputed position) drops the
        later ones: their positions no longer hold the committed tokens they were drafted against."""
        self.drafts.append(len(drafts))
        if self.laps and first <= next(reversed(self.laps)):
            self.laps = {p: d for p, d in self.laps.items() if p < first}
        self.laps[first] = list(drafts)

    def draft_count(self, rng: random.Random, cap: int) -> int:
        """Drafts for the next audit Step: a live lap's count (uniform over the laps so far; the
        most a lap may carry before the first), at most ``cap``."""
        count = rng.choice(self.drafts) if self.drafts else self.num_draft_tokens
        return max(0, min(count, self.num_draft_tokens, cap))

    def drafts_at(self, ids: list[int], position: int, rng: random.Random, room: int) -> list[int]:
        """An audit Step's drafts from ``position`` (at most ``room``): the live lap's own drafts there, its
        rejected ones too, so that an honest tail accepts as many as the live tail did and names the same
        next token; where no live lap's drafts began there (a window's end cut a lap, a tree lap), a live
        lap's count of committed tokens, up to the next live lap's first draft (from there the Steps replay
        the laps again). Why: with committed tokens alone an honest tail accepted every draft of every
        audit Step, where live laps' drafts are guesses (measured: benchmarks/audit_tells.py), so a tail
        could tell audits apart by its own verdicts and frame only there (tests/kit/faults.py
        ``AcceptanceTell``)."""
        lap = self.laps.get(position)
        if lap is not None:
            return lap[: max(0, room)]
        count = self.draft_count(rng, min(room, len(ids) - position))
        later = [p for p in self.laps if p > position]
        if later:
            count = min(count, min(later) - position - 1)
        return list(ids[position : position + max(0, count)])

    def loop_runs_at(self, history: int) -> int:
        """``loop_runs`` of a live lap sent from history length ``history`` (LoopedMode.step_fields:
        the tokens the generation may still commit, less one), 0 where the live laps do not loop."""
        return max(0, self.loop_end - history - 1) if self.loop_end else 0


def committed_prefix(ids: list[int], position: int, drafts: list[int]) -> int:
    """How many of ``drafts`` (from ``position``) are the committed tokens there: what an honest tail accepts."""
    for i, draft in enumerate(drafts):
        if position + i >= len(ids) or draft != ids[position + i]:
            return i
    return len(drafts)
