"""Token trees on the client: build a tree of drafts per lap and choose its size from lap times.

A tree run verifies several guesses at once (docs/protocol.md, "Token trees"): the drafter's chain
(what a chain run would send) plus branches at the positions where the drafter knows likely
alternatives. The servers compute every node in one pass; only the accepted path stays in their
caches. A node costs server compute, so a tree is worth its size only where the lap is dominated by
the network: ``TreeSizer`` fits lap time = fixed + per_position x positions over the laps it has
measured (runs of different sizes: the prompt's prefill, chains, trees; the tail's reported part
priced apart) and keeps the prefix of the
tree (in the order it was built, best first) that maximizes expected tokens per second, as
Sequoia and SpecExec size their trees, with the network's share of the lap in the fixed part.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

from client.drafting import Drafter
from client.drafting.cost_model import DecayedLine, TailFit, check_lap_costs
from protocol.tail_costs import TailCosts

TREE_WIDTH = 3  # alternatives asked of the drafter per node
UNRANKED_PROB = 0.5  # the estimate for a chain token the drafter's ranking does not list


@dataclass
class DraftTree:
    """Nodes in the order they were added (parents before children): ``ids``, ``parents`` (-1: the
    root, the run's last committed id) and ``scores``, the drafter's estimate that each node lies on
    the accepted path. The first ``chain_len`` nodes are the drafter's own chain."""

    ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    chain_len: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, token: int, parent: int, score: float) -> int:
        self.ids.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.ids) - 1

    def prefix(self, n: int) -> "DraftTree":
        """The first n nodes: a tree too, since parents come before their children."""
        return DraftTree(self.ids[:n], self.parents[:n], self.scores[:n], self.depths[:n], min(self.chain_len, n))

    def path_to(self, node: int) -> list[int]:
        """Draft indices from the root down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def build_tree(
    drafter: Drafter,
    chain: Sequence[int],
    max_nodes: int,
    max_depth: int,
    extra_chains: Sequence[Sequence[int]] = (),
    eos_token_ids: frozenset = frozenset(),
    width: int = TREE_WIDTH,
) -> DraftTree:
    """A tree of at most ``max_nodes`` drafts, at most ``max_depth`` deep: first ``chain`` (the
    drafter's proposal, as a chain run would send it), then ``extra_chains`` (another source's
    proposal: the tail's drafts), then, best first by the product of the drafter's estimated
    probabilities along the path, the alternatives it ranks after every node's prefix."""
    tree = DraftTree()
    children: dict[int, dict[int, int]] = {}
    heap: list[tuple[float, int, int, int, tuple[int, ...]]] = []  # (-score, tiebreak, token, parent, prefix)
    counter = 0
    expanded: set[int] = set()

    def push_children(parent: int, prefix: tuple[int, ...], score: float) -> dict[int, float]:
        """Queue the drafter's ranked continuations of ``prefix`` (below node ``parent``)."""
        nonlocal counter
        options = drafter.ranked(width, prefix)
        expanded.add(parent)
        for token, prob in options:
            counter += 1
            heapq.heappush(heap, (-score * prob, counter, token, parent, prefix))
        return dict(options)

    def insert(path: Sequence[int]) -> None:
        parent, prefix, score = -1, (), 1.0
        for token in path[:max_depth]:
            if len(tree) >= max_nodes:
                return
            known = children.setdefault(parent, {})
            options = push_children(parent, prefix, score) if parent not in expanded else {}
            if token in known:
                node = known[token]
                score = tree.scores[node]
            else:
                score *= options.get(token, UNRANKED_PROB)
                node = known[token] = tree.add(token, parent, score)
            parent, prefix = node, prefix + (token,)
            if token in eos_token_ids:
                return
        if parent >= 0 and parent not in expanded and tree.depths[parent] < max_depth:
            push_children(parent, prefix, score)  # past the chain's end, best first like any branch

    insert(chain)
    tree.chain_len = len(tree)
    for other in extra_chains:
        insert(other)
    while heap and len(tree) < max_nodes:
        neg, _, token, parent, prefix = heapq.heappop(heap)
        known = children.setdefault(parent, {})
        if token in known:
            continue
        node = known[token] = tree.add(token, parent, -neg)
        if tree.depths[node] < max_depth and token not in eos_token_ids:
            push_children(node, prefix + (token,), -neg)
    return tree


class TreeSizer:
    """Per-lap tree size from measured lap times (a Sequoia/SpecExec-style cost model).

    Lap time is modelled as T(n) = fixed + per_position x n for a run of n positions, fitted by
    least squares over the laps measured so far with older laps decaying (``DECAY`` per lap): the
    fixed part is the network (every hop's latency) and each run's overheads, the slope what one
    more position costs the servers. Laps of more than FIT_MAX_POSITIONS positions (a long prompt's
    prefill, batched more efficiently than a tree's handful of positions) stay out of the fit; the
    largest lap seen gives the slope's prior (its seconds per position, fixed part included), which
    the fit is shrunk towards (``PRIOR_WEIGHT``), so noisy lap times on a busy machine cannot fit a
    slope of zero and make nodes look free. Until laps of different sizes have been seen, a tree is
    the chain plus EXPLORE nodes (which spreads the sizes). The drafter's path probabilities are
    calibrated per depth: at depth d, the laps whose accepted path reached d against the sum of the
    scores of the nodes sent at d (retrieval's frequencies say 1.0 wherever one continuation was
    seen, whatever the depth). Of a tree built best first, the prefix of n nodes kept maximizes
    (1 + calibrated expected accepted drafts) / T(committed + n): on a network-bound lap (fixed >>
    per_position) nearly every node pays for itself and the tree grows; on a compute-bound one only
    the likeliest survive. One sizer serves all of a model's generations (it learns across calls).

    With the tail's reports (``StepResult.tail_costs``), as the chain's cost model
    (client/drafting/cost_model.py) does: the fit above is of the lap less the tail's reported part
    (the network's: latency, the hops before the tail), and the tail's part is priced from its reports
    (one LM-head call plus a price per position, :class:`TailFit`), so a slow tail makes nodes dear
    and a slow link makes the fixed part, which nodes share, larger. A walk that accepts a node costs
    the tail a second LM-head call (server/compute.py's LazyLogits: the root's row alone, then the
    rest), priced with the chance that a first-level node is accepted. ``lap_costs=(fixed_s,
    per_position_s)`` (``generate(draft_lap_costs=...)``) prices every lap at those costs instead:
    the size then follows from the verdicts alone.
    """

    DECAY = 0.9
    PRIOR_FIXED = 0.1  # seconds, until two laps of different sizes are measured
    PRIOR_PER_POSITION = 0.002
    MIN_PER_POSITION = 1e-5
    FIT_MAX_POSITIONS = 128  # laps larger than this (prefills) give the prior slope only
    PRIOR_WEIGHT = 50.0  # evidence the prior slope counts as, in squared positions of lap-size spread
    EXPLORE = 4  # nodes beyond the chain while the slope is unmeasured
    PRIOR_CALIBRATION = 0.5  # per depth, until laps say otherwise (worth one lap's evidence)
    MAX_DEPTH = 64

    def __init__(self, lap_costs: Optional[tuple[float, float]] = None) -> None:
        self._line = DecayedLine(self.DECAY)  # the network's part of each lap against its positions
        self._tail = TailFit(self.DECAY)  # the tail's reports of its part
        # per depth (index 1 ..): decayed sums of the scores sent there and of the laps that accepted that deep
        self._predicted = [0.0] * (self.MAX_DEPTH + 1)
        self._reached = [0.0] * (self.MAX_DEPTH + 1)
        self.fixed, self.per_position = self.PRIOR_FIXED, self.PRIOR_PER_POSITION
        self._prior_slope, self._prior_positions = self.PRIOR_PER_POSITION, 0
        self.fitted = False  # laps of different sizes measured
        self.priced = lap_costs is not None  # fixed lap costs (generate(draft_lap_costs=...)): laps are not fitted
        if lap_costs is not None:
            self.fixed, self.per_position = check_lap_costs(lap_costs)
            self.fitted = True

    def observe_lap(self, positions: int, seconds: float, tail: Optional[TailCosts] = None) -> None:
        """A lap of ``positions`` positions and ``seconds`` wall-clock, with the tail's report of its
        own part (None from a tail that sends none): the fit is of the rest, the network's."""
        if self.priced or positions <= 0 or not seconds > 0:
            return
        if tail is not None:  # a prefill's report prices no tree position, so stays out of the tail's fit
            small = positions <= self.FIT_MAX_POSITIONS
            tail_s = self._tail.observe(positions, tail) if small else (tail.blocks_us + sum(tail.head_us)) * 1e-6
            seconds = max(0.0, seconds - tail_s)
        if positions > self._prior_positions:
            self._prior_slope, self._prior_positions = seconds / positions, positions
        if positions > self.FIT_MAX_POSITIONS:
            return
        line = self._line
        line.add(positions, seconds)
        spread = line.spread()
        slope = (line.covariance() + self.PRIOR_WEIGHT * self._prior_slope) / (spread + self.PRIOR_WEIGHT)
        self.per_position = max(self.MIN_PER_POSITION, slope)
        self.fixed = max(0.0, line.mean_y() - self.per_position * line.mean_x())
        self.fitted = self.fitted or line.varied()

    def tail_costs(self) -> tuple[float, float]:
        """``(tail_call_s, tail_per_position_s)`` from the tail's reports; ``(0, 0)`` without any
        (then the wall-clock fit holds the tail's part too) or with fixed lap costs."""
        return (0.0, 0.0) if self.priced else self._tail.costs()

    def observe_acceptance(self, tree: DraftTree, accepted: int) -> None:
        """A verdict on a sent tree (or chain): its accepted path was ``accepted`` nodes deep."""
        d = self.DECAY
        self._predicted = [d * x for x in self._predicted]
        self._reached = [d * x for x in self._reached]
        for depth, score in zip(tree.depths, tree.scores):
            self._predicted[min(depth, self.MAX_DEPTH)] += score
        for depth in range(1, min(accepted, self.MAX_DEPTH) + 1):
            self._reached[depth] += 1.0

    def calibration(self, depth: int) -> float:
        """What one unit of the drafter's score at ``depth`` is worth in accepted drafts."""
        depth = min(depth, self.MAX_DEPTH)
        value = (self._reached[depth] + self.PRIOR_CALIBRATION) / (self._predicted[depth] + 1.0)
        return min(2.0, max(0.01, value))

    def choose(self, tree: DraftTree, committed: int) -> int:
        """How many of the tree's nodes (a prefix) to send after ``committed`` ids."""
        if not self.fitted:
            return min(len(tree), tree.chain_len + self.EXPLORE)
        calibration = [self.calibration(depth) for depth in range(self.MAX_DEPTH + 1)]
        best, best_n, expected = 1.0 / self.lap_time(committed), 0, 1.0
        second_call_s, root_accepts = self.tail_costs()[0], 0.0
        for n, (score, depth) in enumerate(zip(tree.scores, tree.depths), start=1):
            p = min(1.0, calibration[min(depth, self.MAX_DEPTH)] * score)
            expected += p
            if depth == 1:  # a walk past the root reads the rest of the tree in a second LM-head call
                root_accepts = min(1.0, root_accepts + p)
            rate = expected / (self.lap_time(committed + n) + second_call_s * root_accepts)
            if rate > best:
                best, best_n = rate, n
        return best_n

    def lap_time(self, positions: int) -> float:
        """The network's part (fitted) plus the tail's (its blocks and one LM-head call, and a price per
        position)."""
        tail_call, tail_per_position = self.tail_costs()
        blocks = 0.0 if self.priced else self._tail.blocks_fit()[0]
        return max(1e-6, self.fixed + tail_call + blocks + (self.per_position + tail_per_position) * positions)


@dataclass
class PendingPath:
    """A tree run's accepted path that the servers hold in run order until a Step keeps it
    (``Step.tree_path``): base is the position of the tree's first draft."""

    run_id: int
    base: int
    path: list[int]
    attached: bool = False  # sent on a Step already

    def tree_path_for(self, start_pos: int) -> Optional[list[int]]:
        """What a Step starting at ``start_pos`` must name: None if nothing (it drops the tree,
        or keeps only nodes that are the tree's first in run order, a chain the servers accept)."""
        keep = start_pos - self.base
        if keep <= 0:
            return None
        nodes = self.path[:keep]
        return None if nodes == list(range(keep)) else nodes
