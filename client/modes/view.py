"""What a decoding mode may read of the decoder, and the decisions it hands back.

A mode decides (which run to send next, what a verdict means beyond its tokens) and returns its
decision; only the decoder (client/_generation.py, ``SpeculativeDecoder``) changes the decoder's
state: it takes run ids, tracks runs in flight, sends, commits, counts. A mode reads the decoder
through :class:`DecoderView`, a Protocol the decoder satisfies, so the import arrow runs one way:
client/_generation.py imports client/modes/, never the reverse.

The drafter is the one object of the decoder's that a mode calls (drafting is a mode's job); what
the drafter learns from a verdict, the decoder tells it (``VerdictAction.drafter_feedback``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from client._runs import Run, SessionState
from client._trees import PendingPath
from client.drafting import Drafter
from protocol.messages import DraftOffer, SamplingParams


class DecoderView(Protocol):
    """The decoder as a mode sees it: read only."""

    @property
    def state(self) -> SessionState:
        """The session: committed ``history``, ``cached`` positions, the route, ``next_run_id``."""

    @property
    def drafter(self) -> Optional[Drafter]: ...

    @property
    def inflight(self) -> Sequence[Run]:
        """Runs in flight, oldest (the front run) first."""

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def tokens_left(self) -> int:
        """Tokens this generation may still commit, as of this lap."""

    @property
    def verdict_at(self) -> Optional[float]:
        """When the last verdict arrived (perf_counter)."""


@dataclass(frozen=True)
class NextRun:
    """The run to send next. Its ``run_id`` is the session's next, which the decoder takes when it
    sends the run."""

    run: Run
    hedged: bool = False  # its drafts are a hedge made before the last verdict (stats.hedge_hits)


@dataclass(frozen=True)
class WorkAhead:
    """What a mode did while the front run was in flight: hedged drafts made for its likeliest
    verdicts, and (looped runs) the offer of them for the decoder to send the head."""

    hedges: int = 0
    offer: Optional[DraftOffer] = None


@dataclass(frozen=True)
class VerdictAction:
    """What a committed verdict means beyond its tokens, for the decoder to act on."""

    tree_path: Optional[PendingPath] = None  # a tree run's accepted path, held by the servers until a Step keeps it
    drafter_feedback: Optional[tuple[int, int]] = None  # (drafted, accepted) for Drafter.observe
