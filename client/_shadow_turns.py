"""Verdict audits by every witness of a pool of up to six (docs/reliability.md, "Witnesses of the pool";
issue 35).

Why: one shadow kept for the whole generation is one draw. Where k sybils on k machine groups sit among the
candidates beside one honest tail, the draw is a sybil with probability k / (k + 1), and the sybils then
confirm each other's lies for the whole generation: wrong tokens counted as confirmed by an independent
stranger, with no warning (measured: 237 wrong tokens unflagged in 20 generations with three sybils on a /24
each). So every audit is verified by each witness of a pool: up to ``SHADOW_POOL`` independent tails, the
others verifying at once while the first drawn for the audit does (``_others_at_once``), drawn at random from
the candidates (trusted first: a trusted witness's word settles, and no other is asked). With at most
``SHADOW_POOL`` candidates the honest tail is always among them, and one disagreement is enough: the dispute
goes to a trusted judge or to evidence (client/_evidence_disputes.py), never to a vote.

With more candidates than the pool holds, the pool rotates: while some candidate has not had a turn this
generation, each audit's first witness is one of those (drawn at random), and the witness parked longest
makes room for it. A fresh witness verifies every generated token so far, so after audit k, min(n, k + pool
- 1) candidates have each verified the generation up to their first turn: with n candidates, all have by audit
n - pool + 1 (the honest one too); later tokens are verified by those in the pool when they come. (A pool drawn once
held the honest tail with probability ``SHADOW_POOL`` / n.)

The audit before the output is returned goes past the pool: every candidate up to ``LAST_AUDIT_WITNESSES``
verifies every generated token (machine groups that never had a turn first; where more groups hold no session
than that, one witness past the pool for each, up to ``LAST_AUDIT_WITNESSES`` past it:
``_last_audit_witnesses``). As in every audit, once its first witness is drawn, all the others verify at once
while it does (``_others_at_once``): the pool's parked witnesses the window (``_caught_up``), and fresh ones
(those past the pool, or filling it) the prompt's prefill and every generated token (``_fresh_at_once``),
each in live-shaped laps on its own session (``_verified_at_once``); their turns then have nothing left but a
disagreement to take up. Where an audit that was not the last covered the generation's end, the last one runs
with no token left (``_past_the_pool``). Why: the last window's tokens have no later audit and no later
rotation, so with n > pool candidates it was verified by the pool alone, and sybils lying only there missed
the honest tail with probability 1 - pool / n (measured with four sybils on a /24 each: 2 and 3 of 10
generations returned wrong tokens unflagged); once the witnesses past the pool verified that window alone, a
window between the honest tail leaving the pool and the last audit still was; and in turn, each witness's
laps were wall time before ``generate()`` returns (and, over a WAN delay, in every audit: the turns fell
behind the live laps and left the last audit a backlog). A witness that fails in that audit does not end it: the
others still verify (one that failed at once with the others is not tried again; one that stalls in its turn
costs the request timeout).

Cost bound: at most ``SHADOW_POOL`` shadow sessions a generation, each kept with its caches, its run ids and
how far it verified (parked while another witness verifies), and each verifying each generated token once
(a fresh one from the first generated token): at most ``SHADOW_POOL`` positions per generated token on the
shadow routes, in the background but for the last audit before ``generate()`` returns; a rotation adds one
fresh witness to an audit (the prompt and every generated token so far), at most n - ``SHADOW_POOL`` times a
generation; the last audit adds, for each candidate past the pool, one session that prefills the prompt and
verifies every generated token (up to ``LAST_AUDIT_WITNESSES`` sessions at once, or the pool and six more).

A mixin of :class:`client._verdict_audits.VerdictAuditor` (``_shadow``, ``_held``, ``_next_run``: the turn's).
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from client._remote_session import RemoteSession
from client._shadow_detour import detour, same_blocks
from client._spot_checks import alternatives, substituted
from client._swarm import SECOND_PING
from client.errors import ServerError
from protocol.messages import Hop

SHADOW_POOL = 6  # the default pool (``audit_witnesses``): sessions at once, the one whose turn it is and the parked
LAST_AUDIT_WITNESSES = 6  # candidates that verify the audit before the output is returned (at least the pool)
MAX_SHADOW_TRIES = 3  # substitutes tried for the shadow's tail when one cannot be reached


class ShadowTurns:
    async def _audits(self, route: list[Hop], ids: list[int], stats, final: bool = False) -> None:
        """One audit: the witness drawn first, then every other witness of the pool (filled up to
        ``SHADOW_POOL`` from the candidates), each verifying the tokens it has not verified itself, unless a
        trusted witness confirmed them or a dispute sent the generation back: the others at once while the first
        verifies (``_others_at_once``), then each in turn with nothing left but a disagreement to take up (in its
        turn a witness is the auditor's one current shadow, which disputes). The ``final`` audit (before the output is
        returned) goes on past the pool, up to ``LAST_AUDIT_WITNESSES`` candidates (``_last_audit_witnesses``),
        those the pool does not hold verifying every generated token."""
        window = len(self.audited)  # where this audit's tokens start
        witnesses, prefill = self.pool, []  # the audit's other witnesses, at once

        def drawn() -> None:  # the first witness is drawn: the others verify at once while it does
            nonlocal witnesses
            witnesses = self._last_audit_witnesses(route, len(ids)) if final else self.pool
            if witnesses > 1 and not self.witnesses.is_trusted(self._shadow.tail_peer):
                fresh = max(0, witnesses - 1 - len(self.parked))  # to fill the pool, and past it in the last audit
                prefill.append(asyncio.ensure_future(self._others_at_once(route, ids, window, fresh, stats)))

        try:
            if await asyncio.wait_for(self._audit(route, ids, stats, drawn=drawn), self.timeout):
                await self._further_witnesses(route, ids, stats, final, witnesses, prefill[0] if prefill else None)
        finally:
            if prefill and not prefill[0].done():  # the first disputed or failed: the others' laps are moot
                prefill[0].cancel()
                await asyncio.gather(prefill[0], return_exceptions=True)

    async def _forget_replaced(self) -> None:
        """Close the witnesses whose caches hold, or who verified, tokens a re-verification has replaced since
        (from ``_replaced_at`` on). Why: a later turn would send the new tokens after a context that is no longer
        the generation's, and such a witness disagrees with an honest tail for that alone (a dispute evidence
        cannot settle: the inputs differ). A fresh session replaces it when it is drawn again."""
        at, self._replaced_at = self._replaced_at, None
        if at is None:
            return
        for peer_id, (session, held, _, verified) in list(self.parked.items()):
            if max(held, verified) > at:
                del self.parked[peer_id]
                await session.close()
        if self._shadow is not None and max(self._held, self._verified) > at:
            await self._drop_shadow()

    def _last_audit_witnesses(self, route: list[Hop], length: int, found: Optional[list] = None) -> int:
        """How many witnesses verify the last audit, its first (drawn) among them: the pool or
        ``LAST_AUDIT_WITNESSES``, whichever is more, or, where more candidate machine groups hold no session (never
        had a turn, or rotated out before the last tokens), the pool and one for each, up to
        ``LAST_AUDIT_WITNESSES`` past it. Why: a generation that ends within its second audit has had one
        rotation, so with eight groups the last audit left one out whatever the order (computed: the honest one
        in 1 of 8 such generations, 1 of 5 before ``Witnesses.unseen_first``); and with a pool of six, one rotated
        out before the lies began never verified them (measured: benchmarks/sybils.py scenario 5, 2 of 10)."""
        if found is None:
            found = alternatives(route, len(route) - 1, self.swarm.records, self.swarm.excluded.current(), length)
        fit = self._may_witness(found, route)
        held = {self.witnesses.group_of(peer_id) for peer_id in self._session_holders()}
        unheld = {self.witnesses.group_of(c.peer_id) for c in fit} - held
        return max(self.pool, LAST_AUDIT_WITNESSES, self.pool + min(len(unheld), LAST_AUDIT_WITNESSES))

    def _past_the_pool(self, route: list[Hop], length: int) -> bool:
        """Whether the audit before the output is returned must still run with no token left unaudited: an
        audit that was not the last (the pool's witnesses alone) covered the end, the last one has not gone
        past the pool at this length, and the swarm has candidates past the pool. Why: otherwise how the
        generation's end fell between audits decided whether its tokens saw more than the pool."""
        if self._last_audit >= length:
            return False
        found = alternatives(route, len(route) - 1, self.swarm.records, self.swarm.excluded.current(), length)
        return len(found) > self.pool and self._last_audit_witnesses(route, length, found) > self.pool

    async def _further_witnesses(self, route, ids, stats, final: bool, witnesses: int, prefill) -> None:
        """The audit's witnesses after the first, up to ``witnesses`` in all (``_audits``)."""
        used: set[str] = set()
        failed: Optional[str] = None  # the last witness, where it failed (and was dropped)
        while len(used) < witnesses - 1:
            if failed is None:  # a dispute (which may drop the shadow) sends the generation back: no more witnesses
                trusted = self._shadow is not None and self.witnesses.is_trusted(self._shadow.tail_peer)
                if self._shadow is None or trusted or len(self.audited) < len(ids):
                    return
                used.add(self._shadow.tail_peer)
            if prefill is not None:  # each one it verified with is parked where it got (its turn: a disagreement
                # only); one that failed there (it stalled, at once with the others) is not tried again
                used.update(await prefill)
                prefill = None
                if len(used) >= witnesses:  # before, the loop went on here, and the last witness had no turn
                    return
            try:
                witness = self._audit(route, ids, stats, frozenset(used))
                if not await asyncio.wait_for(witness, self.timeout):
                    return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # this witness failed; what the others confirmed stands
                failed = self._shadow.tail_peer if self._shadow is not None else None
                stats.spot_check_events.append(f"verdict audit by a further witness failed: {e!r}")
                await self._drop_shadow()
                await self._take_detour(stats, route)
                if not final or failed is None:
                    return
                used.add(failed)  # the last window still goes to the candidates left: one that stalls cannot end it
            else:
                failed = None

    async def _ensure_shadow(self, route: list[Hop], length: int, skip: frozenset = frozenset()) -> bool:
        """A shadow session on ``route`` with another server as its tail (none of ``skip``), drawn for this audit;
        a fresh one verifies from the first generated token."""
        # a side of an unsettled dispute may witness for a third group (client/_avoidance.py says why):
        # ``witness_order`` and ``_fits`` keep out refuted groups and the groups that disputed the tail's
        excluded = self.swarm.excluded.current()
        if self._shadow is not None and not self._fits(self._shadow, route, excluded):
            await self._drop_shadow()
        if self._shadow is not None:
            if self.witnesses.is_trusted(self._shadow.tail_peer):
                return True  # its word settles every dispute: it keeps its turn
            # its caches hold one position fewer than it confirmed: a later Step carries the last confirmed id
            parked = (self._shadow, max(0, self._held - 1), self._next_run, self._verified)
            self.parked[self._shadow.tail_peer] = parked
            self._shadow, self._held, self._verified = None, 0, 0
        for peer_id, (session, *_) in list(self.parked.items()):
            if not self._fits(session, route, excluded):
                del self.parked[peer_id]
                await session.close()
        found = self._turn_order(await self._candidates(route, length, excluded, skip), rotate=not skip)
        base = route  # the hops before the shadow's tail: the live route's, or a detour (client/_shadow_detour.py)
        if self.detour and any(candidate.peer_id not in self.parked for candidate in found[:MAX_SHADOW_TRIES]):
            base = await detour(self.swarm, self.witnesses, self.rng, route, length, excluded | self.avoid)
            found = [candidate for candidate in found if candidate.peer_id not in {hop.peer_id for hop in base}]
        for attempt, candidate in enumerate(found[:MAX_SHADOW_TRIES]):
            parked = self.parked.pop(candidate.peer_id, None)
            if parked is not None:
                self._shadow, self._held, self._next_run, self._verified = parked
                self.had_turn.add(candidate.peer_id)
                return True
            shadow_route = substituted(base, len(route) - 1, candidate.peer_id)
            shadow = self._new_session(shadow_route)
            try:
                await shadow.open()
            except ServerError as e:  # e.g. a stale record of a server that is gone: blame by evidence, try another
                await shadow.close()
                await self.swarm.blame(shadow_route, e)
                if attempt + 1 == min(len(found), MAX_SHADOW_TRIES):
                    raise
                continue
            self._shadow, self._held, self._next_run, self._verified = shadow, 0, 0, 0
            self.had_turn.add(candidate.peer_id)
            while len(self.parked) >= self.pool:  # a rotation: the witness parked longest makes room
                # parked in turn order, oldest first; one that already verified this audit first
                oldest = next((peer for peer in self.parked if peer in skip), next(iter(self.parked)))
                session, *_ = self.parked.pop(oldest)
                await session.close()
            return True
        return False

    async def _candidates(self, route: list[Hop], length: int, excluded: set[str], skip: frozenset) -> list:
        """The servers that may witness for ``route``'s tail (none of ``skip``), in the order the turns draw
        from: those that answer a ping, independent ones (trusted first), groups in no dispute first."""
        found = alternatives(route, len(route) - 1, self.swarm.records, excluded, length)
        found = [info for info in found if info.peer_id not in skip]
        fresh = [info for info in found if info.peer_id not in self.parked]
        if fresh:  # records outlive their servers by up to 3 update periods: drop those that do not answer
            pings = [Hop(peer_id=info.peer_id, start=0, end=0) for info in fresh]
            dead = set(await self.swarm.unresponsive(pings, again=SECOND_PING))
            for peer_id in dead:
                self.swarm.exclude(peer_id)  # the client's own failed ping: evidence
            found = [info for info in found if info.peer_id not in dead]
            await self.witnesses.refresh(self.swarm.p2p)  # the pings opened connections: their addresses
        self.rng.shuffle(found)
        return self.witnesses.unseen_first(self._may_witness(found, route), self._seen_groups(), self.avoidance.peers)

    def _may_witness(self, found: Sequence, route: list[Hop]) -> list:
        """``found`` that may witness for ``route``'s tail, in order (``Witnesses.choose``, ``witness_order``)."""
        found = self.witnesses.choose(found, [hop.peer_id for hop in route])
        return self.avoidance.witness_order(found, [route[-1].peer_id])

    def _session_holders(self) -> frozenset[str]:
        """The witnesses holding a session: the parked ones and the one whose turn it is."""
        return frozenset({*self.parked, *([self._shadow.tail_peer] if self._shadow is not None else [])})

    def _seen_groups(self) -> set[str]:
        """The machine groups of the witnesses that have had a turn this generation or hold a session."""
        return {self.witnesses.group_of(peer_id) for peer_id in {*self.had_turn, *self._session_holders()}}

    def _new_session(self, shadow_route: list[Hop], max_length: Optional[int] = None) -> RemoteSession:
        """A session as long as the generation's (unless ``max_length``), which the audits open on ``shadow_route``."""
        swarm = self.swarm
        return RemoteSession(
            swarm.p2p,
            shadow_route,
            max_length or self.max_length,
            timeout=swarm.request_timeout,
            prompts=swarm.prompts,
            adapter=swarm.active_adapter,
        )

    async def _others_at_once(self, route: list[Hop], ids: list[int], window: int, count: int, stats) -> list[str]:
        """An audit's witnesses but the first, at once, while it verifies: each parked one verifies what it has not
        (``_caught_up``), up to ``count`` fresh ones (filling the pool, or past it in the last audit) every
        generated token (``_fresh_at_once``); each is parked where it got, its turn left with a disagreement to take
        up at most. Why: in turn, each one's laps were wall time, and over a WAN delay the turns fell behind the
        live laps and left the last audit a backlog (measured: docs/reliability.md, "Witnesses of the pool").
        Returns the witnesses that failed. Never raises."""
        parked = list(self.parked.items()) if self.verification == "match" else []  # rejection: in turn
        caught_up = asyncio.gather(*(self._caught_up(route, peer, entry, ids, stats) for peer, entry in parked))
        failed, opened = await asyncio.gather(caught_up, self._fresh_at_once(route, ids, window, count, stats))
        return [peer_id for peer_id in [*failed, *opened] if peer_id is not None]

    async def _caught_up(self, route: list[Hop], peer_id: str, parked: tuple, ids: list[int], stats) -> Optional[str]:
        """A parked witness verifies every token it has not (``_verified_at_once``), within an audit's timeout, and
        is parked again where it got; the witness, closed, where that failed."""
        try:
            verified = self._verified_at_once(route, parked, ids, stats)
            self.parked[peer_id] = await asyncio.wait_for(verified, self.timeout)
            return None
        except asyncio.CancelledError:  # its caches and run ids are no longer what the entry says
            self.parked.pop(peer_id, None)
            await parked[0].close()
            raise
        except Exception as e:
            self.parked.pop(peer_id, None)
            await parked[0].close()
            stats.spot_check_events.append(f"a witness of the pool failed at once with the others: {e!r}")
            return peer_id

    async def _fresh_at_once(self, route: list[Hop], ids: list[int], window: int, count: int, stats) -> list[str]:
        """Open up to ``count`` witnesses the pool does not hold (filling it, or past it in the last audit), each
        verifying every generated token at once with the others (``_prefilled``). Returns the witnesses whose
        prefill failed. Never raises: a witness not prefilled here for another reason is opened in its turn,
        as before."""
        try:
            excluded = self.swarm.excluded.current()
            found = await self._candidates(route, len(ids), excluded, self._session_holders())
            found = found[:count]  # groups in no dispute first; an avoided one (no side against this tail) too
            base = route
            if found and self.detour:
                base = await detour(self.swarm, self.witnesses, self.rng, route, len(ids), excluded | self.avoid)
                found = [info for info in found if info.peer_id not in {hop.peer_id for hop in base}]
            routes = [substituted(base, len(route) - 1, info.peer_id) for info in found]
            failed = await asyncio.gather(*(self._prefilled(route, r, ids, window, stats) for r in routes))
            return [peer_id for peer_id in failed if peer_id is not None]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            stats.spot_check_events.append(f"an audit's fresh witnesses were not opened at once: {e!r}")
            return []

    async def _prefilled(self, route: list[Hop], shadow_route: list[Hop], ids: list[int], window: int, stats):
        """One fresh witness (filling the pool, or past it in the last audit), verifying every generated token at
        once with the others (``_verified_at_once``; under rejection sampling its caches are only filled up to the
        audit's ``window``, which it verifies in its turn), within an audit's timeout, then parked as having verified up
        to where it got (its first Step then carries the last id before that, as a parked one's does); the
        witness where that failed."""
        session = self._new_session(shadow_route)
        try:
            await session.open()
            if self.verification == "match":
                fresh = (session, 0, 0, 0)
                parked = await asyncio.wait_for(self._verified_at_once(route, fresh, ids, stats), self.timeout)
            else:
                parked = (session, window - 1, await self._prefill(session, ids, window - 1, stats), window)
        except asyncio.CancelledError:
            await session.close()
            raise
        except Exception as e:
            await session.close()
            stats.spot_check_events.append(f"a fresh witness failed at once with the others: {e!r}")
            return session.tail_peer
        self.parked[session.tail_peer] = parked
        return None

    async def _verified_at_once(self, route: list[Hop], parked: tuple, ids: list[int], stats) -> tuple:
        """A witness verifies every generated token of ``ids`` it has not (``parked``: its session, the positions
        its caches hold, its next run id, how far it verified; a fresh one: (session, 0, 0, 0)) in Steps shaped
        as live laps, as its turn would (``VerdictAuditor._audit``), but on its own session and run ids, so that
        an audit's witnesses verify at once. Why: witnesses past the pool verified the last window alone,
        so a window between the honest tail leaving a rotating pool and the last audit was verified by the pool
        alone (sybils lying there missed the honest tail with probability 1 - pool / candidates); and in turn,
        each witness's laps were wall time. A disagreement is not disputed here: the witness stops at the run
        before it, and its turn verifies from there, disputing through ``_audit``. Returns the parked entry."""
        session, held, run_id, verified = parked
        limit = self.swarm.route_step_limit(session.route)
        start = min(max(verified, self._prompt_len), len(ids))  # the first position it has not verified itself
        first, run_id = await self._context(session, run_id, ids, held, start, stats)
        reached = [start]
        _, run_id = await self._verify_on(route, session, run_id, ids, start, limit, stats, first, reached.append)
        held = reached[-1] - 1 if len(reached) > 1 else first  # a Step confirmed: it fed every id before the last
        return session, held, run_id, reached[-1]

    async def _third_opinion(self, route: list[Hop], ids: list[int], t: int, stats) -> int:
        """The token a fresh session on ``route`` chooses at position t after ids[:t]."""
        # the generation's max_length, not t + 1: a session that ends at the disputed position is an audit's tell
        session = self._new_session(route, self.max_length or t + 1)
        try:
            await session.open()
            run_id = await self._prefill(session, ids, t - 1, stats)
            # loop_runs as a live lap there asks (closing the session drops the run the tail starts)
            loops = self.live.loop_runs_at(t)
            result, _ = await self._live_step(session, run_id, t - 1, [ids[t - 1], ids[t]], 1, loops)
            stats.verdict_audit_positions += 2 * len(route)
            return ids[t] if result.accepted == 1 else result.next_token
        finally:
            await session.close()

    def _turn_order(self, found: Sequence, rotate: bool = False) -> list:
        """The candidates in the order to try: a trusted one first as it came; otherwise one drawn at random (its
        machine group first: ``Witnesses.draw``) among the first rank (groups in no dispute) that are parked or,
        while the pool has room, fresh; with ``rotate`` (an audit's first witness) and a full pool, among those
        that have not had a turn yet."""
        found = list(found)
        if not found or self.witnesses.is_trusted(found[0].peer_id):
            return found
        room = len(self.parked) < self.pool  # with the drawn one, at most ``pool`` sessions
        first_rank = [c for c in found if c.peer_id not in self.avoidance.peers]
        seen = self._seen_groups()  # by machine group: a second identity of a group that had a turn is not new
        unseen = [c for c in first_rank if self.witnesses.group_of(c.peer_id) not in seen]
        if rotate and not room and unseen:
            pick = self.witnesses.draw(self.rng, unseen)
            return [pick, *(c for c in found if c is not pick)]
        eligible = [c for c in first_rank if c.peer_id in self.parked or room]
        if not eligible:
            return found
        pick = self.witnesses.draw(self.rng, eligible)
        return [pick, *(c for c in found if c is not pick)]

    def _fits(self, shadow: RemoteSession, route: list[Hop], excluded: set[str]) -> bool:
        """Whether ``shadow`` may still shadow ``route``: the same hops before the tail (or, on a detour, the
        same blocks), another tail, nobody excluded, and a tail whose group never disagreed with the route's
        tail's."""
        return (
            (shadow.route[:-1] == route[:-1] or (self.detour and same_blocks(shadow.route[:-1], route[:-1])))
            and shadow.tail_peer != route[-1].peer_id
            and not any(hop.peer_id in excluded for hop in shadow.route)
            and self.avoidance.may_witness(shadow.tail_peer, [route[-1].peer_id])
        )

    def _detour_on(self, stats, why: str, stalled: Sequence[Hop] = ()) -> bool:
        """Remember the hops before the tail of ``stalled`` (a route whose audit or evidence stalled) for later
        generations (``stalled_audits``), and turn the generation's detour on (client/_shadow_detour.py):
        whether it was off."""
        for hop in stalled[:-1]:
            self.swarm.stalled_audits.add(hop.peer_id)
        if self.detour:
            return False
        self.detour = True
        stats.verdict_audit_detours += 1
        stats.spot_check_events.append(why)
        return True

    async def _take_detour(self, stats, route: Sequence[Hop] = ()) -> bool:
        """An audit ended with no verdict: the generation's later shadows go around the live route's other
        hops; the shadows kept so far, which went through them, are closed. Whether this turned the detour on."""
        if not self._detour_on(stats, "verdict audits detour around the route's head and middles from now on", route):
            return False
        await self._drop_shadows()
        return True

    async def _evidence_detour(self, route: list[Hop], length: int, stats) -> Optional[list[Hop]]:
        """A dispute's evidence could not be read through the shadow's hops before the tails: other servers for
        them, None where the swarm has none or they are already a detour. The generation's later shadows
        detour too (the current one is kept: the dispute is about its verdict)."""
        if self.detour:
            return None
        excluded = self.swarm.excluded.current() | self.avoid
        around = await detour(self.swarm, self.witnesses, self.rng, route, length, excluded)
        if around[:-1] == route[:-1]:
            return None
        self._detour_on(
            stats, "a dispute's evidence stalled: it and later audits detour around the route's hops", route
        )
        return around[:-1]

    def _remembered_stall(self, route: Sequence[Hop], stats) -> None:
        """A hop of ``route`` before the tail stalled an audit of an earlier generation: detour from the start."""
        stalled = self.swarm.stalled_audits.current()
        if any(hop.peer_id in stalled for hop in route[:-1]):
            self._detour_on(stats, "verdict audits detour around a hop that stalled an earlier audit")

    async def _drop_shadow(self) -> None:
        shadow, self._shadow, self._held, self._verified = self._shadow, None, 0, 0
        if shadow is not None:
            await shadow.close()

    async def _drop_shadows(self) -> None:
        """The shadow whose turn it is and every parked one (the generation is over)."""
        await self._drop_shadow()
        parked, self.parked = self.parked, {}
        for session, *_ in parked.values():
            await session.close()
