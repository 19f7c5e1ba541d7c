"""The client's side of one generation: draft, send runs, read verdicts, commit.

One lap, top to bottom (``SpeculativeDecoder._lap``):
  1) keep up to ``max_inflight_runs`` runs in flight: each new run assumes every run before it
     is accepted whole and guesses its bonus token (the drafter's next token). A run sent when
     none is in flight carries only ``front_drafts`` of its proposal (none by default) and the
     rest rides in the run behind it, so the front verdict never waits for the drafts' compute:
     where the first draft is wrong, the lap is as short as a lap without speculation;
  2) while the oldest run is in flight, hedge: draft the next run for its likeliest refuting
     verdicts (a speculation cache, after Saguaro), so after one the next run leaves at once;
  3) read the verdict of the oldest run: ``accepted`` drafts plus the target's own next token;
  4) commit them; if the verdict refutes what later runs assumed, cancel those runs with one
     ID-only message and let the next run start again from what is committed.
The oldest run in flight always starts from committed tokens (the canonical run), so every lap
commits at least one token whatever the drafter does. With one run in flight this is plain
synchronous speculative decoding. A failure anywhere (a server dies, hangs or refuses with a
retryable error) reroutes the session and replays the committed tokens as one prefill lap, so no
token is lost or repeated.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import msgspec

from client._remote_session import RemoteSession
from client._swarm import SwarmClient
from client._spot_checks import SpotChecker
from client._trees import DraftTree, PendingPath, TreeSizer, build_tree
from client.drafters import Drafter
from client.errors import GenerationError, ServerError
from protocol import trees as tree_rules
from protocol.limits import MAX_OFFER_OPTIONS, MAX_TREE_NODES
from protocol.messages import GREEDY, DraftOffer, LoopedStep, SamplingParams, Step, StepResult, TokenLogprobs, TreeStep
from protocol.sampling import pack_f16, sample_correction, unpack_f16

logger = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    """What the last ``generate`` call did; ``model.last_generation_stats``."""

    new_tokens: int = 0
    laps: int = 0  # verdicts that committed tokens
    drafted: int = 0  # draft tokens in those runs
    accepted: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)  # accepted drafts per lap -> laps
    runs_sent: int = 0
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
    # with tail drafts (client.drafters.TailDrafts): per source ("tail", "retrieval"), [proposals,
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
    liars_excluded: list[str] = field(default_factory=list)  # peer ids outvoted by a third server
    tokens_retracted: int = 0  # committed (and streamed) tokens that a re-verification replaced
    spot_check_events: list[str] = field(default_factory=list)  # one line per audit: hop, peers, outcome

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


@dataclass
class SessionState:
    """What the client knows about one (possibly long-lived) session.

    ``history`` is every committed token; the servers' caches hold positions ``< cached``.
    """

    max_length: int
    remote: Optional[RemoteSession] = None
    history: list[int] = field(default_factory=list)
    cached: int = 0
    next_run_id: int = 0
    # a tree run's accepted path, held by the servers in run order until a Step keeps it
    tree_pending: Optional[PendingPath] = None


HEDGE_WIDTH = 2  # alternatives hedged per position of the front run
MAX_HEDGES = 16  # hedged drafts per lap at most: each costs microseconds, while the network works


class HedgeCache:
    """Drafts made for verdicts not yet received, keyed by the tokens such a verdict would
    commit after history position ``base``."""

    def __init__(self) -> None:
        self.base: Optional[int] = None
        self._drafts: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self._drafts)

    def start(self, base: int) -> None:
        self.base = base
        self._drafts.clear()

    def put(self, outcome: Sequence[int], draft: list[int]) -> None:
        self._drafts[tuple(outcome)] = draft

    def take(self, history: Sequence[int]) -> Optional[list[int]]:
        """The draft prepared for what the history now holds after ``base``, if any."""
        if self.base is None or len(history) <= self.base:
            return None
        return self._drafts.get(tuple(history[self.base :]))

    def clear(self) -> None:
        self.base = None
        self._drafts.clear()

    def options(self) -> list[tuple[int, int, list[int]]]:
        """The hedges as DraftOffer options: (drafts accepted, the target's token, drafts after it)."""
        return [(len(outcome) - 1, outcome[-1], draft) for outcome, draft in self._drafts.items() if draft]


@dataclass
class Run:
    """A run in flight and what the client assumed when it sent it."""

    run_id: int
    start_pos: int
    token_ids: list[int]
    drafts: list[int]
    guess: Optional[int]  # the assumed bonus token; None: nothing may be sent after this run
    prefix_drafts: int = 0  # drafts of the same proposal before this run's (a split front's and its guess)
    proposed: int = 0  # drafts proposed at this run's position; more than it carries if it is split
    sent_at: float = 0.0  # perf_counter() when sent: the lap's time is measured per hop (client/_throughput.py)
    draft_q: list[float] = field(default_factory=list)  # rejection rule: q(x) of each draft
    q_dists: list = field(default_factory=list)  # and the drafter's whole q at each draft position
    replay: bool = False  # a re-verification run: its drafts are tokens committed before a liar was caught
    parents: list[int] = field(default_factory=list)  # a tree run: each draft's parent (-1: the root)
    tree: bool = False  # sent in tree mode (a tree, or a chain the tree sizer chose)
    shape: Optional[DraftTree] = None  # tree mode: the nodes sent, with the drafter's scores (for the cost model)
    looped: bool = False  # started at the head by the tail (LoopedStep), not sent by the client

    @property
    def split(self) -> bool:
        """A front run cut short: the rest of its proposal follows in the next run."""
        return self.proposed > len(self.drafts)


class SpeculativeDecoder:
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
        spot_checker: Optional[SpotChecker] = None,
        draft_tree: bool = False,
        tree_sizer: Optional[TreeSizer] = None,
        loop_runs: bool = False,
    ):
        if max_inflight_runs < 1:
            raise ValueError(f"max_inflight_runs must be >= 1, got {max_inflight_runs}")
        self.swarm, self.state, self.sampling = swarm, state, sampling
        self.drafter, self.num_draft_tokens = drafter, num_draft_tokens
        self.max_inflight_runs = max_inflight_runs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_logprobs = num_logprobs
        self.on_tokens = on_tokens
        self.max_failovers = max_failovers
        # drafts a run sent into an empty window keeps (None: all of them); only with a window
        self.front_drafts = front_drafts if max_inflight_runs > 1 else None
        self.rejection = _rejection_rule(verification, sampling, drafter, max_inflight_runs)
        self.stats = GenerationStats()
        self.logprobs: list[TokenLogprobs] = []
        self._inflight: deque[Run] = deque()
        self._hedges = HedgeCache()
        self._verdict_at: Optional[float] = None
        self._failed_at: Optional[float] = None
        self.spot_checker = spot_checker
        self.draft_tree = _tree_mode(draft_tree, max_inflight_runs, self.rejection) and drafter is not None
        self._sizer = tree_sizer if tree_sizer is not None else TreeSizer()  # the model's: it learns across calls
        self._prompt_len = 0
        # the tail starts each next run at the head (docs/protocol.md "Looped runs"): one
        # run in flight, chains verified by token match
        self.loop_runs = loop_runs and max_inflight_runs == 1 and not self.rejection and not self.draft_tree
        self._offered: dict[tuple[int, int], list[int]] = {}  # the last DraftOffer's options by verdict
        self._offered_for: Optional[int] = None  # the run whose verdicts they follow
        self._budget = 0
        self._replay: list[int] = []  # tokens generated before a liar was caught, still to re-verify
        self._route_peers: set[str] = set()  # every server of this generation's routes
        self._handled_liars: set[str] = set()

    async def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Generate after ``prompt`` (the whole context); returns the new tokens only."""
        began = time.perf_counter()
        self._start_from(list(prompt))
        if self.drafter is not None:
            self.drafter.reset(self.state.history)
        self._prompt_len = len(prompt)
        if self.state.remote is not None:  # an inference session's route from an earlier call
            self._route_peers.update(hop.peer_id for hop in self.state.remote.route)
        try:
            while True:
                await self._react_to_liars()
                produced = len(self.state.history) - self._prompt_len
                ended = produced >= max_new_tokens or (produced > 0 and self.state.history[-1] in self.eos_token_ids)
                if ended and not self._replay:
                    if self.spot_checker is None or self.spot_checker.task is None:
                        break
                    await self.spot_checker.settle()  # its verdict may retract tokens: it comes before the output
                    continue
                new = await self._lap_with_failover(max_new_tokens - produced)
                fresh = self._reconcile(new)
                if self.on_tokens is not None and fresh:
                    self.on_tokens(fresh)
                if self.spot_checker is not None and self.state.remote is not None:
                    self.spot_checker.maybe_start(self.state.remote.route, self.state.history, self.stats, self.stats.laps)
        finally:
            await self._cancel_inflight()
            if self.spot_checker is not None:
                await self.spot_checker.cancel()
        generated = self.state.history[self._prompt_len :]
        if self.drafter is not None:
            self.drafter.finish()
            if hasattr(self.drafter, "sources"):
                self.stats.drafter_sources = {k: list(v) for k, v in self.drafter.sources.items()}
                self.stats.drafter_choices = dict(self.drafter.chosen)
        self.stats.new_tokens = len(generated)
        self.stats.wall_time = time.perf_counter() - began
        return generated

    def _start_from(self, prompt: list[int]) -> None:
        """Keep the servers' cache for the longest common prefix with what they already hold."""
        state = self.state
        if len(prompt) + 1 > state.max_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the session's max_length is {state.max_length}")
        common = 0
        for a, b in zip(state.history[: state.cached], prompt):
            if a != b:
                break
            common += 1
        state.cached = min(common, len(prompt) - 1)  # at least one token must be sent to get logits
        state.history = prompt

    async def _lap_with_failover(self, budget: int) -> list[int]:
        while True:
            try:
                if self.state.remote is None:
                    await self._open_session()
                new = await self._lap(budget)
                if self._failed_at is not None:
                    self.stats.failover_time += time.perf_counter() - self._failed_at
                    self._failed_at = None
                return new
            except ServerError as e:
                if not e.retryable or self.stats.failovers >= self.max_failovers:
                    self._drop_tree_nodes()
                    raise GenerationError(f"generation failed after {self.stats.failovers} failovers: {e}") from e
                await self._fail_over(e)

    async def _open_session(self) -> None:
        remote = await self.swarm.open_session(self.state.max_length)
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
        self._hedges.clear()
        self._verdict_at = None
        remote = self.state.remote
        if remote is not None:
            # a silent hang names no server: ask every hop, and blame those that do not answer
            blamed = [error.peer_id] if error.peer_id else await self.swarm.unresponsive(remote.route)
            for peer_id in blamed:
                self.swarm.exclude(peer_id)
            await self.swarm.close_session(remote)
        self.state.remote = None

    # ---- one lap -------------------------------------------------------------------------

    async def _lap(self, budget: int) -> list[int]:
        remote = self.state.remote
        self._budget = budget
        sent_before, received_before = remote.bytes_sent, remote.bytes_received
        if not self._inflight:
            await self._prefill_chunks()
        # 1) fill the window: the oldest run starts from committed tokens, later ones guess
        while len(self._inflight) < self.max_inflight_runs:
            run = self._next_run(budget)
            if run is None:
                break
            run.sent_at = time.perf_counter()
            await remote.send_step(self._step(run))
            self._inflight.append(run)
            self.stats.runs_sent += 1
            if self._verdict_at is not None:
                self.stats.turnaround_time += time.perf_counter() - self._verdict_at
                self._verdict_at = None
        # 2) while the network works: drafts for the front run's likeliest refuting verdicts
        front = self._inflight[0]
        hedging = time.perf_counter()
        if not front.tree:  # a tree run is followed by a tree drafted after its verdict
            self._hedge(front, budget)
            if front.looped:  # the run after it starts at the head: offer the hedges there
                await self._offer(front)
        self.stats.hedge_time += time.perf_counter() - hedging
        # 3) the verdict on the oldest run
        waited = time.perf_counter()
        result = await remote.next_result(front.run_id)
        self._verdict_at = time.perf_counter()
        self.stats.wait_time += self._verdict_at - waited
        if result.run_id != front.run_id:
            raise ServerError(f"result for run {result.run_id} while waiting for {front.run_id}", remote.tail_peer)
        self._inflight.popleft()
        if front.looped:  # the head chose its drafts (the tail's or an offer): the verdict names them
            self._take_run_drafts(front, result)
        else:  # a looped lap began at the tail: no client-to-head link to time
            self.swarm.observe_lap(remote.route, self._verdict_at - front.sent_at, len(front.token_ids))
        self._verdict_seen(front.run_id)
        if self.draft_tree:
            self._sizer.observe_lap(len(front.token_ids), self._verdict_at - front.sent_at)
            if front.drafts and front.shape is not None:
                self._sizer.observe_acceptance(front.shape, result.accepted)
        # 4) commit, then cancel whatever the verdict refutes
        tail_drafts = result.drafts if result.correction_ids is None else []  # after the tail's own next token
        if result.correction_ids is not None:
            result = self._corrected(front, result)
        new = self._commit(front, result, budget)
        self.stats.bytes_up += remote.bytes_sent - sent_before
        self.stats.bytes_down += remote.bytes_received - received_before
        refuted = not self._confirms(front, result) or len(new) < len(front.drafts) + 1
        if refuted and self._inflight:
            await self._cancel_inflight()
        if result.looped:
            self._follow_looped_run(front, result, tail_drafts)
        if self.drafter is not None:
            self.drafter.extend(new)
            if hasattr(self.drafter, "offer"):  # TailDrafts
                if not result.drafts:  # a tail with a head always drafts when asked: this one has none
                    self.drafter.head_tokens = 0  # so stop asking (2 bytes up per lap)
                elif tail_drafts and len(new) == result.accepted + 1:
                    self.drafter.offer(len(self.state.history), tail_drafts)  # they continue after `new`
        return new

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
            run_id = state.next_run_id
            state.next_run_id += 1
            step = self._with_tree_path(Step(session_id=state.remote.session_id, run_id=run_id, start_pos=position,
                                             token_ids=state.history[position : position + limit]))  # fmt: skip
            await state.remote.send_step(step)
            self.stats.runs_sent += 1
            position += limit
            runs.append((run_id, position))
        for run_id, cached in runs:
            result = await state.remote.next_result(run_id)
            if result.run_id != run_id:
                raise ServerError(f"result for run {result.run_id} while waiting for {run_id}", state.remote.tail_peer)
            state.cached = cached
            self._verdict_seen(run_id)

    def _follow_looped_run(self, run: Run, result: StepResult, tail_drafts: list[int]) -> None:
        """The tail has started the next run at the head: [next_token, *its tail drafts] from the
        position after next_token's. Track it as in flight; the client sends nothing for it."""
        state = self.state
        if not self.loop_runs or result.correction_ids is not None or run.run_id + 1 != state.next_run_id:
            raise ServerError(f"run {result.run_id + 1} started at the head unasked", state.remote.tail_peer)
        start = run.start_pos + len(run.token_ids) - len(run.drafts) + result.accepted
        # what the head most likely sent (the offer for this verdict, else the tail's drafts): the
        # hedges for its verdict build on it; its own verdict says what it really carried
        offered = self._offered if self._offered_for == run.run_id else {}
        drafts = offered.get((result.accepted, result.next_token), tail_drafts)
        following = Run(state.next_run_id, start, [result.next_token, *drafts], list(drafts), None,
                        proposed=len(drafts), sent_at=self._verdict_at, looped=True)  # fmt: skip
        state.next_run_id += 1
        self._inflight.append(following)
        self.stats.looped_runs += 1

    async def _offer(self, run: Run) -> None:
        """Send the head the hedged drafts for the verdicts of ``run``, for the run the tail starts after it."""
        options = self._hedges.options()[:MAX_OFFER_OPTIONS]
        self._offered, self._offered_for = {(a, t): d for a, t, d in options}, run.run_id
        if options:
            await self.state.remote.offer(DraftOffer(session_id=self.state.remote.session_id, run_id=run.run_id, options=options))
            self.stats.offers_sent += 1

    def _take_run_drafts(self, run: Run, result: StepResult) -> None:
        drafts = result.run_drafts
        if drafts is None or not 0 <= result.accepted <= len(drafts) or len(drafts) > self.state.remote.max_positions_per_step:
            raise ServerError(f"the verdict on looped run {run.run_id} does not name its drafts", self.state.remote.tail_peer)
        run.drafts, run.token_ids, run.proposed = list(drafts), [run.token_ids[0], *drafts], len(drafts)

    @staticmethod
    def _confirms(run: Run, result: StepResult) -> bool:
        """Whether a verdict holds what the runs behind ``run`` assumed: every draft and the guess."""
        return result.accepted == len(run.drafts) and result.next_token == run.guess

    def _assumed(self) -> list[int]:
        """The tokens the runs in flight add if each is accepted whole with its guess."""
        return [tok for run in self._inflight for tok in (*run.drafts, run.guess)]

    def _room(self, budget: int, assumed: int) -> int:
        """How many drafts a run may carry after `assumed` uncommitted tokens."""
        end_of_context = len(self.state.history) + assumed  # position of the run's first draft
        return min(budget - assumed - 1, self.state.max_length - end_of_context - 1, self.num_draft_tokens)

    def _proposal_size(self, num_drafts: int) -> int:
        """Ids to ask the drafter for: the drafts, plus the guess when runs may follow this one."""
        return num_drafts + (1 if self.max_inflight_runs > 1 else 0)

    def _next_run(self, budget: int) -> Optional[Run]:
        """Draft the next run; None when nothing more may be sent now."""
        if self._replay:
            return self._replay_run(budget)
        state = self.state
        if self._inflight:
            last = self._inflight[-1]
            if last.guess is None:
                return None
            start_pos = last.start_pos + len(last.token_ids)
            committed_part = [last.guess]
            assumed = self._assumed()
        else:
            start_pos, committed_part, assumed = state.cached, state.history[state.cached :], []
        # drafts and committed ids together stay within one Step's positions
        room = min(self._room(budget, len(assumed)), self.state.remote.max_positions_per_step - len(committed_part))
        if self._inflight and room < 1:
            return None
        if self.draft_tree and not self._inflight:
            return self._tree_run(start_pos, committed_part, room)
        proposal: list[int] = []
        num_drafts = 0
        if self.drafter is not None and room > 0:
            num_drafts = min(room, self.drafter.draft_cap)
            size = self._proposal_size(num_drafts)
            # a verdict's tail drafts (TailDrafts) postdate every hedge: the drafter chooses afresh
            fresh = getattr(self.drafter, "fresh", False)
            hedged = None if self._inflight or self.rejection or fresh else self._hedges.take(state.history)
            if hedged is not None:
                self.stats.hedge_hits += 1
                proposal = hedged[:size]
            else:
                proposal = self.drafter.draft(size, after=assumed)
        self._hedges.clear()
        # the drafts are what synchronous speculation would send; the guess is one more token,
        # made only where the drafter continues past them (else nothing is sent behind this run)
        drafts, guess = proposal[:num_drafts], (proposal[num_drafts] if len(proposal) > num_drafts else None)
        if self._inflight and not drafts and guess is None:
            return None
        proposed = len(drafts)
        if self._light_front(drafts, budget):
            drafts, guess = drafts[: self.front_drafts], drafts[self.front_drafts]
        if guess is not None and guess in self.eos_token_ids:
            guess = None  # nothing follows an end of sequence
        prefix = len(self._inflight[-1].drafts) + 1 if self._inflight and self._inflight[-1].split else 0
        run_id = state.next_run_id
        state.next_run_id += 1
        run = Run(run_id, start_pos, committed_part + drafts, drafts, guess, prefix, proposed)
        if self.rejection and drafts:  # one run in flight, drafted just now: last_q is this run's
            run.draft_q, run.q_dists = self.drafter.last_q[: len(drafts)], self.drafter.last_dists[: len(drafts)]
        return run

    def _tree_run(self, start_pos: int, committed_part: list[int], room: int) -> Run:
        """A run carrying a tree of drafts (client/_trees.py): the drafter's chain plus its ranked
        alternatives as branches, as many nodes as the cost model finds worth their compute. A
        tree that came out a chain goes as one (a plain Step)."""
        state = self.state
        tree = DraftTree()
        if self.drafter is not None and room > 0:
            chain = self.drafter.draft(min(room, self.drafter.draft_cap))
            max_nodes = min(MAX_TREE_NODES, self.state.remote.max_positions_per_step - len(committed_part),
                            state.max_length - len(state.history) - 1)  # fmt: skip
            full = build_tree(self.drafter, chain, max_nodes, room, self.drafter.extra_chains(room), self.eos_token_ids)
            tree = full.prefix(self._sizer.choose(full, len(committed_part)))
        self._hedges.clear()
        run_id = state.next_run_id
        state.next_run_id += 1
        run = Run(run_id, start_pos, committed_part + tree.ids, tree.ids, None, 0, tree.chain_len, tree=True,
                  shape=tree)  # fmt: skip
        if not tree_rules.is_chain(tree.parents):
            run.parents = tree.parents
        self.stats.tree_laps += 1
        self.stats.tree_nodes += len(tree)
        self.stats.tree_sizes[len(tree)] += 1
        return run

    def _with_tree_path(self, step: Step, parents: Sequence[int] = ()) -> Step:
        """The Step as a TreeStep when it carries a tree (``parents``) or must name the accepted path
        of the session's previous tree run (the first Step after that run's verdict)."""
        pending, tree_path = self.state.tree_pending, None
        if pending is not None and not pending.attached:
            pending.attached = True
            tree_path = pending.tree_path_for(step.start_pos)
        if not parents and not tree_path:
            return step
        return TreeStep(**msgspec.structs.asdict(step), parents=list(parents), tree_path=tree_path or [])

    def _verdict_seen(self, run_id: int) -> None:
        """A verdict on a run after a tree run: every server has kept (or dropped) the tree's path."""
        pending = self.state.tree_pending
        if pending is not None and run_id > pending.run_id:
            self.state.tree_pending = None

    def _drop_tree_nodes(self) -> None:
        """After a refused run the servers may not have gathered a tree's accepted path: the next
        run starts at the tree (resending what the path committed), which drops its nodes everywhere."""
        pending = self.state.tree_pending
        if pending is not None:
            self.state.cached = min(self.state.cached, pending.base)
            self.state.tree_pending = None

    def _light_front(self, drafts: list[int], budget: int) -> bool:
        """Whether a run sent into an empty window keeps only ``front_drafts`` of its drafts, the
        rest riding in the run behind it (its verdict then comes back sooner when its first drafts
        fail): only if the draft at the cut, the guess, is no EOS (something must follow it) and
        the budget leaves room for a run behind it."""
        cut = self.front_drafts
        if self._inflight or cut is None or len(drafts) <= cut:
            return False
        return drafts[cut] not in self.eos_token_ids and self._room(budget, cut + 1) >= 1

    def _hedge(self, front: Run, budget: int) -> None:
        """Outcome hedging: draft, before the verdict, the next front run for the front run's
        likeliest refuting outcomes: at each draft position j, the drafter's top alternatives
        to the drafted token (accepted j, then the target said otherwise), and after the last
        draft its top alternatives to the guess. A confirmed guess needs no hedge (its run is
        already in flight). Each hedge is drafted under the size and adaptive cap its verdict
        would leave; it can differ from a draft made after the verdict only in that the
        verdict's own tokens are not yet in the drafter's statistics."""
        if self.drafter is None or front.replay:
            return
        self._hedges.start(len(self.state.history))
        for j in range(len(front.drafts) + 1):
            expected = front.drafts[j] if j < len(front.drafts) else front.guess
            outcome_prefix = front.drafts[:j]
            for token in self.drafter.alternatives(HEDGE_WIDTH + 1, after=outcome_prefix):
                if token == expected or len(self._hedges) >= MAX_HEDGES:
                    continue
                outcome = outcome_prefix + [token]
                num_drafts = min(self._room(budget, len(outcome)), self.drafter.cap_after(len(front.drafts), j))
                self._hedges.put(outcome, self.drafter.draft(self._proposal_size(num_drafts), after=outcome))
                self.stats.hedges_prepared += 1

    def _step(self, run: Run) -> Step:
        return self._with_tree_path(self._chain_step(run), run.parents)

    def _chain_step(self, run: Run) -> Step:
        loop_runs = max(0, self._budget - 1) if self.loop_runs and not run.replay else 0
        extra = {"loop_runs": loop_runs} if loop_runs else {}
        return (LoopedStep if loop_runs else Step)(
            session_id=self.state.remote.session_id,
            run_id=run.run_id,
            start_pos=run.start_pos,
            token_ids=run.token_ids,
            n_draft=len(run.drafts),
            sampling=None if self.sampling == GREEDY else self.sampling,
            top_logprobs=self.num_logprobs,
            draft_q=pack_f16(run.draft_q) if run.draft_q else None,
            tail_drafts=getattr(self.drafter, "head_tokens", 0),
            **extra,
        )

    def _corrected(self, run: Run, result: StepResult) -> StepResult:
        """A rejection's verdict with the client's token at the rejected position: drawn from
        norm(max(0, p - q)) over the top-K of p the tail sent (protocol/sampling.py)."""
        tail = self.state.remote.tail_peer
        ids, probs = result.correction_ids, unpack_f16(result.correction_p)
        if not run.q_dists or not 0 <= result.accepted < len(run.q_dists):
            raise ServerError(f"a correction after {result.accepted} accepted drafts, for a run that cannot be corrected", tail)
        q = run.q_dists[result.accepted]
        if not ids or len(probs) != len(ids) or not all(0 <= i < q.numel() for i in ids):
            raise ServerError(f"a malformed correction: {len(ids)} ids, {len(probs)} probabilities", tail)
        position = run.start_pos + len(run.token_ids) - len(run.drafts) + result.accepted
        token = sample_correction(ids, probs, q, self.sampling.seed, position)
        self.stats.corrections += 1
        logprobs = result.logprobs
        if logprobs:  # the tail reported its own token at the rejected position: report ours
            last = logprobs[-1]
            known = dict(zip(last.top_ids, last.top_logprobs))
            fixed = TokenLogprobs(token, known.get(token, float("nan")), last.top_ids, last.top_logprobs)
            logprobs = logprobs[:-1] + [fixed]
        return msgspec.structs.replace(result, next_token=token, logprobs=logprobs)

    def _commit(self, run: Run, result: StepResult, budget: int) -> list[int]:
        """Commit a verdict (cut at EOS and at the token budget); the cache keeps every committed
        position except the last token, which the next run sends."""
        state = self.state
        if not 0 <= result.accepted <= len(run.drafts):
            raise ServerError(f"result accepts {result.accepted} of {len(run.drafts)} drafts", state.remote.tail_peer)
        accepted = self._accepted_drafts(run, result)
        new = self._cut(accepted + [result.next_token], budget)
        base = run.start_pos + len(run.token_ids) - len(run.drafts)  # position of the first draft
        assert base == len(state.history), "a run's verdict arrived out of order"
        state.cached = min(base + result.accepted, base + len(new) - 1)
        state.history = state.history + new
        if run.parents:  # the servers hold the tree in run order until the next Step keeps this path
            state.tree_pending = PendingPath(run.run_id, base, list(result.path))
        if run.tree:
            self.stats.tree_accepted += result.accepted
        self.stats.laps += 1
        self.stats.drafted += len(run.drafts)
        self.stats.accepted += result.accepted
        self.stats.accepted_lengths[result.accepted] += 1
        if self.drafter is not None and not run.replay and not (run.split and self._confirms(run, result)):
            # one observation per proposal: a split front's is made by the run carrying its rest
            drafted = max(run.proposed, run.prefix_drafts + len(run.drafts))
            if run.tree:  # the chain's length (its cap adapts as a chain's would) or the path's
                drafted = max(run.proposed, result.accepted)
            self.drafter.observe(drafted, run.prefix_drafts + result.accepted)
        if result.logprobs:
            self.logprobs += result.logprobs[: len(new)]
        return new

    def _accepted_drafts(self, run: Run, result: StepResult) -> list[int]:
        """The drafts a verdict accepts: a prefix of a chain's, or a tree's path (which it must name)."""
        if not run.parents:
            return run.drafts[: result.accepted]
        try:
            if len(result.path) != result.accepted:
                raise ValueError(f"a path of {len(result.path)} nodes for {result.accepted} accepted drafts")
            tree_rules.check_path(result.path, run.parents)
        except ValueError as e:
            raise ServerError(f"a malformed verdict on a tree run: {e}", self.state.remote.tail_peer) from None
        return tree_rules.path_ids(result.path, run.drafts)

    def _cut(self, new: list[int], budget: int) -> list[int]:
        new = new[:budget]
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                return new[: i + 1]
        return new

    async def _cancel_inflight(self) -> None:
        """Cancel every run still in flight with one ID-only message (it covers later runs too)."""
        if not self._inflight:
            return
        first = self._inflight[0]
        if self.state.remote is not None:
            await self.state.remote.cancel(first.run_id)
        self._forget_inflight()

    def _forget_inflight(self) -> None:
        self.stats.runs_cancelled += len(self._inflight)
        self.stats.positions_wasted += sum(len(r.token_ids) for r in self._inflight)
        self._inflight.clear()

    # ---- spot-checks: a liar caught, its tokens re-verified ----------------------------------

    async def _react_to_liars(self) -> None:
        """A server of this generation's routes was caught lying (by a spot-check of this or any
        generation of the client): leave the route, and re-verify every token this call generated
        on the new one. The prompt goes as committed ids, the generated tokens as drafts, so the
        new tail accepts exactly those its own choices (the exact rule) reproduce."""
        caught = (self.swarm.liars & self._route_peers) - self._handled_liars
        if not caught:
            return
        self._handled_liars |= caught
        state = self.state
        what = f"re-verifying {len(state.history) - self._prompt_len + len(self._replay)} generated tokens without {sorted(caught)}"
        self.stats.spot_check_events.append(f"lap {self.stats.laps}: {what}")
        logger.warning(f"A server of this generation was caught lying: {what}")
        self._forget_inflight()  # the session closes below, on every server
        self._hedges.clear()
        self._verdict_at = None
        if state.remote is not None:
            await self.swarm.close_session(state.remote)
            state.remote = None
        self._replay = state.history[self._prompt_len :] + self._replay
        state.history, state.cached = state.history[: self._prompt_len], 0
        self.logprobs.clear()  # the re-verification's verdicts bring them again
        if self.drafter is not None:
            self.drafter.reset(state.history)

    def _replay_run(self, budget: int) -> Optional[Run]:
        """A re-verification run, alone in the window: the committed ids the caches lack, then as
        many of the tokens to re-verify as drafts as one Step takes (the rest in later laps)."""
        if self._inflight:
            return None
        state = self.state
        committed = state.history[state.cached :]
        room = min(budget - 1, state.max_length - len(state.history) - 1, state.remote.max_positions_per_step - len(committed))
        drafts = self._replay[: max(0, room)]
        run_id = state.next_run_id
        state.next_run_id += 1
        return Run(run_id, state.cached, committed + drafts, drafts, None, replay=True)

    def _reconcile(self, new: list[int]) -> list[int]:
        """The tokens of a verdict that are news to the caller: those re-confirming tokens committed
        before a re-verification are not; at the first that differs, the rest of them is retracted."""
        for i, token in enumerate(new):
            if self._replay and token == self._replay[0]:
                self._replay.pop(0)
                continue
            if self._replay:
                self.stats.tokens_retracted += len(self._replay)
                logger.warning(f"Re-verification replaced {len(self._replay)} tokens committed before a liar was caught")
                self._replay = []
            return new[i:]
        return []


