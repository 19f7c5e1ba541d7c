"""One session's state on one server, and the checks a run passes on arrival.

A session belongs to the stream that opened it: runs arrive on that stream in order, are checked
on arrival (so a bad run is refused at once, naming what was wrong), and are computed strictly in
run order by the session's worker. Everything here runs on the event loop, except the cache trims
and gathers (:meth:`ServerSession.trim`, :meth:`ServerSession.compact`) that a run's compute
(server/compute.py) makes in the compute thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import msgspec
import torch

from protocol import trees
from protocol.constraints import Guide
from protocol.digest import digest_of
from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import MAX_TREE_NODES
from protocol.messages import GREEDY, MAX_TOP_LOGPROBS, Hop, RunOutputs, SamplingParams, Step, StepResult
from protocol.sampling import check_draft_q, validate_sampling
from server.adapters import SpanAdapter
from server.compile_budget import Requester
from server.constraints import session_guide
from server.tail_drafter import MAX_TAIL_DRAFTS
from server.verify_rows import RowPlan


@dataclass
class QueuedRun:
    step: Step
    hidden: Optional[torch.Tensor]  # activations from upstream; None at the head
    cancelled: bool = False
    boundary: Optional[torch.Tensor] = None  # the state at the Step's hidden_at (server/boundary_state.py)


@dataclass
class TailReply:
    """What the tail sends the client for a run that asked for outputs: the RunOutputs messages
    with their tensors, then the verdict."""

    outputs: list[tuple[RunOutputs, list[torch.Tensor]]]
    result: StepResult


@dataclass
class Verdict:
    """A verdict waiting in its session's results queue, with the Step it is about. Its digest
    (protocol/digest.py) is keyed with the session's secret, which the tail learns from the
    client's Subscribe on another stream: a Step can be verified here before that Subscribe is
    read (the client sends it first, but nothing orders two streams), and a digest keyed then
    would be keyed with no secret, which the client takes for a rewritten Step and blames the
    whole route for. So the digest is sealed as the verdict goes out (server/subscribe.py), when
    only the subscriber, who holds the secret, can receive it."""

    result: StepResult
    step: Step

    def sealed(self, secret: str) -> StepResult:
        digest = digest_of(self.step, self.step.sampling_params, secret)
        return msgspec.structs.replace(self.result, step_digest=digest)


@dataclass
class QueuedTrim:
    """Forget positions >= length once the runs queued before it are done (after a cancel)."""

    length: int


@dataclass
class TreeLayout:
    """The tree of drafts of a session's last accepted run, cached in run order from ``base`` (its
    first draft's position) until the next Step keeps its accepted path (docs/protocol.md, "Token trees")."""

    run_id: int
    base: int
    parents: list[int]


