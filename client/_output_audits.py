"""Audits of forward passes: logits (``model(ids).logits``, the gateway's ``echo`` log-probs)
re-computed on an independent route (docs/reliability.md, "Forward passes and log-probs").

A forward pass returns numbers the client cannot check by itself: any hop may have computed them
wrongly, so ``output_audit_rate`` of the passes (``from_pretrained``; every pass under
``audit="required"``; the first pass through each server a model meets, so a liar from the start is
caught on its first pass) go a second time through a route whose every untrusted hop is replaced by a
server that could not be its operator (client/_witnesses.py), trusted servers first. The two
passes' logits agree within :data:`OUTPUT_TOLERANCES` (float32 1e-3, 16-bit 0.08 of
``max(1, max|logit|)``; benchmarks/forward_spread.py measures the honest spread under it), or there
is a dispute, settled by the verdicts' evidence rule:

- a route of trusted servers only (the audit route, or one built from trusted servers of the same
  blocks and precision) is the reference; a route that disagrees with it and differs from it in one
  hop convicts that hop's server; one that differs in several is narrowed by one pass per suspect
  hop (the reference with that hop alone substituted back), so only a server whose own computation
  moved the logits is convicted, never one framed by a hop it shared;
- without one, a disagreement narrowed to the tail hop alone is settled by evidence where the client
  reads the checkpoint's LM head (client/_output_evidence.py): both tails' logits and final hidden
  states behind the live route's hops before the tail, the live tail's from its own live reply (every pass
  asks for the states, so the evidence looks like any pass); where the two h differ, the tails' blocks
  are bisected to one the client replays (client/_tail_bisection.py); the refuted tail is convicted when every one
  of those hops is trusted, else avoided with its machine group (the other tail is not), and the
  other tail's pass is returned;
- otherwise nobody is convicted (a vote among strangers is one operator's vote, k times):
  the same narrowing (the audit route with one hop of the live route's at a time) finds the hops
  whose two servers disagree; those servers *and every untrusted server of their machine groups*
  are avoided (client/_avoidance.py: a group-mate of a disputant is no independent third, and a
  sybil on the liar's machine would otherwise recompute the pass and repeat the lie), the pass is
  recomputed on a third route with another server at those hops, or, where the avoided groups leave
  none, on the avoided server to fall back on first (the group of fewer disputes, then of fewer
  identities: the honest side against one-machine sybils), and its result is returned flagged as
  unconfirmed (a warning; ``audit="required"`` raises). The model's later passes route around the
  avoided servers in the same fallback order (``avoid``, as suspects are: never excluded, never
  reported), and audits do not use them; k sybils that frame an honest server get it avoided by
  this model, nothing more.

The audit sessions are ordinary prefill sessions as a forward pass sends them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import warnings
from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

import torch

from client._avoidance import Avoidance
from client._bisection import row_spread
from client._evidence import Settlement, bounds
from client._forward import prefill_outputs
from client._output_evidence import evidence_ready, settle_logits
from client._remote_session import RemoteSession
from client._shadow_detour import independent_hops
from client._spot_checks import alternatives, relative_difference, substituted
from client._tail_bisection import bisect_tails
from client._witnesses import Witnesses
from client.errors import ServerError, UnconfirmedOutputsError, UnconfirmedOutputsWarning
from protocol.messages import Hop
from protocol.records import ServerInfo

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_AUDIT_RATE = 0.1  # forward passes audited (every one under audit="required")

# relative_difference of two honest routes' logits over every position of a pass, under which they
# agree (benchmarks/forward_spread.py, SmolLM2-135M on the CPU, a 1-server route against a 3-server
# one prefilling in 16-position Steps beside two other sessions: float32 0 exactly, bfloat16 at most
# 0.035, median 0.01). Spot-checks compare one position; a pass compares hundreds, so 16-bit gets
# twice the largest measured spread. A lie under the bound moves no logit by more than 8% of the
# row's largest: it can reorder near-ties, not make a 1% token the likeliest.
OUTPUT_TOLERANCES = {"float32": 1e-3, "bfloat16": 0.08, "float16": 0.08}
OUTPUT_TOLERANCE_OTHER = 0.15  # quantized weights (int8, nf4) or a dtype the table does not know


def check_output_audit_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"output_audit_rate must be a number in [0, 1] (0: no audits), got {rate!r}")
    return float(rate)


def output_tolerance(hops: Sequence[Hop], records: Mapping[str, ServerInfo]) -> float:
    """The loosest :data:`OUTPUT_TOLERANCES` of the servers of ``hops`` (an unknown record: the loosest)."""
    found = [records.get(hop.peer_id) for hop in hops]
    return max(
        OUTPUT_TOLERANCES.get(r.dtype, OUTPUT_TOLERANCE_OTHER)
        if r is not None and (r.quantization or "none") == "none"
        else OUTPUT_TOLERANCE_OTHER
        for r in found
    )


@dataclass
class OutputAuditStats:
    """A model's forward-pass audits, counted over its life (``model.output_audit_stats``)."""

    passes: int = 0
    audited: int = 0
    first_use: int = 0  # of those, audited because a server of the route had never been audited
    confirmed_trusted: int = 0  # by a route of trusted servers
    confirmed_untrusted: int = 0  # by an independent route of strangers
    unconfirmed: int = 0  # audited, but no independent route, a failed audit or an unsettled dispute
    disputes: int = 0
    by_evidence: int = 0  # disputes settled by evidence (client/_output_evidence.py)
    convicted: list[str] = field(default_factory=list)
    disputed_peers: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


