"""Spot-checks of activations: audit by replay with substitution (docs/reliability.md, "Spot-checks").

The client never sees intermediate activations, and a hop's output depends on its cache of every
earlier position, so a hop is checked by replaying the committed ids on two fresh sessions: one on
the generation's route (R_orig), one on the same route with that hop's blocks [a, b) computed by
another server of the same dtype and quantization (R_alt). Both verify the ids as a live lap would
(client/_audit_shape.py): the context as prefill, the last few committed tokens as drafts (as many
as a live lap of the generation carried), with the generation's sampling, ``max_length`` and top
log-probs; they differ only in the substituted hop, so verdicts that differ (accepted count, next
token) or whose log-probs disagree beyond a dtype-aware bound (client/_logprob_audits.py) mean
that one of the two servers lies. No Step asks for returned logits (no live lap does).
A server the user trusts (``trusted_peers``; client/_witnesses.py) then decides: one of the two, or
a trusted third of the same blocks and precision (R_C, :func:`minority`); the server it refutes is
excluded for the rest of the client's life and reported in the DHT. A stranger's vote settles
nothing (one operator can run both the substitute and the third), so without a trusted judge the
two servers are only avoided for the rest of the generation (``avoid``), which re-verifies its
tokens on a route without them; except on the tail hop, where two verdicts that name different
tokens or other log-probs go to the verdict audits' evidence rule first (client/_tail_disputes.py):
the side it refutes is convicted behind trusted hops, else avoided with its machine group, and the other side is not
(before, such a dispute stayed unsettled and barred the honest side from witnessing for others:
issue 35, docs/reliability.md "Sybil tails: figures"). The audit
sessions are ordinary sessions (OpenSession, Steps shaped as live laps): nothing in a Step tells a
hop that it is being audited (timing aside). But a hop can tell them from the live session (they repeat its
prompt while it is open), and one that lies in the live session alone is honest in both: so the verdict
they agree on is also compared with the live lap it replays (client/_live_agreement.py), and a route
that answered the two differently has its untrusted servers avoided.

One audit at a time per generation, as an asyncio task beside the laps (it never delays a lap),
bounded by a timeout; an audit that fails (a server dies, times out) is no verdict on anyone.
The generation reacts to a conviction in ``client/_generation.py`` (re-verification).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

import msgspec
import torch

from client._audit_shape import LiveShape
from client._avoidance import Avoidance
from client._live_agreement import live_contradiction, suspects
from client._logprob_audits import logprob_tolerance, verdict_difference
from client._remote_session import RemoteSession
from client._tail_disputes import settle_by_evidence
from client._witnesses import Witnesses
from protocol.messages import GREEDY, Hop, Step, StepResult
from protocol.records import ServerInfo, ServerState

logger = logging.getLogger(__name__)

DEFAULT_SPOT_CHECK_RATE = 1 / 50  # audits per verdict

# max|x - y| / max(1, max|x|) of two servers' logits under which they agree: what spot-checks compared
# before they went through verdicts (they now compare log-probs: client/_logprob_audits.py), kept for
# callers that compare one row of logits; over many positions honest bfloat16 exceeds 3e-2
# (client/_output_audits.py OUTPUT_TOLERANCES has the measured bounds for whole passes). Both servers of a
# comparison have the same dtype and quantization, so an honest difference comes only from the order
# of floating-point operations (other kernels, batch shapes, hardware): ~1e-6 relative in float32,
# a few bf16 ulps (2^-8 = 0.4%) through a deep stack in 16-bit; quantized kernels (LLM.int8's outlier
# split, nf4 dequantization) differ more between implementations, so they get a loose bound.
TOLERANCES = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 3e-2}
QUANTIZED_TOLERANCE = 0.1  # int8 or nf4 weights (any dtype)
UNKNOWN_TOLERANCE = 0.1  # a dtype this table does not know


def relative_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    """``max|x - y| / max(1, max|x|)``; infinite when the shapes differ or a value is not finite."""
    if x.shape != y.shape or x.numel() == 0:
        return math.inf
    x, y = x.float(), y.float()
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        return math.inf
    return float((x - y).abs().max()) / max(1.0, float(x.abs().max()))


def tolerance(dtype: str, quantization: Optional[str]) -> float:
    """The largest honest :func:`relative_difference` between two servers of this precision."""
    if quantization not in (None, "", "none"):
        return QUANTIZED_TOLERANCE
    return TOLERANCES.get(dtype, UNKNOWN_TOLERANCE)


def route_tolerance(route: Sequence[Hop], records: Mapping[str, ServerInfo]) -> float:
    """The loosest tolerance of the route's servers: a hop's honest rounding difference propagates
    through every later hop, and 16-bit hops after it can amplify it."""
    found = [records.get(hop.peer_id) for hop in route]
    return max(tolerance(r.dtype, r.quantization) if r is not None else UNKNOWN_TOLERANCE for r in found)


def agree(x: torch.Tensor, y: torch.Tensor, tol: float) -> bool:
    return relative_difference(x, y) < tol


def same_precision(a: ServerInfo, b: ServerInfo) -> bool:
    return a.dtype == b.dtype and (a.quantization or "none") == (b.quantization or "none")


def alternatives(
    route: Sequence[Hop], index: int, records: Mapping[str, ServerInfo], exclude: Collection[str], length: int
) -> list[ServerInfo]:
    """Servers that can compute hop ``index``'s blocks instead of it: online, a span covering the
    hop's [start, end) (a sub-range of their span is fine), the same dtype and quantization as the
    hop's own record (never compare servers of different precision), room for ``length`` tokens,
    not on the route, not excluded. Empty when the hop's own record is unknown."""
    hop = route[index]
    own = records.get(hop.peer_id)
    if own is None:
        return []
    on_route = {h.peer_id for h in route}
    return sorted(
        (
            s
            for s in records.values()
            if s.peer_id not in on_route
            and s.peer_id not in exclude
            and s.state == ServerState.ONLINE
            and s.start_block <= hop.start
            and hop.end <= s.end_block
            and same_precision(s, own)
            and s.free_cache_tokens >= length
        ),
        key=lambda s: s.peer_id,
    )


