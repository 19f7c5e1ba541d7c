"""The client's side of one generation: draft, send runs, read verdicts, commit.

One lap, top to bottom (``SpeculativeDecoder._lap``); what each step does in a given decoding
mode (chain, async window, looped runs, token trees, the rejection exchange) is that mode's
decision (client/modes/, one module each behind :class:`client.modes.base.Mode`), and the decoder
acts on it: a mode reads the decoder through a read-only view and never changes it.
  1) fill the window: the mode decides the next run and the fields of its Step, the decoder sends
     it; the oldest run in flight always starts from committed tokens (the canonical run), so every
     lap commits at least one token whatever the drafter does;
  2) while the front run is in flight, the mode works ahead (hedged drafts for its likeliest
     refuting verdicts; in looped runs an offer of them, which the decoder sends the head);
  3) read the verdict of the front run: ``accepted`` drafts plus the target's own next token,
     checked (and, in the rejection exchange, corrected) by the mode; the decoder times the lap;
  4) commit them; if the verdict refutes what later runs assumed, cancel those runs with one
     ID-only message; then track the run the tail started at the head, if the mode finds one.
A failure anywhere (a server dies, hangs or refuses with a retryable error) reroutes the session
and replays the committed tokens as one prefill lap, so no token is lost or repeated.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Optional, Sequence

from client import _confirmation
from client._audit_shape import LIVE_TOP_LOGPROBS, LiveShape
from client._audits import Audits
from client._reverify import Reverification
from client._runs import Run, SessionState
from client._stats import GenerationStats
from client._swarm import SwarmClient
from client._throughput import lap_is_timed
from client._trees import TreeSizer
from client.drafting import Drafter
from client.errors import GenerationError, ServerError
from client.modes import LoopedMode, NextRun, VerdictAction, choose_mode
from protocol.messages import GREEDY, SamplingParams, Step, StepResult, TokenLogprobs
from protocol.sampling import with_output_start
from protocol.tail_costs import TailCosts

logger = logging.getLogger(__name__)

__all__ = ["GenerationStats", "SessionState", "SpeculativeDecoder"]


class SpeculativeDecoder(Reverification):
    """One generation's lap loop. The only writer of its own state: the mode (client/modes/) reads
    it through ``client.modes.DecoderView`` and returns decisions that the loop acts on. The options
    come checked (client._options.GenerationOptions.checked, with ``loop_runs`` decided)."""

    def __init__(
        self,
        swarm: SwarmClient,
        state: SessionState,
        sampling: SamplingParams,
        *,
        drafter: Optional[Drafter] = None,
        num_draft_tokens: int = 8,
        max_inflight_runs: int = 1,
        eos_token_ids: Sequence[int] = (),
        num_logprobs: int = 0,
        on_tokens: Optional[Callable[[list[int]], None]] = None,
        max_failovers: int = 5,
        front_drafts: Optional[int] = 0,
        verification: str = "match",
        audits: Optional[Audits] = None,
        draft_tree: bool = False,
        tree_sizer: Optional[TreeSizer] = None,
        loop_runs: bool = False,
        trusted_peers: frozenset[str] = frozenset(),
        audit: str = "warn",
    ):
        """``trusted_peers``: servers the user trusts (tokens a trusted tail commits count as
        confirmed); ``audit``: "warn" flags unconfirmed tokens, "required" raises instead
        (client/_confirmation.py)."""
        if max_inflight_runs < 1:
            raise ValueError(f"max_inflight_runs must be >= 1, got {max_inflight_runs}")
        self.swarm, self.state, self.sampling = swarm, state, sampling
        self.drafter, self.num_draft_tokens = drafter, num_draft_tokens
        self.max_inflight_runs = max_inflight_runs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_logprobs = num_logprobs
        self.on_tokens = on_tokens
        self.max_failovers = max_failovers
        self.stats = GenerationStats()
        self.live_logprobs: list[TokenLogprobs] = []  # every verdict's, asked or not: the audits compare them
        self.inflight: deque[Run] = deque()  # oldest (the front run) first
        self.verdict_at: Optional[float] = None  # when the last verdict arrived (perf_counter)
        self.tokens_left = 0  # tokens this generation may still commit, as of this lap
        self.audits = audits  # spot-checks and verdict audits of this generation's routes
        self.trusted_peers, self.audit_policy = trusted_peers, _confirmation.check_audit_policy(audit)
        self.avoid: set[str] = set()  # servers disputed without settlement: routed around for this generation
        self.trusted_tail: set[int] = set()  # positions a trusted tail committed
        self.verification = verification
        self.mode = choose_mode(
            self,
            inflight=max_inflight_runs,
            verification=verification,
            draft_tree=draft_tree,
            loop_runs=loop_runs,
            front_drafts=front_drafts if max_inflight_runs > 1 else None,
            tree_sizer=tree_sizer if tree_sizer is not None else TreeSizer(),
        )
        self._failed_at: Optional[float] = None
        self._prompt_len = 0
        self._replay: list[int] = []  # tokens generated before a liar was caught, still to re-verify
        self._route_peers: set[str] = set()  # every server of this generation's routes
        self._handled_liars: set[str] = set()
        if audits is not None:
            audits.share_avoid(self.avoid, self._handled_liars)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """The caller's log-probs (``num_logprobs``): every verdict's, or none when it asked for none."""
        return self.live_logprobs if self.num_logprobs else []

    async def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Generate after ``prompt`` (the whole context); returns the new tokens only."""
        began = time.perf_counter()
        self._begin(prompt, max_new_tokens)
        try:
            while True:
                await self._react_to_liars()
                produced = len(self.state.history) - self._prompt_len
                ended = produced >= max_new_tokens or (produced > 0 and self.state.history[-1] in self.eos_token_ids)
                if ended and not self._replay:
                    if await self._audit_the_end():
                        continue
                    break
                await self._lap_and_stream(max_new_tokens - produced)
        finally:
            await self._cancel_inflight()
            if self.audits is not None:
                await self.audits.cancel()
        generated = self._finish(began)
        _confirmation.report(self.stats, self.audit_policy)
        return generated

    def _begin(self, prompt: Sequence[int], max_new_tokens: int = 0) -> None:
        """Start on ``prompt``: what the caches keep of it, the drafter's context, the audits."""
        self.state.start_from(list(prompt))
        self.sampling = with_output_start(self.sampling, len(prompt))  # a constraint, penalties: after the prompt
        if self.drafter is not None:
            self.drafter.reset(self.state.history)
        self._prompt_len = len(prompt)
        if self.audits is not None:
            asked = max(self.num_logprobs, LIVE_TOP_LOGPROBS)
            live = LiveShape(
                self.num_draft_tokens, num_logprobs=asked, logprobs=self.logprobs, committed_logprobs=self.live_logprobs
            )
            if isinstance(self.mode, LoopedMode):  # the shadow's Steps loop as the live laps do
                live.loop_end = len(prompt) + max_new_tokens
            self.audits.begin(prompt, self.state.max_length, self.sampling, self.verification, live)
        if self.state.remote is not None:  # an inference session's route from an earlier call
            self._route_peers.update(hop.peer_id for hop in self.state.remote.route)

    async def _lap_and_stream(self, tokens_left: int) -> None:
        """One lap; its tokens that are news go to the caller, and an audit may start after it."""
        new = await self._lap_with_failover(tokens_left)
        fresh = self._reconcile(new)
        if self.on_tokens is not None and fresh:
            self.on_tokens(fresh)
        if self.audits is not None and self.state.remote is not None:
            self.audits.maybe_start(self.state.remote.route, self.state.history, self.stats, self.stats.laps)

    async def _audit_the_end(self) -> bool:
        """Audit the last tokens before the output, since an audit's verdict may retract tokens:
        whether one was in flight and is now settled (the loop then goes on)."""
        if self.audits is not None and self.state.remote is not None:
            route = self.state.remote.route
            self.audits.maybe_start(route, self.state.history, self.stats, self.stats.laps, final=True)
        if self.audits is None or self.audits.task is None:
            return False
        await self.audits.settle()
        return True

    def _finish(self, began: float) -> list[int]:
        """The generated tokens, with the drafter told the stream ended and the stats filled in."""
        generated = self.state.history[self._prompt_len :]
        if self.drafter is not None:
            self.drafter.finish()
            sources, chosen = self.drafter.source_stats()
            if sources:  # a drafter with several sources (TailDrafts)
                self.stats.drafter_sources, self.stats.drafter_choices = sources, chosen
        self.stats.new_tokens = len(generated)
        verdicts = self.audits.verdicts if self.audits is not None else None
        _confirmation.count(
            self.stats,
            self.state.history,
            self._prompt_len,
            verdicts.audited if verdicts is not None and verdicts.enabled else None,
            verdicts.trusted_confirmed if verdicts is not None else (),
            self.trusted_tail,
            verdicts.disputed_only() if verdicts is not None else (),
        )
        self.stats.wall_time = time.perf_counter() - began
        return generated

    async def _lap_with_failover(self, tokens_left: int) -> list[int]:
        while True:
            try:
                if self.state.remote is None:
                    await self._open_session()
                new = await self._lap(tokens_left)
                if self._failed_at is not None:
                    self.stats.failover_time += time.perf_counter() - self._failed_at
                    self._failed_at = None
                return new
            except ServerError as e:
                if not e.retryable or self.stats.failovers >= self.max_failovers:
                    self.state.drop_tree_nodes()
                    raise GenerationError(f"generation failed after {self.stats.failovers} failovers: {e}") from e
                await self._fail_over(e)

    async def _open_session(self) -> None:
        # avoided servers in fallback order (client/_avoidance.py): where the swarm leaves no other, the first of them
        order = self.audits.avoidance.order(self.avoid) if self.audits is not None else sorted(self.avoid)
        remote = await self.swarm.open_session(self.state.max_length, avoid=order)
        # an avoided server the route falls back on was chosen knowingly: no re-verification without it
        self._handled_liars.update(hop.peer_id for hop in remote.route if hop.peer_id in self.avoid)
        self.state.remote = remote
        self.state.cached = 0  # a new route holds nothing: the next lap replays the history
        self.state.tree_pending = None
        self.stats.route = [(hop.peer_id, hop.start, hop.end) for hop in remote.route]
        self._route_peers.update(hop.peer_id for hop in remote.route)

    async def _fail_over(self, error: ServerError) -> None:
        self.stats.failovers += 1
        self.stats.failover_events.append(str(error))
        self._failed_at = self._failed_at or time.perf_counter()
        logger.warning(f"Failing over: {error}")
        self._forget_inflight()
        self.mode.forget()
        self.verdict_at = None
        remote = self.state.remote
        if remote is not None:
            await self.swarm.blame(remote.route, error)  # by evidence only (client/_swarm.py)
            await self.swarm.close_session(remote)
        self.state.remote = None

    # ---- one lap -------------------------------------------------------------------------

    async def _lap(self, tokens_left: int) -> list[int]:
        remote = self.state.remote
        self.tokens_left = tokens_left
        sent_before, received_before = remote.bytes_sent, remote.bytes_received
        if not self.inflight:
            await self._prefill_chunks()
        # 1) fill the window: the oldest run starts from committed tokens, later ones guess
        while len(self.inflight) < self.mode.window:
            decision = self._replay_run(tokens_left) if self._replay else self.mode.next_run(tokens_left)
            if decision is None:
                break
            await self._send(decision)
        # 2) while the network works
        front = self.inflight[0]
        await self._work_ahead(front, tokens_left)
        # 3) the verdict on the oldest run, as the mode reads it
        result = await self._verdict(front)
        tail_drafts = result.drafts if result.correction_ids is None else []  # after the tail's own next token
        front = self.mode.check_verdict(front, result)
        if self.audits is not None and not front.tree:
            self.audits.saw_lap(front.first_draft_pos, front.drafts)  # audit Steps replay them (client/_audit_shape.py)
        self._time_lap(front, result.tail_costs)
        self.stats.add_tail_costs(len(front.token_ids), result.tail_costs)
        if result.correction_ids is not None:
            result = self.mode.corrected(front, result)
            self.stats.corrections += 1
        if self.audits is not None:
            self.audits.saw_run(front, result)  # a rejection run's drafts and q: its audit replays them
        # 4) commit, cancel whatever the verdict refutes, and track a run the tail started
        new = self._commit(front, result, tokens_left)
        self.stats.bytes_up += remote.bytes_sent - sent_before
        self.stats.bytes_down += remote.bytes_received - received_before
        refuted = not front.confirmed_by(result) or len(new) < len(front.drafts) + 1
        if refuted and self.inflight:
            await self._cancel_inflight()
        self._track_looped(self.mode.follow_up(front, result, tail_drafts))
        self._feed_drafter(result, new, tail_drafts)
        return new

    async def _send(self, decision: NextRun) -> None:
        """Send the run a mode (or a re-verification) decided on, taking its run id."""
        state, run = self.state, decision.run
        run_id = state.take_run_id()
        assert run_id == run.run_id, "a run must carry the session's next run id"
        self.stats.hedge_hits += decision.hedged
        if run.tree:
            self.stats.tree_laps += 1
            self.stats.tree_nodes += len(run.drafts)
            self.stats.tree_sizes[len(run.drafts)] += 1
        step = Step(
            session_id=state.remote.session_id,
            run_id=run.run_id,
            start_pos=run.start_pos,
            token_ids=run.token_ids,
            n_draft=len(run.drafts),
            sampling=None if self.sampling == GREEDY else self.sampling,
            top_logprobs=max(self.num_logprobs, LIVE_TOP_LOGPROBS),  # the audits' evidence (client/_audit_shape.py)
            tail_drafts=self.drafter.tail_tokens if self.drafter is not None else 0,
            **self.mode.step_fields(run),
        )
        run.sent_at, run.overlapped = time.perf_counter(), bool(self.inflight)
        await state.remote.send_step(state.with_tree_path(step))
        self.inflight.append(run)
        self.stats.runs_sent += 1
        if self.verdict_at is not None:
            self.stats.turnaround_time += time.perf_counter() - self.verdict_at
            self.verdict_at = None

    async def _verdict(self, front: Run) -> StepResult:
        """Wait for the front run's verdict and take the run out of the window."""
        remote = self.state.remote
        waited = time.perf_counter()
        result = await remote.next_result(front.run_id)
        self.verdict_at = time.perf_counter()
        self.stats.wait_time += self.verdict_at - waited
        if result.run_id != front.run_id:
            raise ServerError(f"result for run {result.run_id} while waiting for {front.run_id}", remote.tail_peer)
        self.inflight.popleft()
        self.state.verdict_seen(front.run_id)
        return result

    async def _work_ahead(self, front: Run, tokens_left: int) -> None:
        """While the network computes ``front``: the mode's hedges, and their offer to the head."""
        hedging = time.perf_counter()
        work = self.mode.while_in_flight(front, tokens_left)
        self.stats.hedges_prepared += work.hedges
        if work.offer is not None:
            await self.state.remote.offer(work.offer)
            self.stats.offers_sent += 1
        self.stats.hedge_time += time.perf_counter() - hedging

    def _time_lap(self, run: Run, tail: Optional[TailCosts] = None) -> None:
        """Time ``run``'s lap for the throughput meter (client/_throughput.py), in every mode, if it
        had the route to itself (``lap_is_timed``). A lap is ``run.sent_at`` to its verdict: for a
        run the client sent, from sending it; for a looped run, from the previous verdict's arrival
        (the tail started it then)."""
        beside_audit = self.audits is not None and not self.audits.quiet_since(run.sent_at)
        if not lap_is_timed(run.overlapped, len(run.token_ids), beside_audit):
            self.stats.laps_untimed += 1
            return
        self.stats.laps_timed += 1
        seconds = self.verdict_at - run.sent_at
        self.swarm.observe_lap(self.state.remote.route, seconds, len(run.token_ids), looped=run.looped)
        if self.drafter is not None and not run.tree:  # a tree's lap is its sizer's (client/_trees.py)
            self.drafter.observe_lap(len(run.token_ids), seconds, tail)

    def _track_looped(self, run: Optional[Run]) -> None:
        """A run the tail started at the head: in flight now, though the client sent nothing."""
        if run is None:
            return
        run_id = self.state.take_run_id()
        assert run_id == run.run_id, "a looped run carries the session's next run id"
        self.inflight.append(run)
        self.stats.looped_runs += 1

    def _feed_drafter(self, result: StepResult, new: list[int], tail_drafts: list[int]) -> None:
        """The committed tokens, and the tail's drafts after them, go to the drafter."""
        if self.drafter is None:
            return
        self.drafter.extend(new)
        if not result.drafts:  # a tail with a drafter always drafts when asked: this one has none
            self.drafter.tail_sent_none()
        elif tail_drafts and len(new) == result.accepted + 1:
            self.drafter.offer(len(self.state.history), tail_drafts)  # they continue after `new`

    async def _prefill_chunks(self) -> None:
        """Send what the caches lack beyond ``max_positions_per_step`` positions as prefill runs of
        at most that many positions (a long prompt, or a failover replay), all at once, and wait
        for their verdicts (ignored: they only confirm the positions are cached). The last chunk,
        at most ``max_positions_per_step`` positions, rides in the next run with its drafts."""
        state = self.state
        limit = state.remote.max_positions_per_step
        runs = []
        position = state.cached
        while len(state.history) - position > limit:
            run_id = state.take_run_id()
            step = Step(
                session_id=state.remote.session_id,
                run_id=run_id,
                start_pos=position,
                token_ids=state.history[position : position + limit],
            )
            await state.remote.send_step(state.with_tree_path(step))
            self.stats.runs_sent += 1
            position += limit
            runs.append((run_id, position))
        for run_id, cached in runs:
            result = await state.remote.next_result(run_id)
            if result.run_id != run_id:
                raise ServerError(f"result for run {result.run_id} while waiting for {run_id}", state.remote.tail_peer)
            state.cached = cached
            state.verdict_seen(run_id)

    def _commit(self, run: Run, result: StepResult, tokens_left: int) -> list[int]:
        """Commit a verdict (cut at EOS and at the tokens left); the cache keeps every committed
        position except the last token, which the next run sends."""
        state = self.state
        if not 0 <= result.accepted <= len(run.drafts):
            raise ServerError(f"result accepts {result.accepted} of {len(run.drafts)} drafts", state.remote.tail_peer)
        accepted = self.mode.accepted_drafts(run, result)
        new = self._cut(accepted + [result.next_token], tokens_left)
        base = run.first_draft_pos
        assert base == len(state.history), "a run's verdict arrived out of order"
        state.cached = min(base + result.accepted, base + len(new) - 1)
        state.history = state.history + new
        if state.remote.tail_peer in self.trusted_peers:
            self.trusted_tail.update(range(base, base + len(new)))
        self._act_on(run, result, self.mode.on_commit(run, result, base))
        self.stats.laps += 1
        self.stats.drafted += len(run.drafts)
        self.stats.accepted += result.accepted
        self.stats.accepted_lengths[result.accepted] += 1
        if result.logprobs:  # live laps always ask for LIVE_TOP_LOGPROBS
            self.live_logprobs += result.logprobs[: len(new)]
        return new

    def _act_on(self, run: Run, result: StepResult, action: VerdictAction) -> None:
        """What the mode decided a committed verdict means: a tree's path the servers hold until
        the next Step keeps it, and the drafter's feedback (none for a re-verification's drafts)."""
        if action.tree_path is not None:
            self.state.tree_pending = action.tree_path
        if run.tree:
            self.stats.tree_accepted += result.accepted
        if self.drafter is not None and not run.replay and action.drafter_feedback is not None:
            self.drafter.observe(*action.drafter_feedback)

    def _cut(self, new: list[int], tokens_left: int) -> list[int]:
        new = new[:tokens_left]
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                return new[: i + 1]
        return new

    async def _cancel_inflight(self) -> None:
        """Cancel every run still in flight with one ID-only message (it covers later runs too)."""
        if not self.inflight:
            return
        first = self.inflight[0]
        if self.state.remote is not None:
            await self.state.remote.cancel(first.run_id)
        self._forget_inflight()

    def _forget_inflight(self) -> None:
        self.stats.runs_cancelled += len(self.inflight)
        self.stats.positions_wasted += sum(len(r.token_ids) for r in self.inflight)
        self.inflight.clear()
