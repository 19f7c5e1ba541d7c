"""Decoding modes: one module each, behind one interface (:class:`client.modes.base.Mode`) that
the lap loop calls (client/_generation.py).

- chain (chain.py): synchronous speculation, one chain of drafts per lap, hedged drafts;
- window (window.py): ``async_speculation``: several runs in flight, each guessing the verdicts before it;
- looped (looped.py): ``loop_runs``: the tail starts each next run at the head;
- tree (tree.py): ``draft_tree``: a tree of drafts per lap;
- rejection (rejection.py): ``verification="rejection"``: the DSSD exchange with a client draft model.
The client draft model itself is a drafter (client/draft_model.py), not a mode: chain mode
drafts with it like with any drafter, and rejection mode needs its q.
"""

from __future__ import annotations

from typing import Optional

from client._trees import TreeSizer
from client.drafting import Drafter
from client.modes.base import Mode
from client.modes.chain import ChainMode
from client.modes.looped import LoopedMode
from client.modes.rejection import RejectionMode
from client.modes.tree import TreeMode
from client.modes.view import DecoderView, NextRun, VerdictAction, WorkAhead
from client.modes.window import WindowMode
from protocol.messages import SamplingParams

__all__ = [
    "Mode",
    "ChainMode",
    "WindowMode",
    "LoopedMode",
    "TreeMode",
    "RejectionMode",
    "choose_mode",
    "DecoderView",
    "NextRun",
    "VerdictAction",
    "WorkAhead",
]


def choose_mode(
    view: DecoderView,
    *,
    inflight: int,
    verification: str,
    draft_tree: bool,
    loop_runs: bool,
    front_drafts: Optional[int],
    tree_sizer: TreeSizer,
) -> Mode:
    """The decoder's mode for what was asked, already checked at the edge
    (client._options.GenerationOptions.checked, with ``loop_runs`` decided)."""
    if _rejection_applies(verification, view.sampling, view.drafter, inflight):
        return RejectionMode(view)
    if draft_tree and view.drafter is not None:
        return TreeMode(view, tree_sizer)
    if inflight > 1:
        return WindowMode(view, inflight, front_drafts)
    return LoopedMode(view) if loop_runs else ChainMode(view)


def _rejection_applies(verification: str, sampling: SamplingParams, drafter: Optional[Drafter], inflight: int) -> bool:
    """Whether runs go up with q(x) for the rejection rule: only when sampling (greedy verification
    is token match whatever is asked), with a drafter that reports q, one run in flight."""
    if verification == "match" or not sampling.do_sample:
        return False
    if drafter is None or not drafter.samples:
        raise ValueError("verification='rejection' needs a draft_model (a drafter that samples from its q)")
    if inflight > 1:
        raise ValueError("verification='rejection' runs one run at a time: leave async_speculation off")
    return True