def pick_hop(
    route: Sequence[Hop], first: int, records: Mapping[str, ServerInfo], exclude: Collection[str], length: int
) -> Optional[tuple[int, list[ServerInfo]]]:
    """Round robin: the first hop at or after ``first`` (mod the route's length) that has an
    alternative, with its alternatives; None when no hop has one."""
    for k in range(len(route)):
        index = (first + k) % len(route)
        found = alternatives(route, index, records, exclude, length)
        if found:
            return index, found
    return None


def minority(orig_alt: bool, orig_third: bool, alt_third: bool) -> Optional[str]:
    """Which of the two disputing servers the third one outvotes, from whether each pair agrees:
    ``"orig"`` (the route's own server), ``"alt"`` (its substitute) or None (undecided: the three
    disagree, or the third agrees with both). No dispute (``orig_alt``) convicts nobody."""
    if orig_alt:
        return None
    if alt_third and not orig_third:
        return "orig"
    if orig_third and not alt_third:
        return "alt"
    return None


def substituted(route: Sequence[Hop], index: int, peer_id: str) -> list[Hop]:
    """The route with hop ``index``'s blocks computed by ``peer_id`` instead. Without the replaced server's
    relay addresses: ``RemoteSession.open`` sends every hop with the addresses known for its own peer id."""
    return [
        msgspec.structs.replace(hop, peer_id=peer_id, addrs=[]) if i == index else hop for i, hop in enumerate(route)
    ]


@dataclass
class AuditResult:
    verdict: str  # "agree", "convicted", "undecided", "skipped" (no independent substitute), "failed" or "cancelled"
    liar: Optional[str] = None
    positions: int = 0  # server positions the audit's sessions computed (summed over servers)
    detail: str = ""
    disputed: tuple[str, ...] = ()  # the two servers of a disagreement nobody trusted settled
    substitute: str = ""  # the substitute compared (an independent one may replace the one drawn)
    by_evidence: bool = False  # ``liar`` (convicted, or "refuted": avoided with its group) by the client's evidence
    against: Optional[str] = None  # of ``disputed``, the one a near tie's evidence leans against (client/_evidence.py)