@dataclass
class ServerSession:
    session_id: str
    max_length: int
    route: list[Hop]
    hop_index: int
    cache: object
    history: list[int] = field(default_factory=list)  # token id at each position the cache holds
    last_run_id: int = -1
    expected_length: int = 0  # positions that will exist once every queued run is computed
    queue: "asyncio.Queue[QueuedRun | QueuedTrim | None]" = field(default_factory=asyncio.Queue)
    running: Optional[QueuedRun] = None
    run_start: dict[int, int] = field(default_factory=dict)  # run id -> start_pos, recent runs
    last_active: float = field(default_factory=time.monotonic)
    closed: bool = False
    upstream: Optional[object] = None  # the MessageStream this session arrived on
    worker: Optional["asyncio.Task"] = None
    secret_hash: str = ""  # sha256 hex of the client's secret: the tail's results go to its holder only
    subscribed: bool = False  # the tail has given this session's results stream to its client
    drafter_state: Optional[object] = None  # the tail's drafter cache (server.tail_drafter.DrafterSession)
    sampling: SamplingParams = GREEDY  # as of the last Step that carried parameters (a Step without: as before)
    guide: Optional[Guide] = None  # the tail: the matcher of sampling.constraint, kept by position
    requester: Optional[Requester] = None  # whose compile budget its constraints spend (server/compile_budget.py)
    tree: Optional[TreeLayout] = None  # the last accepted run's tree, if it was one
    # run id -> (base, nodes): before computing that run, gather a previous tree's accepted path into a chain
    gathers: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    # looped runs (docs/protocol.md): the lowest run id cancelled since the last accepted run
    # (the head drops a looped run it covers), and the tail's stream to the head
    cancelled_since_accept: Optional[int] = None
    loop_runs_left: int = 0  # the last accepted run's loop_runs: how many more runs the tail may start
    head_stream: Optional[object] = None
    offer: Optional[object] = None  # the head: the client's latest DraftOffer
    tail_started: set[int] = field(default_factory=set)  # the tail: runs it started at the head, not yet verified
    prompts: Optional[object] = None  # the head: embeddings of the first positions (OpenSession.num_prompts)
    deep_prompts: Optional[object] = None  # deep_ptune: [span blocks, P, hidden] added at each block's input
    deep_rest: Optional[object] = None  # the deep prompts of the blocks after this span, for the next hop
    adapter: str = ""  # the LoRA adapter its runs apply (OpenSession.active_adapter; server/lora.py); "": none
    row_plan: RowPlan = field(default_factory=RowPlan)  # the tail: logits rows per verification's first call

    @property
    def hop(self) -> Hop:
        return self.route[self.hop_index]

    @property
    def blocks(self) -> range:
        return range(self.hop.start, self.hop.end)

    @property
    def next_hop(self) -> Optional[Hop]:
        return self.route[self.hop_index + 1] if self.hop_index + 1 < len(self.route) else None

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def check_step(self, step: Step, hidden: Optional[torch.Tensor], span: SpanAdapter) -> None:
        """Refuse a run that cannot be computed; raises ProtocolError naming the problem. A Step
        without sampling parameters gets the session's (it keeps them once it passes)."""
        if step.sampling is None:
            step.sampling = self.sampling
        if step.session_id != self.session_id:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"session {step.session_id!r} is not open on this stream")
        if step.run_id <= self.last_run_id:
            raise ProtocolError(
                ErrorCode.RUN_ID_NOT_INCREASING,
                f"run id {step.run_id} is not after the session's last run id {self.last_run_id}",
            )
        num_new = len(step.token_ids)
        if num_new == 0 or not 0 <= step.n_draft < num_new:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"a run needs at least one committed token before its drafts: {num_new} ids, n_draft={step.n_draft}",
            )
        if not 0 <= step.start_pos <= self.expected_length:
            raise ProtocolError(
                ErrorCode.START_POS_BEYOND_CACHE,
                f"start_pos {step.start_pos} is beyond the {self.expected_length} positions this session holds",
            )
        if step.start_pos + num_new > self.max_length:
            raise ProtocolError(
                ErrorCode.TOO_LONG,
                f"positions up to {step.start_pos + num_new} exceed the session's max_length {self.max_length}",
            )
        check_token_ids(step.token_ids, span.vocab_size)
        if not 0 <= step.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if not 0 <= step.return_logits <= num_new or (step.return_hidden and not step.return_logits):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"return_logits must be in [0, {num_new}] (the run's positions), and > 0 with return_hidden",
            )
        hidden_at = step.hidden_at if self.next_hop is None else -1  # the tail's to answer; other hops pass it on
        if hidden_at != -1 and not (step.return_hidden and self.hop.start <= hidden_at <= self.hop.end):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"hidden_at must be -1 or a block boundary in [{self.hop.start}, {self.hop.end}] of this hop, "
                f"with return_hidden; got {step.hidden_at}",
            )
        try:
            validate_sampling(step.sampling_params)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None
        if any(token >= span.vocab_size for token in step.sampling_params.logit_bias):
            message = f"logit_bias names a token id >= the vocabulary size {span.vocab_size}"
            raise ProtocolError(ErrorCode.BAD_REQUEST, message)
        constraint = step.sampling_params.constraint
        if self.next_hop is None and (constraint is not None or self.guide is not None):
            # the tail: the constraint compiles, or the run is refused naming why
            start = step.sampling_params.output_start
            self.guide = session_guide(span.constraints, self.guide, constraint, start, self.requester)
        if step.draft_q is not None:
            self._check_draft_q(step)
        if not 0 <= step.loop_runs <= self.max_length:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"loop_runs must be in [0, max_length={self.max_length}], got {step.loop_runs}"
            )
        if not 0 <= step.tail_drafts <= MAX_TAIL_DRAFTS:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"tail_drafts must be in [0, {MAX_TAIL_DRAFTS}], got {step.tail_drafts}"
            )
        if step.parents:
            self._check_tree(step, span)
        self._tree_gather(step)
        expected_shape = (1, num_new, *span.hidden_shape)
        if self.hop_index > 0 and (hidden is None or tuple(hidden.shape) != expected_shape):
            got = None if hidden is None else tuple(hidden.shape)
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"activations of shape {got}, expected {expected_shape}")
        self.sampling = step.sampling

    @staticmethod
    def _check_tree(step: Step, span: SpanAdapter) -> None:
        """A tree run: a family that computes trees, no rejection exchange, no forward outputs, and
        parents that make a tree of at most MAX_TREE_NODES drafts."""
        if not span.supports_trees:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"this server's model family ({type(span).__name__}) computes chains of drafts only: send "
                'the drafts without parents (docs/protocol.md, "Token trees")',
            )
        if step.draft_q is not None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "a tree of drafts (parents) and the rejection exchange (draft_q) do not go together",
            )
        if step.return_logits:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "return_logits needs a chain: a tree run returns no outputs")
        try:
            trees.check_tree(step.parents, step.n_draft, MAX_TREE_NODES)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed tree: {e}") from None

    def _tree_gather(self, step: Step) -> Optional[tuple[int, list[int]]]:
        """Which nodes of the previous run's tree this Step keeps, as (base, nodes) to gather into a
        chain first; None when nothing needs gathering. Raises ProtocolError for a Step that keeps
        tree nodes without naming an accepted path, or names one that is no path of that tree."""
        tree = self.tree
        if tree is None:
            if step.tree_path:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, "tree_path names the accepted path of the previous run, which was no tree"
                )
            return None
        keep = step.start_pos - tree.base  # nodes of the tree the new start_pos keeps
        if keep <= 0:
            return None  # the trim drops the whole tree
        if not step.tree_path:
            if not trees.is_chain(tree.parents[:keep]):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"start_pos {step.start_pos} keeps {keep} nodes of run {tree.run_id}'s tree, which are no chain "
                    "in run order: name the accepted path in tree_path",
                )
            return None
        if len(step.tree_path) > len(tree.parents):  # before walking it: a hostile list may be long
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"tree_path names {len(step.tree_path)} nodes; run {tree.run_id}'s tree has {len(tree.parents)}",
            )
        try:
            trees.check_path(step.tree_path, tree.parents)
        except ValueError as e:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"tree_path is no path of run {tree.run_id}'s tree: {e}"
            ) from None
        if len(step.tree_path) < keep:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"start_pos {step.start_pos} keeps {keep} nodes of run {tree.run_id}'s tree; tree_path "
                f"names {len(step.tree_path)}",
            )
        nodes = list(step.tree_path[:keep])
        return None if nodes == list(range(keep)) else (tree.base, nodes)

    @staticmethod
    def _check_draft_q(step: Step) -> None:
        """The rejection exchange needs sampling and one probability in (0, 1] per draft."""
        if not step.sampling_params.do_sample:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "draft_q (rejection verification) needs do_sample sampling")
        try:
            check_draft_q(step.draft_q, step.n_draft)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None

    def accept(self, step: Step) -> None:
        """Record an accepted run's ids so later runs are checked against it."""
        self.last_run_id = step.run_id
        self.cancelled_since_accept = None
        self.loop_runs_left = step.loop_runs
        self.expected_length = step.start_pos + len(step.token_ids)
        self.run_start[step.run_id] = step.start_pos
        gather = self._tree_gather(step)  # checked on arrival (check_step)
        if gather is not None:
            self.gathers[step.run_id] = gather
        base = step.start_pos + len(step.token_ids) - step.n_draft
        self.tree = TreeLayout(step.run_id, base, list(step.parents)) if step.parents else None
        if len(self.run_start) > 256:
            self.run_start.pop(next(iter(self.run_start)))

    def cancel_from(self, run_id: int, counts: Optional[dict] = None) -> Optional[int]:
        """Mark run ``run_id`` and every later run received so far as cancelled.

        Returns the earliest start_pos among the cancelled runs (where the cache must be
        trimmed back to), or None when no run was affected. ``counts`` tallies whether each
        cancelled run was still queued, being computed, or already computed here.
        """
        affected = [r for r in self.run_start if r >= run_id]
        if self.cancelled_since_accept is None or run_id < self.cancelled_since_accept:
            self.cancelled_since_accept = run_id
        counts = counts if counts is not None else {}
        caught = set()
        for item in list(self.queue._queue):  # noqa: SLF001 - we own this queue
            if isinstance(item, QueuedRun) and item.step.run_id >= run_id and not item.cancelled:
                item.cancelled = True
                caught.add(item.step.run_id)
                counts["cancelled_queued"] = counts.get("cancelled_queued", 0) + 1
        running = self.running
        if running is not None and running.step.run_id >= run_id and not running.cancelled:
            running.cancelled = True
            caught.add(running.step.run_id)
            counts["cancelled_running"] = counts.get("cancelled_running", 0) + 1
        done = len([r for r in affected if r not in caught])
        counts["cancelled_computed"] = counts.get("cancelled_computed", 0) + done
        if not affected:
            return None
        trim_to = min(self.run_start[r] for r in affected)
        for r in affected:
            del self.run_start[r]
            # a cancelled run that was to gather a tree's path into a chain and has not yet: the trim
            # drops that tree's nodes too (a run computing now has taken its gather already)
            gather = self.gathers.pop(r, None)
            if gather is not None:
                trim_to = min(trim_to, gather[0])
        if self.tree is not None and (self.tree.run_id in affected or trim_to <= self.tree.base):
            self.tree = None
        self.expected_length = min(self.expected_length, trim_to)
        return trim_to

    def trim(self, span: SpanAdapter, length: int) -> None:
        span.trim_cache(self.cache, length)
        del self.history[length:]

    def compact(self, span: SpanAdapter, base: int, nodes: list[int]) -> None:
        """Gather a tree's accepted path (nodes cached in run order from ``base``) into a chain at
        ``base``, in the cache and in ``history``."""
        held = span.cache_length(self.cache)
        if base + max(nodes) + 1 > held:
            raise ProtocolError(
                ErrorCode.START_POS_BEYOND_CACHE,
                f"tree_path keeps position {base + max(nodes)}, beyond the {held} positions in this server's cache",
            )
        span.gather_cache(self.cache, base, nodes)
        self.history[base : base + len(nodes)] = [self.history[base + node] for node in nodes]


def check_token_ids(token_ids: Iterable[int], vocab_size: int) -> None:
    """Refuse ids outside the vocabulary (a Step's, a DraftOffer's), naming the first."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(
            ErrorCode.TOKEN_OUT_OF_VOCAB, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
