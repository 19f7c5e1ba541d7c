"""Tree mode (``draft_tree=True``): each run carries a tree of drafts instead of a chain.

The drafter's chain plus its ranked alternatives as branches (client/_trees.py), as many nodes as
a cost model of the measured lap times finds worth their compute. Every server computes the tree
in one pass; the tail walks it with the exact rule and names the accepted path in its verdict;
the next Step names that path again (``Step.tree_path``, SessionState.with_tree_path) so that
every server keeps only it. One run in flight (a run sent behind a tree would have to guess its
path); verified by token match.
"""

from __future__ import annotations

from typing import Any, Optional

from client._runs import Run
from client._trees import DraftTree, PendingPath, TreeSizer, build_tree
from client.errors import ServerError
from client.modes.base import Mode
from client.modes.view import DecoderView, NextRun, VerdictAction
from protocol import trees as tree_rules
from protocol.limits import MAX_TREE_NODES
from protocol.messages import StepResult


class TreeMode(Mode):
    def __init__(self, view: DecoderView, sizer: TreeSizer) -> None:
        super().__init__(view)
        self.sizer = sizer  # the model's: it learns across calls

    def next_run(self, tokens_left: int) -> Optional[NextRun]:
        """A run carrying a tree of drafts: as many nodes as the cost model finds worth their
        compute. A tree that came out a chain goes as one (a plain Step)."""
        v, state = self.view, self.view.state
        committed = state.history[state.cached :]
        room = min(self.room(tokens_left, 0), state.remote.max_positions_per_step - len(committed))
        tree = DraftTree()
        if v.drafter is not None and room > 0:
            chain = v.drafter.draft(min(room, v.drafter.draft_cap))
            max_nodes = min(
                MAX_TREE_NODES,
                state.remote.max_positions_per_step - len(committed),
                state.max_length - len(state.history) - 1,
            )
            full = build_tree(v.drafter, chain, max_nodes, room, v.drafter.extra_chains(room), v.eos_token_ids)
            tree = full.prefix(self.sizer.choose(full, len(committed)))
        run = Run(
            state.next_run_id,
            state.cached,
            committed + tree.ids,
            tree.ids,
            None,
            0,
            tree.chain_len,
            tree=True,
            shape=tree,
        )
        if not tree_rules.is_chain(tree.parents):
            run.parents = tree.parents
        return NextRun(run)

    def step_fields(self, run: Run) -> dict[str, Any]:
        return {"parents": list(run.parents)} if run.parents else {}

    def check_verdict(self, run: Run, result: StepResult) -> Run:
        """The lap's time and the tree's acceptance feed the cost model that sizes the next tree."""
        self.sizer.observe_lap(len(run.token_ids), self.view.verdict_at - run.sent_at, result.tail_costs)
        if run.drafts and run.shape is not None:
            self.sizer.observe_acceptance(run.shape, result.accepted)
        return run

    def accepted_drafts(self, run: Run, result: StepResult) -> list[int]:
        """A tree's verdict names its accepted path, which must be one."""
        if not run.parents:
            return super().accepted_drafts(run, result)
        try:
            if len(result.path) != result.accepted:
                raise ValueError(f"a path of {len(result.path)} nodes for {result.accepted} accepted drafts")
            tree_rules.check_path(result.path, run.parents)
        except ValueError as e:
            raise ServerError(f"a malformed verdict on a tree run: {e}", self.view.state.remote.tail_peer) from None
        return tree_rules.path_ids(result.path, run.drafts)

    def on_commit(self, run: Run, result: StepResult, base: int) -> VerdictAction:
        """The servers hold a tree in run order until the next Step keeps the accepted path."""
        path = PendingPath(run.run_id, base, list(result.path)) if run.parents else None
        return VerdictAction(path, self.drafter_feedback(run, result))

    def drafter_feedback(self, run: Run, result: StepResult) -> Optional[tuple[int, int]]:
        """The chain's length (its cap adapts as a chain's would) or the accepted path's."""
        if not run.tree:
            return super().drafter_feedback(run, result)
        return max(run.proposed, result.accepted), run.prefix_drafts + result.accepted
