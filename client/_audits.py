"""A generation's audits behind one interface: spot-checks of activations (client/_spot_checks.py)
and audits of verdicts (client/_verdict_audits.py), either optional, which the decoder calls after
each verdict and before it returns (docs/reliability.md)."""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from client._audit_shape import LiveShape
from client._avoidance import Avoidance
from client._evidence_disputes import TailEvidence
from client._lm_head import LMHeadRows
from client._shadow_turns import SHADOW_POOL
from client._spot_checks import SpotChecker
from client._verdict_audits import VerdictAuditor
from client._witnesses import Witnesses
from protocol.messages import SamplingParams


class Audits:
    """A generation's audits: spot-checks of activations and audits of verdicts, either optional,
    behind the one interface the decoder calls after each verdict and before it returns."""

    def __init__(self, spot: Optional[SpotChecker], verdicts: Optional[VerdictAuditor]):
        self.spot, self.verdicts = spot, verdicts
        self.avoidance: Avoidance = (verdicts or spot).avoidance  # make_audits gives both the same one

    @property
    def task(self) -> Optional[asyncio.Task]:
        return (self.spot and self.spot.task) or (self.verdicts and self.verdicts.task) or None

    def quiet_since(self, since: float) -> bool:
        """Whether neither audit has been in flight since ``since`` (perf_counter)."""
        return all(audit is None or audit.quiet_since(since) for audit in (self.spot, self.verdicts))

    def begin(
        self,
        prompt: Sequence[int],
        max_length: int,
        sampling: SamplingParams,
        verification: str,
        live: Optional[LiveShape] = None,
    ) -> None:
        if self.spot is not None:  # its sessions are as long as the generation's, its Steps shaped as its laps
            self.spot.max_length, self.spot.sampling = max_length, sampling
            self.spot.verification, self.spot.output_start = verification, len(prompt)
            self.spot.live = live or self.spot.live
            if isinstance(self.spot.evidence, TailEvidence):  # verdict audits off: its own evidence rule
                self.spot.evidence.begin(sampling, verification)
        if self.verdicts is not None:
            self.verdicts.begin(prompt, max_length, sampling, verification, live)

    def saw_lap(self, first: int, drafts: list[int]) -> None:
        """A live lap's verdict arrived; it carried ``drafts`` from position ``first`` (audit Steps replay them).
        The generation's one LiveShape (``begin``): spot-checks read it when verdict audits are off too."""
        (self.verdicts or self.spot).live.saw_lap(first, drafts)

    def saw_run(self, run, result) -> None:
        """A live run's verdict arrived (``result``, after the client's correction): under rejection
        sampling its audit replays the run's drafts and q."""
        if self.verdicts is not None:
            self.verdicts.rejection.record(run, result)

    def forget_runs(self) -> None:
        if self.verdicts is not None:
            self.verdicts.rejection.forget()

    def maybe_start(self, route, ids, stats, lap: int, final: bool = False) -> None:
        if self.spot is not None and not final:
            self.spot.maybe_start(route, ids, stats, lap)
        if self.verdicts is not None:
            self.verdicts.maybe_start(route, ids, stats, final=final)

    def share_avoid(self, avoid: set[str], handled: set[str]) -> None:
        """The generation's ``avoid`` set (both audits add the servers of unsettled disputes, and
        their machine groups, to it: client/_avoidance.py), and the servers the generation has
        already re-verified without (``handled``)."""
        self.avoidance.reset()
        self.avoidance.peers = avoid
        for audit in (self.spot, self.verdicts):
            if audit is not None:
                audit.avoid, audit.handled = avoid, handled

    async def settle(self) -> None:
        for audit in (self.spot, self.verdicts):
            if audit is not None:
                await audit.settle()

    async def cancel(self) -> None:
        for audit in (self.spot, self.verdicts):
            if audit is not None:
                await audit.cancel()


def make_audits(
    swarm,
    vocab_size: int,
    spot_check_rate: float,
    verdict_audit_every: int,
    trusted: frozenset[str] = frozenset(),
    lm_head: Optional[LMHeadRows] = None,
    pool: int = SHADOW_POOL,
) -> Optional[Audits]:
    """A generation's audits: spot-checks at this rate and verdict audits at this period (None when
    both are off, so the decoder skips them); ``trusted`` peers settle the disputes strangers cannot,
    and ``lm_head`` (the checkpoint's rows) lets the client settle tail disputes itself, with verdict
    audits or without (the spot-checks then get their own ``TailEvidence``). ``pool``: the verdict
    audits' witnesses (``generate(audit_witnesses=...)``)."""
    witnesses = Witnesses(trusted)
    avoidance = Avoidance(witnesses)  # one per generation's audits: both record disputes in it
    spot = (
        SpotChecker(swarm, spot_check_rate, vocab_size, witnesses=witnesses, avoidance=avoidance)
        if spot_check_rate
        else None
    )
    every = verdict_audit_every
    verdicts = (
        VerdictAuditor(swarm, vocab_size, every, witnesses=witnesses, avoidance=avoidance, lm_head=lm_head, pool=pool)
        if every
        else None
    )
    if spot is not None and verdicts is not None:
        spot.evidence = verdicts  # a spot-check of the tail hop settles by the verdict audits' evidence
    elif spot is not None and lm_head is not None:
        spot.evidence = TailEvidence(swarm, vocab_size, lm_head)  # the same rule, without verdict audits
    return Audits(spot, verdicts) if spot or verdicts else None
