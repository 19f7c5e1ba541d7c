"""What every decoding mode shares: a run in flight, the session it belongs to, and the drafts made
ahead for verdicts not yet received."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import msgspec

from client._remote_session import RemoteSession
from client._trees import DraftTree, PendingPath
from protocol.messages import Step, StepResult


@dataclass
class SessionState:
    """What the client knows about one (possibly long-lived) session.

    ``history`` is every committed token; the servers' caches hold positions ``< cached``.
    A tree run's accepted path is a session matter, not a mode's: the servers hold it in run
    order until a Step keeps it, whatever the next generation on the session decodes with.
    """

    max_length: int
    remote: Optional[RemoteSession] = None
    history: list[int] = field(default_factory=list)
    cached: int = 0
    next_run_id: int = 0
    # a tree run's accepted path, held by the servers in run order until a Step keeps it
    tree_pending: Optional[PendingPath] = None
    adapter: Optional[str] = None  # inference_session(active_adapter=): every call's LoRA adapter (None: the model's)

    def start_from(self, prompt: list[int]) -> None:
        """Keep the servers' cache for the longest common prefix with what they already hold."""
        if len(prompt) + 1 > self.max_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the session's max_length is {self.max_length}")
        common = 0
        for a, b in zip(self.history[: self.cached], prompt):
            if a != b:
                break
            common += 1
        self.cached = min(common, len(prompt) - 1)  # at least one token must be sent to get logits
        self.history = prompt

    def take_run_id(self) -> int:
        run_id, self.next_run_id = self.next_run_id, self.next_run_id + 1
        return run_id

    def with_tree_path(self, step: Step) -> Step:
        """The Step naming the accepted path of the session's previous tree run, when it is the
        first Step sent after that run's verdict and keeps some of its nodes."""
        pending = self.tree_pending
        if pending is None or pending.attached:
            return step
        pending.attached = True
        tree_path = pending.tree_path_for(step.start_pos)
        return msgspec.structs.replace(step, tree_path=tree_path) if tree_path else step

    def verdict_seen(self, run_id: int) -> None:
        """A verdict on a run after a tree run: every server has kept (or dropped) the tree's path."""
        if self.tree_pending is not None and run_id > self.tree_pending.run_id:
            self.tree_pending = None

    def drop_tree_nodes(self) -> None:
        """After a refused run the servers may not have gathered a tree's accepted path: the next
        run starts at the tree (resending what the path committed), which drops its nodes everywhere."""
        if self.tree_pending is not None:
            self.cached = min(self.cached, self.tree_pending.base)
            self.tree_pending = None


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
    looped: bool = False  # started at the head by the tail (a looped run), not sent by the client
    overlapped: bool = False  # sent while an earlier run of the session was in flight (not timed)

    @property
    def split(self) -> bool:
        """A front run cut short: the rest of its proposal follows in the next run."""
        return self.proposed > len(self.drafts)

    @property
    def first_draft_pos(self) -> int:
        return self.start_pos + len(self.token_ids) - len(self.drafts)

    def confirmed_by(self, result: StepResult) -> bool:
        """Whether a verdict holds what the runs behind this one assumed: every draft and the guess."""
        return result.accepted == len(self.drafts) and result.next_token == self.guess


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