@dataclass
class Pass:
    """One pass's outputs: logits [num_outputs, vocab] float32 and final hidden states (or None)."""

    route: list[Hop]
    logits: torch.Tensor
    hidden: Optional[torch.Tensor]


class OutputAuditor:
    """Draws which forward passes to audit and settles what the audit finds."""

    def __init__(
        self, swarm, rate: float = DEFAULT_OUTPUT_AUDIT_RATE, trusted: Collection[str] = (), lm_head=None, rng=None
    ):
        self.swarm, self.rate = swarm, check_output_audit_rate(rate)
        self.lm_head = lm_head  # the checkpoint's LM head (client/_lm_head.py): disputes settled by evidence
        self.witnesses = Witnesses(trusted)
        self.rng = rng or random.Random()
        self.stats = OutputAuditStats()
        # unsettled disputes by machine group, over the model's life (never reset: a model's passes are
        # not one generation); ``avoid`` holds the disputants and their untrusted group-mates
        self.avoidance = Avoidance(self.witnesses)
        self.avoid: set[str] = self.avoidance.peers  # later passes route around them (never excluded)
        self.met: set[str] = set()  # servers some audited pass of this model went through

    def route_avoid(self) -> list[str]:
        """The avoided servers in fallback order, for ``open_session(avoid=)``: where the swarm leaves
        no route without them, the one to fall back on first is allowed first."""
        return self.avoidance.order(self.avoid)

    async def check(
        self, row: list[int], route: list[Hop], logits: torch.Tensor, hidden: Optional[torch.Tensor], shape, audit: str
    ) -> tuple[tuple[list[Hop], torch.Tensor, Optional[torch.Tensor]], str]:
        """The outputs to return for ``row`` (route, logits, hidden) and how they were confirmed:
        ``"trusted"``, ``"untrusted"``, ``"unaudited"`` (not drawn) or ``"unconfirmed"`` (flagged;
        raised under ``audit="required"``, which audits every pass). ``shape``: (num_outputs,
        vocab_size, hidden_size, return_hidden) of the pass."""
        live, untouched = Pass(route, logits, hidden), (route, logits, hidden)
        self.stats.passes += 1
        if all(self.witnesses.is_trusted(hop.peer_id) for hop in route):
            self.stats.confirmed_trusted += 1
            return untouched, "trusted"
        first_use = self.rate > 0 and any(not self._known(hop.peer_id) for hop in route)
        if audit != "required" and not first_use and (self.rate <= 0 or self.rng.random() >= self.rate):
            return untouched, "unaudited"
        self.stats.audited += 1
        self.stats.first_use += first_use
        self.met.update(hop.peer_id for hop in route)  # met once, whatever the audit finds: later passes draw
        try:
            result, how, why = await self._audit(row, shape, live)
        except Exception as e:  # a server died or refused: no verdict on anyone
            result, how, why = live, "unconfirmed", f"the audit failed: {e!r}"
        if how == "trusted":
            self.stats.confirmed_trusted += 1
        elif how == "untrusted":
            self.stats.confirmed_untrusted += 1
        else:
            self.stats.unconfirmed += 1
            self.stats.events.append(why)
            message = f"a forward pass's logits are unconfirmed: {why}"
            if audit == "required":
                raise UnconfirmedOutputsError(message + ' (audit="required" refuses to return them)', self.stats)
            warnings.warn(message, UnconfirmedOutputsWarning, stacklevel=2)
        return (result.route, result.logits, result.hidden), how

    def _known(self, peer_id: str) -> bool:
        """Whether a pass through ``peer_id`` may go unaudited (drawn at the rate): a trusted server, or one
        an audited pass of this model already went through. A server's first pass is always audited, so a
        liar that lies from the start is caught on its first pass, not after 1 / rate passes on average
        (measured: ``make bench-output-liars``); one that lies only later is caught at the rate."""
        return self.witnesses.is_trusted(peer_id) or peer_id in self.met

    async def _audit(self, row: list[int], shape: tuple, live: Pass) -> tuple[Pass, str, str]:
        route, trusted = live.route, self.witnesses.is_trusted
        strangers = [hop.peer_id for hop in route if not trusted(hop.peer_id)]
        other = await self._substitute(route, len(row), exclude=set(), independent_of=strangers)
        if other == route:
            return live, "unconfirmed", "no independent server of the route's blocks and precision"
        second = await self._pass(other, row, shape)
        tol = output_tolerance([*route, *other], self.swarm.records)
        difference = relative_difference(live.logits, second.logits)
        covered = all(trusted(a.peer_id) or a.peer_id != b.peer_id for a, b in zip(route, other))
        if difference < tol:
            if all(trusted(hop.peer_id) for hop in other):
                return live, "trusted", ""
            if covered:
                return live, "untrusted", ""
            return live, "unconfirmed", "a hop without an independent second server was not checked"
        self.stats.disputes += 1
        what = f"routes {_names(route)} and {_names(other)} differ by {difference:.3g} >= {tol:g}"
        self.stats.events.append(what)
        logger.warning(f"Forward-pass audit: {what}")
        reference = other if all(trusted(hop.peer_id) for hop in other) else self._trusted_route(route, other)
        if reference is not None:
            truth = second if reference == other else await self._pass(reference, row, shape)
            for losing in (live, second):
                if losing.route != reference and relative_difference(losing.logits, truth.logits) >= tol:
                    for i in await self._localize(losing, truth, row, shape, tol):
                        if not trusted(losing.route[i].peer_id):
                            self._convict(losing.route[i].peer_id)
            return truth, "trusted", ""
        suspects = await self._localize(live, second, row, shape, tol)
        if suspects == [len(route) - 1] and evidence_ready(self.lm_head) is None:  # the tails disagree
            settled = await self._by_evidence(live, other[-1].peer_id, row, shape)
            what += f"; evidence: {settled.detail}"
            if settled.refuted is not None:
                kept, refuted = (second, route[-1]) if settled.refuted == "tail" else (live, other[-1])
                settled_by = (refuted.peer_id, kept, route, what, covered)
                return await self._settled(*settled_by, row, shape)
        disputed = {hop.peer_id for i in suspects for hop in (route[i], other[i]) if not trusted(hop.peer_id)}
        self.stats.disputed_peers.extend(p for p in sorted(disputed) if p not in self.stats.disputed_peers)
        for i in suspects:  # both sides and their machine groups (client/_avoidance.py)
            self.avoidance.dispute(route[i].peer_id, other[i].peer_id, servers=self.swarm.records)
        self.avoid.difference_update({p for p in self.avoid if trusted(p)})
        what += f"; hops {suspects} disputed, no trusted server to settle it"
        third = await self._substitute(route, len(row), exclude=set(), independent_of=[], only=set(suspects))
        third = self._fall_back(third, route, other, suspects, len(row))
        if third == route:
            return live, "unconfirmed", f"{what}; no third server outside the disputed groups: the live pass stands"
        result = second if third == other else await self._pass(third, row, shape)
        return result, "unconfirmed", f"{what}; recomputed on {_names(third)}"

    def _fall_back(
        self, third: list[Hop], route: list[Hop], other: list[Hop], suspects: Sequence[int], length: int
    ) -> list[Hop]:
        """``third`` with each disputed hop that found no server outside the avoided groups given the
        avoided server to fall back on first (client/_avoidance.py ``order``): a disputant or a
        group-mate of one, the group of fewer disputes and fewer identities first."""
        out = list(third)
        for i in suspects:
            if out[i].peer_id not in self.avoid:
                continue
            pool = [route[i].peer_id, other[i].peer_id]
            others = alternatives(route, i, self.swarm.records, self.swarm.excluded.current(), length)
            pool += [s.peer_id for s in others]
            pool = [p for p in dict.fromkeys(pool) if p in self.avoid]
            if pool:
                out[i] = Hop(peer_id=self.avoidance.order(pool)[0], start=route[i].start, end=route[i].end)
        return out

    async def _localize(self, x: Pass, y: Pass, row: list[int], shape: tuple, tol: float) -> list[int]:
        """The hops whose servers disagree, of two routes whose logits do: each hop where they
        differ, substituted alone from ``x`` into ``y``, moves ``y``'s logits (one pass per hop; none
        where they differ in one hop). All of them where no single hop does (a liar that lies at
        random). Against a trusted ``y``, a hop found here is its ``x`` server's own computation."""
        differing = [i for i, (a, b) in enumerate(zip(x.route, y.route)) if a.peer_id != b.peer_id]
        if len(differing) == 1:
            return differing
        found = []
        for i in differing:
            mixed = [x.route[j] if j == i else hop for j, hop in enumerate(y.route)]
            if relative_difference((await self._pass(mixed, row, shape)).logits, y.logits) >= tol:
                found.append(i)
        return found or differing

    async def _by_evidence(self, live: Pass, alt: str, row: list[int], shape: tuple) -> Settlement:
        """Both tails' logits and final hidden states over ``row``, each behind the live route's hops
        before the tail, checked against the LM head's rows (client/_output_evidence.py): the live tail's
        own reply where it carried its states (every pass asks for them: client/_forward.py), so a tail
        that answers a repeated pass honestly is judged on what it sent live; the other tail's from a
        fresh pass. Each tail's logits and h come in one reply: an honest tail's fit its own h whatever
        its input, so the hops before it cannot frame it. Where the two h differ, the tails' blocks are
        bisected as a verdict dispute's are (client/_tail_bisection.py)."""
        route = live.route
        records, routes = self.swarm.records, [route, substituted(route, len(route) - 1, alt)]
        num_outputs, vocab_size, hidden_size, _ = shape
        shape = (num_outputs, vocab_size, hidden_size, True)

        async def own():
            if live.hidden is not None:
                return live.logits, live.hidden
            return await fresh_pass(self.swarm, route, row, shape)

        both = asyncio.gather(own(), fresh_pass(self.swarm, routes[1], row, shape))
        try:  # bounded: a liar that stalls its evidence settles nothing
            (logits_a, h_a), (logits_b, h_b) = await asyncio.wait_for(both, self.swarm.request_timeout)
        except (ServerError, asyncio.TimeoutError, OSError) as e:
            return Settlement(None, f"a tail's hidden states could not be read: {e!r}")
        tol = output_tolerance([route[-1], routes[1][-1]], records)
        noise, rounding = bounds([records.get(r[-1].peer_id) for r in routes])
        if not row_spread(h_a.reshape(len(logits_a), -1), h_b.reshape(len(logits_b), -1)) < tol:  # find the block
            return await bisect_tails(
                self.swarm, self.lm_head, (routes[0], routes[1]), row, (h_a, h_b), tol, _no_count, fresh_pass
            )
        return settle_logits(h_a, h_b, logits_a, logits_b, self.lm_head.rows, tol, noise, rounding)

    async def _settled(
        self, liar: str, kept: Pass, route: list[Hop], what: str, covered: bool, row: list[int], shape: tuple
    ) -> tuple[Pass, str, str]:
        """Evidence refuted ``liar``'s logits: convicted where every hop before the tail is trusted,
        else avoided with its machine group for this model's passes (the other tail is not). The other
        tail's pass is returned, confirmed only by a third tail independent of both that agrees with
        it: the other tail may be the liar's partner, honest in the evidence only (a sybil that gets
        itself refuted must not confirm its partner's lie)."""
        self.stats.by_evidence += 1
        if all(self.witnesses.is_trusted(hop.peer_id) for hop in route[:-1]):
            self._convict(liar, f"refuted by evidence, every hop before the tail trusted ({what})")
        else:
            await self.witnesses.refresh(self.swarm.p2p)
            self.avoidance.refuted(liar, servers=self.swarm.records)
            if liar not in self.stats.disputed_peers:
                self.stats.disputed_peers.append(liar)
            self.stats.events.append(f"{what}; {liar} refuted (not convicted: strangers before the tail), avoided")
            logger.warning(f"Forward-pass audit settled by evidence: {liar} refuted, avoided with its group")
        last, kept_tail = len(route) - 1, kept.route[-1].peer_id
        third = await self._substitute(kept.route, len(row), {liar}, [kept_tail, liar], only={last})
        if third[-1].peer_id in (liar, kept_tail):
            return kept, "unconfirmed", f"{what}; no third tail independent of both to confirm the pass returned"
        check = await self._pass(third, row, shape)
        if relative_difference(check.logits, kept.logits) >= output_tolerance(
            [*kept.route, *third], self.swarm.records
        ):
            return kept, "unconfirmed", f"{what}; the third tail {_names(third)} disagrees with the pass returned"
        how = "untrusted" if covered else "unconfirmed"
        return kept, how, "" if covered else f"{what}; a hop without an independent second server was not checked"

    def _convict(self, liar: str, why: str = "its blocks alone moved the logits of a trusted route") -> None:
        self.stats.convicted.append(liar)
        self.stats.events.append(f"{liar} convicted: {why}")
        logger.warning(f"Forward-pass audit: {liar} convicted by a route of trusted servers")
        self.swarm.convict(liar)

    async def _substitute(
        self,
        route: list[Hop],
        length: int,
        exclude: set[str],
        independent_of: Sequence[str],
        only: Optional[set[int]] = None,
    ) -> list[Hop]:
        """``route`` with every untrusted hop (of ``only``, if given) computed by another server of its
        blocks and precision (not excluded, independent of ``independent_of``; trusted first); a hop
        without one stays."""
        trusted = self.witnesses.is_trusted
        excluded = self.swarm.excluded.current() | exclude | self.avoid
        indices = [i for i, hop in enumerate(route) if not trusted(hop.peer_id) and (only is None or i in only)]
        args = (self.swarm, self.witnesses, self.rng, route, indices, excluded, length, independent_of, self.avoidance)
        return (await independent_hops(*args))[0]

    def _trusted_route(self, route: list[Hop], other: list[Hop]) -> Optional[list[Hop]]:
        """A route over the same hops with a trusted server at each (the route's or the audit
        route's where one is, else a trusted alternative); None where a hop has none."""
        records, trusted = self.swarm.records, self.witnesses.is_trusted
        out = []
        for i, (a, b) in enumerate(zip(route, other)):
            found = [h.peer_id for h in (a, b) if trusted(h.peer_id)]
            found += [
                s.peer_id
                for s in alternatives(route, i, records, self.swarm.excluded.current(), 0)
                if trusted(s.peer_id)
            ]
            if not found:
                return None
            out.append(Hop(peer_id=found[0], start=a.start, end=a.end))
        return out

    async def _pass(self, route: list[Hop], row: list[int], shape: tuple) -> Pass:
        return Pass(route, *await fresh_pass(self.swarm, route, row, shape))


def _no_count(positions: int) -> None:
    """The forward audits count no evidence positions (OutputAuditStats counts passes and disputes)."""


def _names(route: Sequence[Hop]) -> str:
    return "[" + ", ".join(f"{hop.peer_id[-6:]}[{hop.start}:{hop.end})" for hop in route) + "]"


async def fresh_pass(swarm, route: list[Hop], row: list[int], shape: tuple, hidden_at: int = -1):
    """(logits, hidden) of one fresh prefill session on ``route``, chunked as forward passes are;
    ``shape`` is (num_outputs, vocab_size, hidden_size, return_hidden). Also the evidence of a verdict
    dispute (client/_evidence_disputes.py; ``hidden_at``: its bisection's block boundary)."""
    num_outputs, vocab_size, hidden_size, return_hidden = shape
    session = RemoteSession(
        swarm.p2p, route, len(row), timeout=swarm.request_timeout, prompts=swarm.prompts, adapter=swarm.active_adapter
    )
    try:
        await session.open()
        limit = swarm.route_step_limit(route)
        return await prefill_outputs(
            session, row, num_outputs, limit, vocab_size, hidden_size, return_hidden, hidden_at
        )
    finally:
        await session.close()
