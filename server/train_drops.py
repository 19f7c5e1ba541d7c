"""Abandoned training steps, freed at once (docs/design.md, "Long rows in chunks").

A row in chunks keeps its chunk inputs and keys/values on every hop between its laps. When a lap fails, the
client abandons the step (it fails, or runs again on a new route) and the hops the failure did not pass
through (those after the failed one, and every hop of the step's other rows, which the client cancelled)
would hold their rows until the step timeout (120 s) against --max-train-mib. So the client sends one
TrainDrop with the abandoned step ids to the route's head, and each hop:
  - forgets what it holds of each id (a row in chunks, a kept input, the replies it would answer resends
    from), if the row is the sender's: at the head the client's own, past it one a server forwarded here
    (owner None) or one the sender itself sent; a row whose lap is in flight is forgotten when that lap ends;
  - remembers each id for the timeout (at most MAX_DROPPED ids), so a lap still under way toward it starts no
    row again;
  - answers with a TrainDrop of the ids it dropped, then sends the drop on to the next hop of the route, or,
    if that one does not answer, to the one after it (a dead hop is a common reason for a drop).
A step id is 64 random bits known only to its client and its route, and an unknown id is ignored, so a stale
or repeated drop is harmless.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Awaitable, Callable

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import TrainDrop
from protocol.streams import MessageStream
from protocol.train_drops import hand_drop
from server.replies import send_quietly

logger = logging.getLogger(__name__)

MAX_DROPPED = 4096  # step ids remembered as dropped (the oldest forgotten first)


class DroppedSteps:
    """Step ids dropped here recently, each for ``timeout`` seconds, at most MAX_DROPPED of them."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()

    def add(self, step_id: str) -> None:
        self._until.pop(step_id, None)
        self._until[step_id] = time.monotonic() + self.timeout
        while len(self._until) > MAX_DROPPED:
            self._until.popitem(last=False)

    def __contains__(self, step_id: str) -> bool:
        deadline = self._until.get(step_id)
        if deadline is not None and deadline < time.monotonic():
            del self._until[step_id]
            return False
        return deadline is not None


async def serve_drop(
    handler: Any, message: TrainDrop, upstream: MessageStream, linger: Callable[[MessageStream], Awaitable[None]]
) -> None:
    """One TrainDrop (``handler``: server/training.py TrainingHandler): forget, answer (``linger``: until the
    sender has read the answer), pass it on."""
    here = [i for i, hop in enumerate(message.route) if hop.peer_id == handler.peer_id]
    if not here:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"this server ({handler.peer_id}) is not on the drop's route")
    sender = upstream.peer_id.to_base58()
    dropped = [step_id for step_id in dict.fromkeys(message.step_ids) if drop_step(handler, step_id, sender)]
    await send_quietly(upstream, TrainDrop(step_ids=dropped, route=[]), [])
    await linger(upstream)
    for hop in message.route[here[-1] + 1 :]:
        if await hand_drop(handler.p2p, message, hop):
            return


def drop_step(handler: Any, step_id: str, sender: str) -> bool:
    """Forget ``step_id`` here if ``sender`` may (the row's owner, or any sender for a row a server forwarded);
    True if anything was held. Remembered as dropped either way, so a late lap starts nothing."""
    chunks, kept = handler.chunks, handler.kept
    owners = {chunks.owner_of(step_id), kept.owner_of(step_id)} - {False}  # False: not held there
    if any(owner is not None and owner != sender for owner in owners):
        return False
    chunks.dropped.add(step_id)
    chunks.drop(step_id)
    kept.drop(step_id)
    handler.replied.drop(step_id)
    handler.stats["train_dropped"] += bool(owners)
    return bool(owners)
