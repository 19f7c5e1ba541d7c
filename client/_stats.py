"""What one generation did, for the caller (``model.last_generation_stats``) and the benchmarks, and
the sum of a batch's rows (``merged_stats``)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from protocol.tail_costs import TailCosts


@dataclass
class GenerationStats:
    """What the last ``generate`` call did; ``model.last_generation_stats``."""

    new_tokens: int = 0
    laps: int = 0  # verdicts that committed tokens
    drafted: int = 0  # draft tokens in those runs
    accepted: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)  # accepted drafts per lap -> laps
    runs_sent: int = 0
    # laps timed for the throughput meter, and those not (a prefill or replay, a run queued behind
    # another, a lap beside an audit: client/_generation.py, ``SpeculativeDecoder._time_lap``)
    laps_timed: int = 0
    laps_untimed: int = 0
    runs_cancelled: int = 0
    positions_wasted: int = 0  # positions servers computed (or were sent) for refuted runs
    wait_time: float = 0.0  # seconds the client spent waiting for verdicts
    turnaround_time: float = 0.0  # seconds from a verdict to the next run sent (client work)
    hedges_prepared: int = 0  # drafts made ahead for outcomes of runs in flight
    looped_runs: int = 0  # runs the tail started at the head (generate(loop_runs=True))
    offers_sent: int = 0  # DraftOffers: hedged drafts for a looped run's verdicts, sent to the head
    hedge_hits: int = 0  # front runs sent with a hedged draft instead of drafting after the verdict
    hedge_time: float = 0.0  # seconds spent hedging (while runs are in flight, before waiting)
    bytes_up: int = 0
    bytes_down: int = 0
    wall_time: float = 0.0
    route: list[tuple[str, int, int]] = field(default_factory=list)
    failovers: int = 0
    failover_events: list[str] = field(default_factory=list)
    failover_time: float = 0.0  # seconds from a failure to the next committed token
    corrections: int = 0  # rejections whose token the client drew from norm(max(0, p - q))
    # with tail drafts (client.drafting.TailDrafts): per source ("tail", "retrieval"), [proposals,
    # ids proposed, ids matching the committed text], measured on every proposal, sent or not;
    # and the laps whose run carried each source's drafts
    drafter_sources: dict = field(default_factory=dict)
    drafter_choices: dict = field(default_factory=dict)
    # token trees (draft_tree=True; client/_trees.py): laps sent in tree mode, the draft nodes they
    # carried and the drafts accepted on them, and laps by nodes sent (the sizes the cost model chose)
    tree_laps: int = 0
    tree_nodes: int = 0
    tree_accepted: int = 0
    tree_sizes: Counter = field(default_factory=Counter)
    # spot-checks (client/_spot_checks.py; docs/reliability.md, "Spot-checks")
    spot_checks: int = 0  # audits started
    spot_check_positions: int = 0  # server positions the audits computed, summed over servers
    spot_checks_skipped: int = 0  # audits drawn but not started: no hop of the route had a substitute
    spot_checks_failed: int = 0  # audits ended by a failing server (or their timeout): no verdict
    spot_checks_undecided: int = 0  # disagreements that no third server settled: nobody excluded
    spot_checks_by_evidence: int = 0  # tail-hop disagreements the client settled itself (client/_evidence.py)
    spot_checks_diverged: int = 0  # both replays agreed, not with the live lap: the route's untrusted servers avoided
    liars_excluded: list[str] = field(default_factory=list)  # peer ids outvoted by a third server
    tokens_retracted: int = 0  # committed (and streamed) tokens that a re-verification replaced
    spot_check_events: list[str] = field(default_factory=list)  # one line per audit: hop, peers, outcome
    # verdict audits (client/_verdict_audits.py; docs/reliability.md, "Verdict audits")
    verdict_audits: int = 0  # shadow Steps rounds started
    verdict_audit_positions: int = 0  # server positions they computed (shadow and third sessions, summed over servers)
    verdict_audits_skipped: int = 0  # no other server of the tail's blocks and precision: not audited
    verdict_audits_failed: int = 0  # ended by a failing server or their timeout: no verdict
    verdict_audit_detours: int = 0  # shadows sent around the route's other hops after a failed audit (_shadow_detour)
    verdict_audits_undecided: int = 0  # a disagreement no trusted server settled: nobody excluded
    verdict_audits_by_evidence: int = 0  # disagreements the client settled itself (client/_evidence.py)
    # servers seen disagreeing with another where nobody trusted settled it: avoided for the rest of
    # the generation, never convicted (docs/reliability.md, "Disputes")
    disputed_peers: list[str] = field(default_factory=list)
    # every returned token, by how a second tail confirmed it (client/_confirmation.py): by a trusted
    # server (a trusted shadow, or a trusted tail committed it), by an independent untrusted shadow,
    # or not at all (no independent shadow, an audit that failed or was disputed, rejection sampling)
    tokens_confirmed_trusted: int = 0
    tokens_confirmed_untrusted: int = 0
    tokens_unconfirmed: int = 0
    # what the verdicts' tails reported their verification cost (StepResult.tail_costs; verdicts
    # without a report add nothing): seconds of blocks over the runs' positions, and LM-head calls
    tail_positions: int = 0  # positions of the runs whose verdicts reported
    tail_blocks_time: float = 0.0
    tail_head_calls: int = 0
    tail_head_rows: int = 0
    tail_head_time: float = 0.0

    def add_tail_costs(self, positions: int, costs: Optional[TailCosts]) -> None:
        """Count one verdict's report of what its verification cost the tail."""
        if costs is not None:
            self.tail_positions += positions
            self.tail_blocks_time += costs.blocks_us * 1e-6
            self.tail_head_calls += len(costs.head_us)
            self.tail_head_rows += sum(costs.head_rows)
            self.tail_head_time += sum(costs.head_us) * 1e-6

    @property
    def accepted_per_lap(self) -> float:
        """Tokens committed per lap (accepted drafts + the target's own token)."""
        return (self.accepted + self.laps) / self.laps if self.laps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tree_nodes_per_lap(self) -> float:
        return self.tree_nodes / self.tree_laps if self.tree_laps else 0.0

    @property
    def tree_accepted_per_lap(self) -> float:
        """Drafts accepted per tree-mode lap (the target's own token not counted)."""
        return self.tree_accepted / self.tree_laps if self.tree_laps else 0.0


def merged_stats(stats: Sequence[GenerationStats], wall_time: float) -> GenerationStats:
    """A batch's stats: every row's counts added up; the wall time of the whole call; row 0's route."""
    merged = GenerationStats()
    for row in stats:
        for f in dataclasses.fields(GenerationStats):
            value, total = getattr(row, f.name), getattr(merged, f.name)
            if isinstance(value, Counter):
                total.update(value)
            elif isinstance(value, list) and f.name != "route":
                total.extend(value)
            elif isinstance(value, (int, float)) and f.name != "wall_time":
                setattr(merged, f.name, total + value)
    merged.route = list(stats[0].route) if stats else []
    merged.wall_time = wall_time
    return merged