class BackgroundAudit:
    """One audit at a time in the background (``task``), which the decoder waits for before it
    returns tokens (``settle``) or stops (``cancel``); spot-checks and verdict audits share this."""

    task: Optional[asyncio.Task] = None
    busy_until: float = float("-inf")  # perf_counter() when the last audit ended

    def quiet_since(self, since: float) -> bool:
        """Whether no audit has been in flight since ``since`` (perf_counter)."""
        return self.task is None and self.busy_until <= since

    def _ended(self) -> None:
        """The audit in flight has ended (every audit's ``finally``)."""
        self.task, self.busy_until = None, time.perf_counter()

    async def settle(self) -> None:
        """Wait for the audit in flight, if any (it is bounded by its own timeout)."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    async def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self._ended()


class SpotChecker(BackgroundAudit):
    """One generation's spot-checks: draws whether to audit after each verdict, picks the hop and its
    substitutes, and runs at most one audit at a time in the background."""

    def __init__(
        self,
        swarm,
        rate: float,
        vocab_size: int,
        timeout: Optional[float] = None,
        rng: Optional[random.Random] = None,
        witnesses: Optional[Witnesses] = None,
        avoidance: Optional[Avoidance] = None,
    ):
        check_rate(rate)
        self.swarm, self.rate, self.vocab_size = swarm, rate, vocab_size
        self.timeout = timeout if timeout is not None else swarm.request_timeout
        self.rng = rng or random.Random()
        self.next_hop = 0  # round robin over the route's hops
        self.task: Optional[asyncio.Task] = None
        self.results: list[AuditResult] = []
        self.witnesses = witnesses or Witnesses()
        self.avoidance = avoidance or Avoidance(self.witnesses)  # who disputed whom, by machine group
        self.avoid: set[str] = self.avoidance.peers  # the generation's avoided servers (the decoder shares its set)
        self.handled: set[str] = set()  # those of them the generation has already re-verified without
        self.max_length = 0  # the generation's session max_length (its audit sessions copy it); 0: len(ids)
        self.live, self.sampling = LiveShape(), GREEDY  # the generation's laps and sampling (Steps copy them)
        self.evidence = None  # the verdict auditor (``settle_tails``): tail disputes settled by evidence
        self.verification, self.output_start = "match", 0  # the generation's rule; its prompt's length

    def maybe_start(self, route: Sequence[Hop], ids: Sequence[int], stats, lap: int) -> None:
        """After a verdict: with probability ``rate``, audit the next hop that has a substitute."""
        if self.rate <= 0 or self.task is not None or not route or not ids:
            return
        if any(hop.peer_id in self.swarm.liars or hop.peer_id in self.avoid - self.handled for hop in route):
            return  # the generation leaves this route before its next lap (an audit just convicted a hop)
        # (a disputed server the generation already reacted to may stay on the route where the swarm has no other)
        if self.rate < 1 and self.rng.random() >= self.rate:
            return
        records = self.swarm.records
        choice = pick_hop(route, self.next_hop, records, self.swarm.excluded.current() | self.avoid, len(ids))
        if choice is None:
            stats.spot_checks_skipped += 1
            return
        index, candidates = choice
        self.next_hop = index + 1
        alt = self.rng.choice([c for c in candidates if self.witnesses.is_trusted(c.peer_id)] or candidates)
        thirds = [c.peer_id for c in candidates if c.peer_id != alt.peer_id]
        stats.spot_checks += 1
        live = list(self.live.committed_logprobs)  # the live verdicts' log-probs, as of this lap
        audit = self._audit(list(route), index, alt.peer_id, thirds, list(ids), stats, lap, live)
        self.task = asyncio.ensure_future(audit)

    async def _audit(self, route, index, alt, thirds, ids, stats, lap, live) -> None:
        result = AuditResult("failed")
        try:
            compared = self._compare(route, index, alt, thirds, ids, result, stats, live)
            result = await asyncio.wait_for(compared, self.timeout)
        except asyncio.TimeoutError:  # an undecided dispute stays one (its evidence timed out)
            result.detail = f"{result.detail}; timed out after {self.timeout:g} s".lstrip("; ")
        except asyncio.CancelledError:
            result.verdict, result.detail = "cancelled", "the generation ended first"
            raise
        except Exception as e:  # a server died or refused: no verdict on anyone (an undecided dispute stays one)
            result.detail = f"{result.detail}; {e}".lstrip("; ")
        finally:
            self._ended()
            self.results.append(result)
            stats.spot_check_positions += result.positions
            hop = route[index]
            alt = result.substitute or alt
            what = f"lap {lap}: hop {index} [{hop.start}:{hop.end}) {hop.peer_id} vs {alt}: {result.verdict}"
            stats.spot_check_events.append(f"{what} ({result.detail})" if result.detail else what)
            if result.verdict == "skipped":
                stats.spot_checks_skipped += 1
            elif result.verdict == "failed":
                stats.spot_checks_failed += 1
                logger.info(f"Spot-check failed, no verdict: {what}: {result.detail}")
            elif result.verdict == "undecided":
                stats.spot_checks_undecided += 1
                # the two and their machine groups (client/_avoidance.py)
                self.avoidance.disputed(result.disputed, servers=self.swarm.records, against=result.against)
                stats.disputed_peers.extend(p for p in result.disputed if p not in stats.disputed_peers)
                logger.warning(
                    f"Spot-check undecided: servers {hop.peer_id} and {alt} disagree on blocks "
                    f"{hop.start}:{hop.end} ({result.detail}); nobody excluded"
                )
            elif result.verdict == "diverged":  # the route's untrusted servers, each with its group counted
                stats.spot_checks_diverged += 1
                self.avoidance.suspected(result.disputed)
                stats.disputed_peers.extend(p for p in result.disputed if p not in stats.disputed_peers)
                logger.warning(f"Spot-check diverged from the live lap: {what}: {result.detail}; route avoided")
            elif result.verdict == "refuted":  # by evidence, behind untrusted hops: avoided, not convicted
                upheld = alt if result.liar == hop.peer_id else hop.peer_id
                self.avoidance.refuted(result.liar, servers=self.swarm.records, upheld=upheld)
                stats.disputed_peers.extend(p for p in (result.liar,) if p not in stats.disputed_peers)
                logger.warning(f"Spot-check settled by evidence: {what}: {result.detail}; avoided with its group")
            elif result.verdict == "convicted":
                stats.liars_excluded.append(result.liar)
                self.swarm.convict(result.liar)
            stats.spot_checks_by_evidence += result.by_evidence

    async def _independent(self, checked: str, alt: str, thirds: list[str]) -> tuple[Optional[str], list[str]]:
        """The substitute and thirds that could not be the checked server's operator (client/_witnesses.py):
        the client pings them all first, so that its daemon holds a connection, then reads the
        addresses. The substitute drawn is kept if it qualifies, else a qualifying one (trusted first)."""
        pool = [alt, *thirds]
        await self.swarm.unresponsive([Hop(peer_id=p, start=0, end=0) for p in (checked, *pool)])
        await self.witnesses.refresh(self.swarm.p2p)
        fit = [p for p in pool if self.witnesses.independent(p, [checked])]
        if not fit:
            return None, []
        if alt not in fit:
            alt = ([p for p in fit if self.witnesses.is_trusted(p)] or fit)[0]
        return alt, [p for p in fit if p != alt]

    async def _compare(self, route, index, alt, thirds, ids, result: AuditResult, stats=None, live=None) -> AuditResult:
        """R_orig against R_alt on the committed ``ids``; with ``live`` (the live verdicts' log-probs, one per
        generated id), the verdict they agree on against the live lap too (client/_live_agreement.py)."""
        alt, thirds = await self._independent(route[index].peer_id, alt, thirds)
        result.substitute = alt or ""
        if alt is None:
            result.verdict, result.detail = "skipped", "no substitute on another machine group than the hop"
            return result
        records = self.swarm.records
        tol = logprob_tolerance([records.get(p) for p in (*(hop.peer_id for hop in route), alt)])
        orig_route, alt_route = route, substituted(route, index, alt)
        committed = ids
        ids, drafts = self._replayed(committed, self.swarm.route_step_limit(route) - 1)
        orig, other = await _both(
            self._verdict(orig_route, ids, drafts, result), self._verdict(alt_route, ids, drafts, result)
        )
        difference = verdict_difference(orig, other, tol)
        if difference <= tol:
            result.verdict, result.detail = "agree", f"log-prob difference {difference:.2g} <= {tol:g}"
            found = None
            if live is not None and self.verification == "match":  # rejection sampling commits other tokens
                found = live_contradiction(committed, ids, drafts, orig, live, self.output_start, tol)
            if found is not None:  # a server of the route answered the live lap otherwise: which, nobody can say
                result.verdict, result.disputed = "diverged", suspects(route, self.witnesses.is_trusted)
                result.detail = f"both replays agree, not with the live lap at {found}"
            return result
        accused = (route[index].peer_id, alt)
        detail = f"verdicts differ ({_said(orig)} vs {_said(other)}; bound {tol:g})"
        trusted = self.witnesses.is_trusted
        thirds = [t for t in thirds if trusted(t)]  # a stranger's vote settles nothing
        if trusted(accused[0]) != trusted(accused[1]):
            loser = "alt" if trusted(accused[0]) else "orig"
            detail += f"; {accused[0] if loser == 'alt' else accused[1]} is trusted"
        elif not thirds or trusted(accused[0]):
            result.detail = f"{detail}; no trusted server of the same blocks and precision to settle it"
            # undecided unless the evidence settles it (also when it times out or a server fails meanwhile)
            result.verdict, result.disputed = "undecided", accused
            if index == len(route) - 1 and stats is not None:
                await settle_by_evidence(self, orig_route, alt_route, ids, drafts, (orig, other), tol, result, stats)
            return result
        else:
            third = self.rng.choice(thirds)
            decider = await self._verdict(substituted(route, index, third), ids, drafts, result)
            with_orig, with_alt = verdict_difference(orig, decider, tol), verdict_difference(other, decider, tol)
            loser = minority(False, with_orig <= tol, with_alt <= tol)
            detail += f"; trusted third {third}: {with_orig:.3g} from the route's, {with_alt:.3g} from the substitute's"
        if loser is None:
            result.disputed = accused
            result.verdict, result.detail = "undecided", detail
        else:
            result.verdict, result.liar = "convicted", accused[0] if loser == "orig" else accused[1]
            result.detail = f"{detail}; {result.liar} is in the minority"
        return result

    def _replayed(self, ids: list[int], room: int) -> tuple[list[int], int]:
        """What the spot-check's sessions verify, and how many of its last ids are drafts: the committed ids
        before the generation's last live lap, then that lap's own drafts, rejected ones too (at most
        ``room``), so both tails accept as many as the live tail did; with no lap recorded, a live lap's
        count of committed tokens. Why: committed tokens alone were accepted in full by every honest tail,
        unlike a live lap's guesses (client/_audit_shape.py ``drafts_at``)."""
        last = max((p for p in self.live.laps if 0 < p < len(ids)), default=None)
        if last is None:
            return ids, self.live.draft_count(self.rng, min(room, len(ids) - 1))
        lap = self.live.laps[last][: max(0, room)]
        return [*ids[:last], *lap], len(lap)

    async def _verdict(self, route: list[Hop], ids: list[int], drafts: int, result: AuditResult) -> StepResult:
        """One fresh session on ``route`` verifying ``ids`` as a live lap would: the context in
        prefill Steps of the route's step limit, then the last Step with the last ``drafts`` ids as
        drafts; its verdict, with the generation's top log-probs."""
        swarm = self.swarm
        length = max(self.max_length, len(ids))  # as long as the generation's own session: not len(ids), a tell
        session = RemoteSession(
            swarm.p2p, route, length, timeout=swarm.request_timeout, prompts=swarm.prompts, adapter=swarm.active_adapter
        )
        try:
            await session.open()
            result.positions += len(ids) * len(route)
            limit, run_id = swarm.route_step_limit(route), 0
            last = max(0, len(ids) - limit)  # the last Step: ids[last:], its last ``drafts`` ids as drafts
            for start in [*range(0, last, limit), last]:
                end = min(start + limit, last) if start < last else len(ids)
                step = Step(
                    session_id=session.session_id,
                    run_id=run_id,
                    start_pos=start,
                    token_ids=list(ids[start:end]),
                    n_draft=drafts if end == len(ids) else 0,
                    sampling=None if self.sampling == GREEDY else self.sampling,
                    top_logprobs=self.live.num_logprobs,
                    # as a live lap from there asks; closing the session drops the run the tail starts
                    loop_runs=self.live.loop_runs_at(len(ids) - drafts) if end == len(ids) else 0,
                )
                await session.send_step(step)
                verdict = await session.next_result(run_id)
                run_id += 1
            return verdict
        finally:
            await session.close()


def _said(verdict: StepResult) -> str:
    """A verdict in short, for the audit's detail."""
    first = verdict.logprobs[0].logprob if verdict.logprobs else float("nan")
    return f"{verdict.accepted} accepted, next {verdict.next_token}, first log-prob {first:.4g}"


async def _both(first, second) -> list:
    """Run two coroutines at once; if one fails, cancel the other (it closes its session) and raise."""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"spot_check_rate must be a number in [0, 1] (0 disables spot-checks), got {rate!r}")
    return float(rate)
