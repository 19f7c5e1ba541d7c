"""Single-span replacement in a training step (docs/design.md, "Failover"): the hop before a failed one sends its
kept output to a spare server of the same blocks, and the hops after it answer that resend from what they replied.

A client names spare servers in ``TrainForward.spares``. When a hop's next hop fails (the next hop itself: it
cannot be reached, its stream broke, or it answered a retryable error of its own), the hop picks a spare of
exactly the failed hop's blocks (:func:`replacement`), puts it in the route and sends the same output again;
nothing before it computes again. The spare computes its span; the hop after it received the same row before
(same step, same input bytes), so it answers from :class:`RepliedRows` without computing, and so on to the tail.
Only the replacement computes anew; a spare whose output differs by a bit is simply computed through.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from typing import Optional, Sequence

import msgspec
import torch

from protocol.errors import RETRYABLE_CODES, ProtocolError
from protocol.messages import Hop, TrainForward
from server.train_budget import REPLY_SHARE

logger = logging.getLogger(__name__)

Replied = tuple[list[torch.Tensor], float, int]  # the gradients sent upstream, the loss sum, the target count


def replacement(message: TrainForward, error: ProtocolError) -> Optional[Hop]:
    """A spare for the next hop when ``error`` is that hop's own retryable failure: same blocks, not on the route."""
    following = message.route[message.hop_index + 1]
    if error.peer_id != following.peer_id or error.code not in RETRYABLE_CODES:
        return None
    on_route = {hop.peer_id for hop in message.route}
    spares = (s for s in message.spares if (s.start, s.end) == (following.start, following.end))
    return next((s for s in spares if s.peer_id not in on_route), None)


def with_hop(message: TrainForward, index: int, hop: Hop) -> TrainForward:
    route = list(message.route)
    route[index] = hop
    return msgspec.structs.replace(message, route=route)


def row_digest(message: TrainForward, tensors: Sequence[torch.Tensor]) -> bytes:
    """What makes two deliveries of a row the same: every field but the route (a replacement changed it) and the
    bytes of every tensor."""
    digest = hashlib.sha256(msgspec.msgpack.encode(msgspec.structs.replace(message, route=[], spares=[])))
    for tensor in tensors:
        digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.digest()


class RepliedRows:
    """The replies a hop sent for recent rows, by step id and row digest: at most ``max_bytes`` of gradients
    (1/REPLY_SHARE of --max-train-mib, which the memory plan counts: server/memory.py), each for ``timeout``
    seconds (a step's own timeout: no resend comes later). Past the bound the oldest replies go first, and a
    reply larger than the whole store is not kept: a store that cannot hold a reply costs only a resend's
    compute (the hop computes the resent row through, as a new one), never a step, so it evicts rather than
    refuses, and says so (``evicted``, and a log line naming the bound)."""

    def __init__(self, max_bytes: int, timeout: float):
        self.max_bytes, self.timeout = max_bytes, timeout
        self._replies: collections.OrderedDict[tuple[str, bytes], tuple[Replied, float]] = collections.OrderedDict()
        self.evicted = 0  # replies dropped (or never kept) for room before their timeout

    @property
    def bytes(self) -> int:
        return sum(self._size(replied) for replied, _ in self._replies.values())

    @staticmethod
    def _size(replied: Replied) -> int:
        return sum(t.numel() * t.element_size() for t in replied[0])

    def __len__(self) -> int:
        self._expire()
        return len(self._replies)

    def get(self, step_id: str, digest: bytes) -> Optional[Replied]:
        self._expire()
        found = self._replies.get((step_id, digest))
        return found[0] if found is not None else None

    def put(self, step_id: str, digest: bytes, replied: Replied) -> bool:
        """Keep ``replied`` within the bound (the oldest go first); False when it alone is past the bound."""
        self._expire()
        size = self._size(replied)
        if size > self.max_bytes:
            self.evicted += 1
            logger.info(
                f"Training step {step_id!r}: its reply ({size} bytes) is not kept for resends: the store holds at "
                f"most {self.max_bytes} bytes (1/{REPLY_SHARE} of --max-train-mib); a resend is computed again"
            )
            return False
        self._replies[(step_id, digest)] = (replied, time.monotonic() + self.timeout)
        while self.bytes > self.max_bytes:
            (old, _), _ = self._replies.popitem(last=False)
            self.evicted += 1
            logger.info(
                f"Training step {old!r}: its reply for resends is evicted before its timeout, for room: the store "
                f"holds at most {self.max_bytes} bytes (1/{REPLY_SHARE} of --max-train-mib)"
            )
        return True

    def drop(self, step_id: str) -> None:
        """Forget every reply of ``step_id`` (its client abandoned it: server/train_drops.py)."""
        for key in [k for k in self._replies if k[0] == step_id]:
            del self._replies[key]

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, deadline) in self._replies.items() if deadline < now]:
            del self._replies[key]