VERIFICATION_RULES = ("match", "rejection")


def _tree_mode(draft_tree: bool, inflight: int, rejection: bool) -> bool:
    """Whether runs carry token trees: only synchronous speculation (one run in flight: a run sent
    behind a tree would have to guess its path), and never with the rejection exchange."""
    if not isinstance(draft_tree, bool):
        raise ValueError(f"draft_tree must be True or False, got {draft_tree!r}")
    if draft_tree and inflight > 1:
        raise ValueError("draft_tree=True runs synchronous speculation: leave async_speculation off")
    if draft_tree and rejection:
        raise ValueError("draft_tree=True verifies by token match: it does not go with verification='rejection'")
    return draft_tree


def _rejection_rule(verification: str, sampling: SamplingParams, drafter: Optional[Drafter], inflight: int) -> bool:
    """Whether runs go up with q(x) for the rejection rule: only when sampling (greedy verification
    is token match whatever is asked), with a drafter that reports q, one run in flight."""
    if verification not in VERIFICATION_RULES:
        raise ValueError(f"verification must be one of {VERIFICATION_RULES}, got {verification!r}")
    if verification == "match" or not sampling.do_sample:
        return False
    if not hasattr(drafter, "last_dists") or not getattr(drafter, "sample", False):
        raise ValueError("verification='rejection' needs a draft_model (a drafter that samples from its q)")
    if inflight > 1:
        raise ValueError("verification='rejection' runs one run at a time: leave async_speculation off")
    return True
