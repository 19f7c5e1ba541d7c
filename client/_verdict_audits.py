"""Audits of verdicts: every committed token re-verified by another tail (docs/reliability.md, "Verdict
audits").

The tail's verdict decides each token, and a tail can compute honestly and lie only in its verdict (a
wrong next token, a draft accepted that its own choice refutes): spot-checks of activations
(client/_spot_checks.py) cannot see that. So every audit runs a *shadow session* on the generation's
route with the tail's blocks computed by another server of the same precision, and advances it with the
tokens committed since the last audit, sent as drafts after the last audited one: an honest shadow tail
accepts exactly the tokens the exact rule chooses (greedy, or seeded sampling, whose draws are fixed by
(seed, position)). Every audit is verified by each witness of a pool of up to six independent tails, all
but the first at once (client/_shadow_turns.py: sybils on several machine groups must not be the only
witnesses of each other); each prefills the prompt once and verifies each generated token once, one position on each of
the shadow route's servers. Its Steps are shaped as the generation's live laps (client/_audit_shape.py):
live-sized drafts and, where the live laps loop, ``loop_runs``, the runs the tail starts itself consumed
as the live client consumes them (``_confirm``).

A shadow counts only if it could not be the same operator as the route's servers (client/_witnesses.py:
trusted, or on another machine group); trusted shadows are preferred. After an audit ends with no verdict
(a head or middle may drop the shadow's Steps), the generation's shadows go around the route's other hops
too (client/_shadow_detour.py).

A disagreement at position t is settled only by a server the user trusts (``trusted_peers``): the shadow
itself, the tail itself, or a third trusted server of the tail's blocks (a fresh session that verifies
the committed token at t), or by evidence the client checks itself (a greedy token: both tails' final
hidden state and the checkpoint's LM-head rows, client/_evidence.py). Then the server it refutes is
convicted (excluded for good, reported in the DHT: ``SwarmClient.convict``); refuted by evidence with
strangers before the tail, it is only avoided with its machine group for the generation. A vote among
strangers settles nothing (k sybils agree with each other), so without a trusted judge or evidence
nobody is convicted: both disputing servers join the generation's ``avoid`` set with every server of
their machine groups, and the generation re-verifies its tokens on a route without them
(``SpeculativeDecoder._react_to_liars``; client/_avoidance.py says which avoided server it falls back on
when none is left). Before the output is returned the last tokens are audited too; what the audits
confirmed (and by whom) is counted per token (client/_confirmation.py). One at a time, in the
background.

Rejection sampling (``verification="rejection"``): its committed tokens are not the seeded choice a
token-match shadow reproduces, so the shadow replays the live runs' own drafts, q and seed instead
(client/_rejection_audits.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Optional, Sequence

from client._audit_shape import LiveShape, committed_prefix
from client._avoidance import Avoidance
from client._evidence_disputes import EvidenceDisputes
from client._lm_head import LMHeadRows
from client._logprob_audits import first_disagreement, logprob_tolerance
from client._rejection_audits import RejectionRuns, confirm
from client._remote_session import RemoteSession
from client._shadow_turns import SHADOW_POOL, ShadowTurns
from client._spot_checks import AuditResult, BackgroundAudit, SpotChecker, alternatives, substituted
from client._witnesses import Witnesses
from client.errors import ServerError
from protocol.messages import GREEDY, DraftOffer, Hop, SamplingParams, Step, StepResult

logger = logging.getLogger(__name__)

DEFAULT_AUDIT_EVERY = 16  # committed tokens per audit (more: fewer audit laps, later catches)


class VerdictAuditor(ShadowTurns, EvidenceDisputes, BackgroundAudit):
    def __init__(
        self,
        swarm,
        vocab_size: int,
        every: int = DEFAULT_AUDIT_EVERY,
        timeout: Optional[float] = None,
        rng: Optional[random.Random] = None,
        witnesses: Optional[Witnesses] = None,
        avoidance: Optional[Avoidance] = None,
        lm_head: Optional[LMHeadRows] = None,
        pool: int = SHADOW_POOL,
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.swarm, self.vocab_size, self.every = swarm, vocab_size, every
        self.timeout = timeout if timeout is not None else 4 * swarm.request_timeout  # a dispute runs several sessions
        self.rng = rng or random.Random()
        self.task: Optional[asyncio.Task] = None
        self.audited: list[int] = []  # the ids whose verdicts a second tail confirmed (the prompt counts)
        self.trusted_confirmed: set[int] = set()  # positions of ``audited`` that a trusted shadow confirmed
        self.confirmers: dict[int, set[str]] = {}  # position of ``audited`` -> the witnesses that confirmed it
        self.witnesses = witnesses or Witnesses()
        self.avoidance = avoidance or Avoidance(self.witnesses)  # who disputed whom, by machine group
        self.avoid: set[str] = self.avoidance.peers  # the generation's avoided servers (the decoder shares its set)
        self.lm_head = lm_head  # the checkpoint's LM-head rows: disputes settled by evidence (client/_evidence.py)
        self.handled: set[str] = set()  # those of them the generation has already re-verified without
        self.enabled, self.verification = True, "match"
        self.rejection = RejectionRuns()  # the live runs' drafts and q, under rejection sampling
        self.max_length, self.sampling = 0, GREEDY
        self.live = LiveShape()  # what this generation's live laps look like (client/_audit_shape.py)
        self._shadow: Optional[RemoteSession] = None  # the shadow whose turn it is (client/_shadow_turns.py)
        self.parked: dict[str, tuple[RemoteSession, int, int, int]] = {}  # the others: session, held, run, verified
        self.had_turn: set[str] = set()  # witnesses that verified for this generation (the pool rotates through)
        self.pool = pool  # shadow sessions at once, each verifying every audit (``audit_witnesses``)
        self._held = 0  # positions the shadow's caches hold (of ``audited``)
        self._verified = 0  # positions the shadow has verified itself (a parked one catches up from there)
        self._next_run = 0
        self._replaced_at: Optional[int] = None  # the first position a re-verification replaced since the last audit
        self._given_up = 0  # history length an audit ended at without a verdict: not retried at the end
        self._last_audit = 0  # history length the last audit (``final``) went past the pool at
        self.detour = False  # shadows go around the live route's other hops (client/_shadow_detour.py)

    def begin(
        self,
        prompt: Sequence[int],
        max_length: int,
        sampling: SamplingParams,
        verification: str,
        live: Optional[LiveShape] = None,
    ) -> None:
        """A new generation: its prompt, and what its live laps look like (``max_length`` of its
        session, ``live``: drafts per lap and loop_runs), which every audit Step copies."""
        self.audited, self.max_length, self.sampling = list(prompt), max_length, sampling
        self._prompt_len = len(prompt)  # the live log-probs start after it
        self.live = live or LiveShape()
        self.trusted_confirmed, self.confirmers, self.had_turn = set(), {}, set()
        self._given_up, self._last_audit, self.detour, self._replaced_at = 0, 0, False, None
        self.enabled, self.verification = verification in ("match", "rejection"), verification
        self.rejection.forget()

    def maybe_start(self, route: Sequence[Hop], ids: Sequence[int], stats, final: bool = False) -> None:
        """Audit the tokens committed since the last audit: once ``every`` of them wait, or any
        number when the generation is about to return them (``final``)."""
        if not self.enabled or self.task is not None or not route:
            return
        # an audit that was not the last covered the end: the last still goes past the pool (client/_shadow_turns.py)
        covered = final and self.audited == list(ids) and self._past_the_pool(route, len(ids))
        if final and not covered and len(ids) <= self._given_up:
            return
        if any(hop.peer_id in self.swarm.liars or hop.peer_id in self.avoid - self.handled for hop in route):
            return  # the generation leaves this route and re-verifies before its next lap
        # (a disputed server the generation already reacted to may stay on the route where the swarm has no other)
        common = 0
        for a, b in zip(self.audited, ids):  # a re-verification may have replaced some tokens
            if a != b:
                break
            common += 1
        if common < len(self.audited):  # tokens a re-verification replaced: witnesses that hold them go (_shadow_turns)
            self._replaced_at = min(common, self._replaced_at if self._replaced_at is not None else common)
        self.audited = self.audited[:common]
        self.trusted_confirmed = {p for p in self.trusted_confirmed if p < common}
        self.confirmers = {p: w for p, w in self.confirmers.items() if p < common}
        if (len(ids) - common < (1 if final else self.every) or common == 0) and not covered:
            return
        self.task = asyncio.ensure_future(self._run(list(route), list(ids), stats, final))

    async def cancel(self) -> None:
        await super().cancel()
        await self._drop_shadows()

    async def _run(self, route: list[Hop], ids: list[int], stats, final: bool = False) -> None:
        given_up, self._given_up = self._given_up, len(ids)  # unless the audit confirms them
        self._last_audit = len(ids) if final else self._last_audit
        try:
            await self._forget_replaced()
            await self._audits(route, ids, stats, final)  # each witness of the pool (client/_shadow_turns.py)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a server died, refused or timed out: no verdict on anyone
            stats.verdict_audits_failed += 1
            stats.spot_check_events.append(f"verdict audit failed: {e!r}")
            logger.info(f"Verdict audit failed, no verdict: {e!r}")
            await self._drop_shadow()
            if await self._take_detour(stats, route):  # a stalling head or middle: the end is tried again around it
                self._given_up = given_up
        finally:
            self._ended()

    async def _audit(self, route: list[Hop], ids: list[int], stats, skip: frozenset = frozenset(), drawn=None) -> bool:
        """One witness drawn (none of ``skip``) verifies the tokens it has not; False: there was none. ``drawn()``
        is called once it is drawn, before it verifies (an audit's other witnesses start then)."""
        self._remembered_stall(route, stats)  # a hop of the route stalled an earlier generation's audit
        if not await self._ensure_shadow(route, len(ids), skip):
            if not skip:  # a further witness of the pool that is not there is no skipped audit
                stats.verdict_audits_skipped += 1
            return False
        if drawn is not None:
            drawn()
        stats.verdict_audits += 1
        limit = self.swarm.route_step_limit(self._shadow.route)
        # the first position this shadow has not verified itself (a fresh one: the first generated)
        start = min(max(self._verified, self._prompt_len), len(self.audited))
        position, self._next_run = await self._context(self._shadow, self._next_run, ids, self._held, start, stats)
        self._held = position
        await self._confirm(route, ids, start, limit, stats, position)
        return True

    async def _confirm(self, route: list[Hop], ids: list[int], position: int, limit: int, stats, first: int) -> None:
        """Confirm ids[position:] in Steps shaped as live laps: live-sized drafts, a Step of k drafts
        confirming k + 1 tokens, and ``loop_runs`` as the live laps ask. A run the tail starts itself
        is consumed as the live client consumes it: the committed tokens offered as its drafts
        (DraftOffer), its verdict's tokens (whatever drafts it carried) compared with the committed
        ones, and the run past the last committed token cancelled. The first Step carries
        ids[first:position] (the context the shadow lacks) before its drafts."""
        if self.verification == "rejection":  # the live runs' own Steps, replayed (client/_rejection_audits.py)
            return await confirm(self, route, ids, position, limit, stats, first)

        def advanced(reached: int) -> None:
            self._held = self._verified = reached
            self.audited = ids[: max(reached, len(self.audited))]  # a catch-up re-confirms others' tokens

        args = (route, self._shadow, self._next_run, ids, position, limit, stats, first, advanced)
        disagreement, self._next_run = await self._verify_on(*args)
        if disagreement is not None:
            t, token, logprobs = disagreement
            await self._dispute(route, ids, t, token, stats, logprobs)

    async def _verify_on(
        self, route, shadow: RemoteSession, run_id: int, ids, position: int, limit: int, stats, first: int, advanced
    ) -> tuple[Optional[tuple], int]:
        """``_confirm``'s laps on ``shadow`` from ``run_id``, which may be no current shadow (a witness past the
        pool verifies at once with the others, client/_shadow_turns.py): ``advanced(position)`` after each
        confirmed Step; returns the first disagreement (position, the shadow's token or None, the log-probs'
        detail), if any, and the session's next run id."""
        looped = False
        horizon = run_id  # the last run the tail may start itself: later audits send run ids after it
        drafts = self._drafts(ids, position, limit - (position - first) + 1)
        while position < len(ids):
            if not looped:  # the client sends the run (the first, or after a verdict that did not loop)
                loops = self.live.loop_runs_at(position)
                horizon = run_id + loops  # a fast tail may run ahead of a Cancel: never reuse its run ids
                context = ids[first:position]
                await self._send(
                    shadow, run_id, position - len(context), [*context, *drafts], len(drafts), loops, stats
                )
            if self.live.loop_end:  # the drafts for the run the tail may start after this one
                expect = committed_prefix(ids, position, drafts)  # what an honest tail accepts of them
                after = position + expect + 1
                offered = self._drafts(ids, after, limit)
                if after <= len(ids) and offered:
                    option = (expect, ids[after - 1], offered)
                    await shadow.offer(DraftOffer(session_id=shadow.session_id, run_id=run_id, options=[option]))
            result = await shadow.next_result(run_id)
            if result.run_id != run_id:
                raise ServerError(f"the shadow's verdict on run {result.run_id}, not {run_id}", shadow.tail_peer)
            carried = list(result.run_drafts) if looped and result.run_drafts is not None else drafts
            stats.verdict_audit_positions += (len(carried) + 1) * len(shadow.route) if looped else 0
            if not 0 <= result.accepted <= len(carried):
                raise ServerError(f"the shadow's verdict on run {run_id} accepts {result.accepted}", shadow.tail_peer)
            chosen = [*carried[: result.accepted], result.next_token][: len(ids) - position]
            disagreement = next(((position + i, t, ()) for i, t in enumerate(chosen) if t != ids[position + i]), None)
            if disagreement is None:  # the same tokens: their log-probs
                tol = logprob_tolerance([self.swarm.records.get(h.peer_id) for h in [*route, shadow.route[-1]]])
                lied = first_disagreement(
                    self.live.logprobs, position - self._prompt_len, result.logprobs, len(chosen), tol
                )
                disagreement = None if lied is None else (position + lied[0], None, lied[1:])
            if disagreement is not None:  # the shadow's tail chose another token, or said other log-probs
                await shadow.cancel(run_id + 1)
                return disagreement, max(run_id, horizon) + 1
            self.confirmed_by(shadow.tail_peer, range(position, position + len(chosen)))
            position += len(chosen)
            first = position - 1  # a later Step carries the last confirmed token before its drafts
            advanced(position)
            looped, run_id = bool(result.looped), run_id + 1
            # the run the tail started carries the offer's drafts if the head had it in time
            drafts = (
                offered if looped and self.live.loop_end and after <= len(ids) else self._drafts(ids, position, limit)
            )
        if looped:  # the tail started a run past the committed tokens: drop it, as a live lap drops a refuted one
            await shadow.cancel(run_id)
        return None, max(run_id - 1, horizon) + 1

    def confirmed_by(self, witness: str, positions: range) -> None:
        if self.witnesses.is_trusted(witness):
            self.trusted_confirmed.update(positions)
        for p in positions:
            self.confirmers.setdefault(p, set()).add(witness)

    def disputed_only(self) -> set[int]:
        """Positions every witness of which the generation avoids after an unsettled dispute
        (client/_avoidance.py): counted unconfirmed. Why: an honest T that disputed three sybils
        unsettled (a near tie) fell back behind the first, and the other two, avoided, confirmed
        its lies (measured: 24 wrong tokens unflagged in 1 of 20 generations, docs/reliability.md)."""
        avoided = self.avoidance.peers
        return {p for p, w in self.confirmers.items() if w and w <= avoided}

    def _drafts(self, ids: list[int], position: int, limit: int) -> list[int]:
        """The drafts of a run from ``position``: the live lap's there (client/_audit_shape.py)."""
        return self.live.drafts_at(ids, position, self.rng, limit - 1)

    async def _step(self, start: int, token_ids: list[int], n_draft: int, stats) -> StepResult:
        run_id = self._next_run
        stats.verdict_audit_positions += len(token_ids) * len(self._shadow.route)
        result, self._next_run = await self._live_step(self._shadow, run_id, start, token_ids, n_draft)
        return result

    async def _send(self, session, run_id: int, start: int, token_ids: list[int], n_draft: int, loops: int, stats):
        stats.verdict_audit_positions += len(token_ids) * len(session.route)
        await session.send_step(self._shaped(session, run_id, start, token_ids, n_draft, loops))

    def _shaped(self, session, run_id: int, start: int, token_ids: list[int], n_draft: int, loops: int = 0) -> Step:
        """A Step shaped as a live lap (client/_audit_shape.py)."""
        return Step(
            session_id=session.session_id,
            run_id=run_id,
            start_pos=start,
            token_ids=token_ids,
            n_draft=n_draft,
            sampling=None if self.sampling == GREEDY else self.sampling,
            top_logprobs=self.live.num_logprobs,  # as the live laps ask (their log-probs are compared)
            loop_runs=loops,
        )

    async def _context(
        self, session: RemoteSession, run_id: int, ids: list[int], held: int, start: int, stats
    ) -> tuple[int, int]:
        """Send a witness the context it lacks before ``start`` (its caches hold ``held`` positions; a fresh
        one's: the prompt) but the last Step's worth, which its first lap carries before its drafts as a live
        one does: where that lap's context begins, and the session's next run id."""
        first = min(held, start - 1)
        end = max(first, start - max(1, self.swarm.route_step_limit(session.route) - 1))
        return end, await self._prefill(session, ids, end, stats, first, run_id)

    async def _prefill(
        self, session: RemoteSession, ids: list[int], end: int, stats, position: int = 0, run_id: int = 0
    ) -> int:
        """Fill a session's caches with ids[position:end] (a fresh one's: from 0) in Steps of the route's limit,
        from run ``run_id``: its next run id."""
        limit = self.swarm.route_step_limit(session.route)
        while position < end:
            count = min(limit, end - position)
            _, run_id = await self._live_step(session, run_id, position, ids[position : position + count], 0)
            stats.verdict_audit_positions += count * len(session.route)
            position += count
        return run_id

    async def _live_step(
        self, session: RemoteSession, run_id: int, start: int, token_ids: list[int], n_draft: int, loops: int = 0
    ) -> tuple[StepResult, int]:
        """Send one Step shaped as a live lap (``loops``: its loop_runs; a run the tail then starts
        is dropped by the caller) and wait for its verdict; returns it and the session's next run id."""
        step = self._shaped(session, run_id, start, token_ids, n_draft, loops)
        await session.send_step(step)
        return await session.next_result(run_id), run_id + 1

    async def _dispute(
        self, route: list[Hop], ids: list[int], t: int, shadow_token: Optional[int], stats, logprobs: tuple = ()
    ) -> None:
        """The route's tail committed ids[t]; the shadow's tail chose ``shadow_token`` (None: the same
        token, but the two tails' log-probs at t disagree: ``logprobs``, what they said and the two
        entries). Settled by a trusted server (the shadow, the tail, or, for a token, a trusted third) or
        by evidence (client/_evidence_disputes.py): the one refuted is convicted. Otherwise nobody is:
        both are avoided for the rest of the generation, re-verified from t on a route without them."""
        tail, alt = route[-1].peer_id, self._shadow.tail_peer
        what = f"position {t}: the route's tail {tail} committed {ids[t]}, {alt} chose {shadow_token}"
        if shadow_token is None:
            what = f"position {t}: {logprobs[0]} (the route's tail {tail}, the shadow's {alt})"
        trusted = self.witnesses.is_trusted
        liar, judge, against = None, None, None  # against: the side a near tie's evidence leans against
        if trusted(alt) != trusted(tail):
            liar, judge = (tail, alt) if trusted(alt) else (alt, tail)
        elif not trusted(alt) and shadow_token is not None and self.verification == "match":
            # no trusted third for log-probs (not built), nor under rejection (a third verifies by token match)
            judges = [
                s
                for s in alternatives(route, len(route) - 1, self.swarm.records, self._excluded() | {alt}, t + 1)
                if trusted(s.peer_id)
            ]
            if judges:
                judge = self.rng.choice(judges).peer_id
                token = await self._third_opinion(substituted(route, len(route) - 1, judge), ids, t, stats)
                liar = tail if token == shadow_token else alt if token == ids[t] else None
                what += f"; trusted third {judge} chose {token}"
        if liar is None and judge is None and self._settleable(shadow_token):
            # on a detour both tails' evidence passes go through the shadow's hops (the route's may stall them)
            before = self._shadow.route[:-1]
            settled = await self._by_evidence([*before, route[-1]], ids, t, shadow_token, stats, logprobs[1:])
            if settled.unread and (around := await self._evidence_detour(route, t + 1, stats)) is not None:
                before, shadow = around, [*around, self._shadow.route[-1]]  # once more around the stalling hops
                args = ([*before, route[-1]], ids, t, shadow_token, stats, logprobs[1:])
                settled = await self._by_evidence(*args, shadow_route=shadow)
            what += f"; evidence: {settled.detail}"
            against = {"tail": tail, "shadow": alt}.get(settled.leans)
            if settled.refuted is not None:
                refuted = tail if settled.refuted == "tail" else alt
                # the route's hops fed the committed token, the shadow's (or a detour's) the evidence
                fed = [*route[:-1], *before]
                if not all(trusted(hop.peer_id) for hop in fed):  # strangers fed both tails' h
                    await self._refuted(route, ids, t, refuted, what, stats)
                    return
                liar, judge = refuted, "evidence"
        if liar is not None and not await self._upstream_clean(route, ids[:t], stats):
            what += "; a hop before the tail failed its spot-check or could not be checked"
            liar = None
        if liar is None:
            await self._unsettled(
                route, ids, t, what + ("" if judge else "; no trusted server to settle it"), stats, against
            )
            return
        if judge == "evidence":
            stats.verdict_audits_by_evidence += 1
            what += "; every hop before the tail trusted"
        by = "evidence" if judge == "evidence" else f"trusted {judge}"
        stats.spot_check_events.append(f"verdict audit: {what}; {liar} refuted by {by}")
        stats.liars_excluded.append(liar)
        self.swarm.convict(liar)
        self._given_up = 0
        if liar == alt:
            await self._drop_shadow()  # the next audit re-verifies the same tokens with another
        else:
            self.audited = ids[:t]  # the generation re-verifies from the prompt on a new route

    def _excluded(self) -> set[str]:
        return self.swarm.excluded.current() | self.avoid

    async def _upstream_clean(self, route: list[Hop], ids: list[int], stats) -> bool:
        """Whether the hops before the tail, which the shadow and the third share with the route,
        pass a spot-check of their activations on ``ids`` (client/_spot_checks.py): two tails'
        verdicts differ also when a shared hop lies at random (fresh noise in every session), and
        that must not convict an honest tail. A hop without a second server of its blocks and
        precision cannot be checked and counts as clean; a hop the spot-check convicts is convicted."""
        checker = SpotChecker(self.swarm, 1.0, self.vocab_size, rng=self.rng, witnesses=self.witnesses)
        checker.max_length, checker.sampling, checker.live = self.max_length, self.sampling, self.live
        for index in range(len(route) - 1):
            found = alternatives(route, index, self.swarm.records, self._excluded(), len(ids))
            if not found:
                continue
            alt = self.rng.choice(found).peer_id
            result = AuditResult("failed")
            try:
                await checker._compare(route, index, alt, [s.peer_id for s in found if s.peer_id != alt], ids, result)
            finally:
                stats.spot_check_positions += result.positions
            stats.spot_check_events.append(
                f"verdict audit: spot-check of hop {index} {route[index].peer_id} vs {alt}: "
                f"{result.verdict} ({result.detail})"
            )
            if result.verdict == "convicted":
                stats.liars_excluded.append(result.liar)
                self.swarm.convict(result.liar)
            self.avoidance.disputed(result.disputed, servers=self.swarm.records, against=result.against)
            if result.verdict not in ("agree", "skipped"):  # skipped: no independent substitute, as none at all
                return False
        return True
