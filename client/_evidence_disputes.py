"""The verdict auditor's disputes settled by evidence the client checks itself (client/_evidence.py for
plain greedy and temperature-only tokens, client/_processed_evidence.py for tokens under any other
processing and rejection-sampling decisions, client/_output_evidence.py for top-K log-probs):
kept apart from client/_verdict_audits.py so that the auditor's shadow and vote logic reads on its own.

A mixin of :class:`client._verdict_audits.VerdictAuditor`: it reads the auditor's swarm, shadow,
sampling, avoidance and witnesses. :class:`TailEvidence` is the same rule on its own, for the
spot-checks of a generation whose verdict audits are off (``verdict_audit_every=0``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import torch

from client._bisection import spread
from client._evidence import LEAN_SPREAD, Settlement, bounds, plain_greedy, plain_sampled, settle
from client._output_audits import fresh_pass, output_tolerance
from client._output_evidence import evidence_ready, settle_logprobs
from client._processed_evidence import (
    constraint_guide,
    draw_noise_for,
    logit_bounds,
    processed_bounds,
    settle_corrections,
    settle_decision,
    settle_token,
)
from client._rejection_audits import RejectionRuns
from client._tail_bisection import bisect_tails
from client.errors import ServerError
from protocol.messages import GREEDY, Hop, SamplingParams
from protocol.sampling import choose_token, correction_top_k
from protocol.seeded_draws import draw_noise

logger = logging.getLogger("client._verdict_audits")


class EvidenceDisputes:
    def _settleable(self, shadow_token: Optional[int]) -> bool:
        """Whether a dispute can be settled by the LM head and a checkpoint the client can read: a token
        under plain greedy token match (two rows, client/_evidence.py), or, where the logits are h . W,
        any other token or rejection decision (the whole head, client/_processed_evidence.py; a seeded
        draw only where this torch draws as ``draw_noise`` says) and log-probs (client/_output_evidence.py)."""
        if self.lm_head is None or self.lm_head.folder is None:
            return False
        if shadow_token is None:
            return evidence_ready(self.lm_head) is None
        if self.verification == "match" and plain_greedy(self.sampling):
            return True
        return self.verification in ("match", "rejection") and evidence_ready(self.lm_head) is None

    async def settle_tails(self, route: list[Hop], other: list[Hop], ids: list[int], t: int, claim: int, stats):
        """A spot-check of the tail hop (client/_spot_checks.py): ``route``'s tail says ids[t] follows
        ids[:t], ``other``'s (the same hops before it) says ``claim``. The verdict audits' evidence
        rule settles it; None where that rule cannot (rejection sampling, no readable checkpoint)."""
        if self.verification != "match" or not self._settleable(claim):
            return None
        return await self._by_evidence(route, ids, t, claim, stats, shadow_route=other)

    async def settle_tail_logprobs(self, route: list[Hop], other: list[Hop], prefix: list[int], t: int, claims, stats):
        """A spot-check of the tail hop: the two tails name the same tokens but ``claims`` (``route``'s
        entry, ``other``'s) for the token at ``t`` (after ``prefix``, ids[:t]) disagree. Log-probs are
        raw (before any processing), so the rule holds under every verification; None where the
        checkpoint's head cannot settle logits (client/_output_evidence.py ``evidence_ready``)."""
        if not self._settleable(None):
            return None
        return await self._by_evidence(route, prefix, t, None, stats, claims, shadow_route=other)

    async def _by_evidence(
        self,
        route: list[Hop],
        ids: list[int],
        t: int,
        shadow_token: Optional[int],
        stats,
        claims: tuple = (),
        shadow_route: Optional[list[Hop]] = None,
    ) -> Settlement:
        """Each tail's final hidden state at t - 1 (a fresh forward pass over ids[:t] on its own route:
        the same hops before it) and the LM-head rows of the two tokens, read from the checkpoint; for a
        log-prob dispute (``shadow_token`` None), the two entries in ``claims`` (the route's tail's, the
        shadow's) recomputed over the whole head. ``shadow_route``: the other tail's route (the shadow's)."""
        rows = self.lm_head.rows([ids[t], shadow_token]) if shadow_token is not None else None
        if shadow_token is not None and rows is None:
            return Settlement(None, "the checkpoint's LM-head rows could not be read")
        shadow_route = shadow_route or self._shadow.route
        both = asyncio.gather(
            self._final_hidden(route, ids[:t], stats), self._final_hidden(shadow_route, ids[:t], stats)
        )
        try:  # bounded: a liar that stalls its evidence must not turn the dispute into a failed audit
            h_tail, h_shadow = await asyncio.wait_for(both, self.swarm.request_timeout)
        except (ServerError, asyncio.TimeoutError, OSError) as e:  # settles nothing (a tail may be down)
            return Settlement(None, f"a tail's hidden state could not be read: {e!r}", unread=True)
        tol = output_tolerance([route[-1], shadow_route[-1]], self.swarm.records)
        noise, rounding = bounds([self.swarm.records.get(hop[-1].peer_id) for hop in (route, shadow_route)])
        if not spread(h_tail[None], h_shadow[None]) < tol:  # one h is made up: find the block (client/_bisection.py)
            return await self._bisected(route, shadow_route, ids[:t], (h_tail, h_shadow), tol, stats)
        if shadow_token is None:  # streams the whole head: off the event loop
            return await asyncio.to_thread(
                settle_logprobs, h_tail, h_shadow, *claims, self.lm_head, tol, noise, rounding
            )
        if self.verification != "match" or not (plain_greedy(self.sampling) or plain_sampled(self.sampling)):
            args = (h_tail, h_shadow, ids, t, shadow_token, noise, rounding)
            return await asyncio.to_thread(self._processed, *args)  # streams the whole head: off the event loop
        if not self.sampling.do_sample:
            return settle(h_tail, h_shadow, rows[0], rows[1], tol, noise, rounding)
        g = draw_noise(self.sampling.seed, t, self.vocab_size)  # the seeded draw's own noise at t
        offset = float(g[ids[t]] - g[shadow_token])
        return settle(h_tail, h_shadow, rows[0], rows[1], tol, noise, rounding, self.sampling.temperature, offset)

    def _processed(self, h_tail, h_shadow, ids: list[int], t: int, shadow_token: int, noise: float, rounding: float):
        """A token under any processing, or a rejection decision (client/_processed_evidence.py), from
        both tails' agreeing h: every logit's bounds through the session's processing at t."""
        products = self.lm_head.products(torch.stack([h_tail, h_shadow]))
        if products is None:
            return Settlement(None, "the checkpoint's LM head could not be read")
        guide = None
        if self.sampling.constraint is not None:
            guide = constraint_guide(self.lm_head, self.vocab_size, self.sampling)
            if guide is None:
                return Settlement(None, "the constraint's mask could not be rebuilt from the checkpoint's tokenizer")
        lo, hi = logit_bounds(h_tail, h_shadow, products, noise, rounding)
        found = processed_bounds(lo, hi, ids[:t], self.sampling, guide)
        numbers = "hidden states agree; every logit bounded through the session's processing"
        covering = self.rejection.covering(t) if self.verification == "rejection" else None
        if covering is None:  # a token match (or the bonus draw after accepted drafts)
            one_state = spread(h_tail[None], h_shadow[None]) <= LEAN_SPREAD
            # a near tie's lean: the session's own rule on the logits of the one state both tails sent
            at_state = choose_token(products[0][0].float(), ids[:t], t, self.sampling, guide) if one_state else None
            noise_t = draw_noise_for(self.sampling, t, self.vocab_size)
            return settle_token(found, noise_t, ids[t], shadow_token, numbers, at_state)
        run, i = covering
        shadow_accepted = self.rejection.shadow_accepted.get(t)
        if shadow_accepted is None:
            return Settlement(None, "the shadow's decision on the draft is unknown")
        if not shadow_accepted and run.accepted == i:  # both rejected it: their top-K of p decide the corrections
            k = min(correction_top_k(self.sampling), self.vocab_size)
            claims = (run.correction, self.rejection.shadow_corrections.get(t))
            return settle_corrections(found, *claims, k, numbers)
        args = (found, self.sampling, t, run.q[i], run.accepted > i, shadow_accepted, run.drafts[i])
        return settle_decision(*args)

    async def _bisected(self, route: list[Hop], shadow_route: list[Hop], prefix: list[int], finals, tol: float, stats):
        """The two tails' final hidden states differ: bisect the blocks both hold (client/_tail_bisection.py)."""

        def count(positions: int) -> None:
            stats.verdict_audit_positions += positions

        return await bisect_tails(
            self.swarm, self.lm_head, (route, shadow_route), prefix, finals, tol, count, fresh_pass
        )

    async def _final_hidden(self, route: list[Hop], prefix: list[int], stats):
        """The final hidden state (after the final norm: what the LM head reads) at prefix's last position."""
        shape = (1, self.vocab_size, self.lm_head.hidden_size, True)
        _, hidden = await fresh_pass(self.swarm, route, prefix, shape)
        stats.verdict_audit_positions += len(prefix) * len(route)
        return hidden[0]

    async def _refuted(self, route: list[Hop], ids: list[int], t: int, refuted: str, what: str, stats) -> None:
        """Evidence refuted ``refuted`` but strangers stood before the tail, so it is not convicted:
        it and its machine group are avoided for this generation (client/_avoidance.py); the other
        side is not. A refuted route tail: the tokens from t on are re-verified elsewhere."""
        await self.witnesses.refresh(self.swarm.p2p)
        upheld = self._shadow.tail_peer if refuted == route[-1].peer_id else route[-1].peer_id
        self.avoidance.refuted(refuted, servers=self.swarm.records, upheld=upheld)
        stats.verdict_audits_by_evidence += 1
        if refuted not in stats.disputed_peers:
            stats.disputed_peers.append(refuted)
        stats.spot_check_events.append(
            f"verdict audit settled by evidence: {what}; {refuted} refuted (not convicted: the hops before "
            "the tail are not all trusted); avoiding it and its group"
        )
        logger.warning(f"Verdict dispute settled by evidence ({what}): {refuted} refuted, avoided with its group")
        self._given_up = 0
        self.audited = ids[:t]  # a refuted route tail: the decoder re-verifies; a refuted shadow: the next one does
        await self._drop_shadow()

    async def _unsettled(self, route: list[Hop], ids: list[int], t: int, what: str, stats, against=None) -> None:
        """No conviction: avoid both disputing servers and their machine groups for this generation
        (client/_avoidance.py; ``against``: the side a near tie's evidence leans against, fallen back on
        last); its tokens from t on are re-verified elsewhere (the decoder reacts to a route server in
        ``avoid``)."""
        tail, alt = route[-1].peer_id, self._shadow.tail_peer
        what += f"; the near tie leans against {against} (fallen back on last)" if against else ""
        await self.witnesses.refresh(self.swarm.p2p)  # the group-mates' addresses, as the daemon sees them now
        self.avoidance.dispute(tail, alt, servers=self.swarm.records, against=against)
        stats.verdict_audits_undecided += 1
        stats.disputed_peers.extend(p for p in (tail, alt) if p not in stats.disputed_peers)
        stats.spot_check_events.append(f"verdict audit unsettled: {what}; avoiding both and their groups, re-verifying")
        logger.warning(f"Verdict dispute unsettled ({what}): avoiding both and their groups for this generation")
        self._given_up = 0
        self.audited = ids[:t]
        await self._drop_shadow()


class TailEvidence(EvidenceDisputes):
    """The evidence rule without a verdict auditor: what a spot-check of the tail hop needs
    (``settle_tails``, ``settle_tail_logprobs``) when verdict audits are off, so that a tail dispute is
    still settled by evidence rather than left undecided (which avoids the honest side too)."""

    def __init__(self, swarm, vocab_size: int, lm_head) -> None:
        self.swarm, self.vocab_size, self.lm_head = swarm, vocab_size, lm_head
        self.verification, self.sampling = "match", GREEDY
        self.rejection = RejectionRuns()  # empty: rejection decisions are not settled here (settle_tails says why)
        self._shadow = None  # every call names both routes

    def begin(self, sampling: SamplingParams, verification: str) -> None:
        self.sampling, self.verification = sampling, verification
