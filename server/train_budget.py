"""What a server's training steps may hold at once, and who holds it (docs/reliability.md, "Limits").

Three bounds, each refused ``busy`` with a message naming it while sessions go on unchanged (and a fourth store,
the replies kept for resends, a quarter of ``--max-train-mib`` beside it, which evicts its oldest instead:
server/train_replay.py):
  - the span inputs kept between a step's forward and its backward (``--max-train-mib``), in all and, for
    one upstream peer that is not a server forwarding steps (server/admission.py ``cap_owner``), at most
    1/PEER_TRAIN_SHARE of them;
  - training rows in flight (computing, queued for the compute thread, or waiting for their backward):
    MAX_TRAIN_STEPS_IN_FLIGHT in all, 1/PEER_TRAIN_SHARE of them for one such peer;
  - the activations of one row's backward recompute through this server's blocks
    (protocol/train_memory.py ``backward_bytes``; a long row's chunk counts the earlier positions its
    attention reads), at most the budget the memory plan counted (``--max-backward-mib``; by default what a
    row of ``--max-positions-per-step`` positions needs, so every row the step limit allows fits). The records
    announce it (``ServerInfo.max_backward_bytes``) and a client sizes each row's chunks to the smallest on its
    route (protocol/train_memory.py ``route_chunk_positions``). A classification row's tail computes no logits,
    so its estimate leaves them out. Rows run one at a time on the span's compute thread, so one row's is the
    peak.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Iterator, Optional

import torch

from protocol.errors import ErrorCode, ProtocolError

PEER_TRAIN_SHARE = 2  # one upstream peer (a client) holds at most 1/2 of the kept inputs and of the rows in flight
# the replies kept for resends (server/train_replay.py RepliedRows) hold at most 1/REPLY_SHARE of --max-train-mib,
# beside the kept inputs; the memory plan counts both (server/memory.py)
REPLY_SHARE = 4
MiB = 1 << 20


class KeptInputs:
    """Span inputs kept between a step's forward and its backward, by step id: at most ``max_bytes`` in
    all and ``max_bytes // PEER_TRAIN_SHARE`` per owner (a step that does not fit is refused ``busy``),
    each for at most ``timeout`` seconds."""

    def __init__(self, max_bytes: int, timeout: float):
        self.max_bytes, self.timeout = max_bytes, timeout
        self._held: dict[str, tuple[tuple[torch.Tensor, ...], float]] = {}
        self._owners: dict[str, Optional[str]] = {}

    @property
    def bytes(self) -> int:
        return sum(self._size(kept) for kept, _ in self._held.values())

    def held_by(self, owner: str) -> int:
        """Bytes kept for steps that ``owner`` sent."""
        return sum(self._size(self._held[s][0]) for s, o in self._owners.items() if o == owner and s in self._held)

    @staticmethod
    def _size(tensors: tuple[torch.Tensor, ...]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def __contains__(self, step_id: str) -> bool:
        self._expire()
        return step_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, step_id: str, tensor: torch.Tensor, *more: torch.Tensor, owner: Optional[str] = None) -> None:
        """Keep ``tensor`` (and ``more``: a deep prompt tuning step's own deep prompts) for ``step_id``, counted
        against ``owner`` (None: a forwarding server, under the server-wide bound only)."""
        self._expire()
        if step_id in self._held:
            raise ProtocolError(ErrorCode.SESSION_EXISTS, f"training step {step_id!r} is already in flight here")
        size = self._size((tensor, *more))
        if self.bytes + size > self.max_bytes:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"no room to keep a training step's input ({size} bytes): {self.bytes} of {self.max_bytes} "
                "bytes are held for other steps (--max-train-mib)",
            )
        share = self.max_bytes // PEER_TRAIN_SHARE
        if owner is not None and self.held_by(owner) + size > share:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"peer {owner} already keeps {self.held_by(owner)} bytes of training inputs here: {size} more "
                f"exceeds its share of {share} of {self.max_bytes} bytes (--max-train-mib)",
            )
        self._held[step_id] = ((tensor, *more), time.monotonic() + self.timeout)
        self._owners[step_id] = owner

    def take(self, step_id: str) -> torch.Tensor:
        """The input kept for ``step_id``, freed here; unknown (expired) steps are a named error."""
        return self.take_all(step_id)[0]

    def take_all(self, step_id: str) -> tuple[torch.Tensor, ...]:
        """Every tensor kept for ``step_id`` (:meth:`keep`'s order), freed here."""
        self._expire()
        if step_id not in self._held:
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"no input of training step {step_id!r} is held here (its backward came after "
                f"{self.timeout:.0f} s, or it never ran)",
            )
        self._owners.pop(step_id, None)
        return self._held.pop(step_id)[0]

    def owner_of(self, step_id: str):
        """Whom the input kept for ``step_id`` counts against (None: a forwarding server); False when none is."""
        return self._owners[step_id] if step_id in self._held else False

    def drop(self, step_id: str) -> None:
        self._held.pop(step_id, None)
        self._owners.pop(step_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for step_id in [s for s, (_, deadline) in self._held.items() if deadline < now]:
            self.drop(step_id)


class RowsInFlight:
    """Training rows in flight here: at most ``limit`` in all and ``limit // PEER_TRAIN_SHARE`` per owner."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self._by_owner: collections.Counter[str] = collections.Counter()

    def held_by(self, owner: str) -> int:
        return self._by_owner[owner]

    @contextlib.contextmanager
    def admitted(self, owner: Optional[str]) -> Iterator[None]:
        """One row counted while the block runs; ``busy`` past either bound."""
        if self.total >= self.limit:
            raise ProtocolError(ErrorCode.BUSY, f"{self.total} training steps are in flight here already")
        share = max(1, self.limit // PEER_TRAIN_SHARE)
        if owner is not None and self._by_owner[owner] >= share:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"peer {owner} already has {self._by_owner[owner]} training steps in flight here (at most {share} "
                f"of {self.limit} per peer)",
            )
        self.total += 1
        if owner is not None:
            self._by_owner[owner] += 1
        try:
            yield
        finally:
            self.total -= 1
            if owner is not None:
                self._by_owner[owner] -= 1
                if not self._by_owner[owner]:
                    del self._by_owner[owner]


def check_backward(
    needed: int, budget: int, positions: int, blocks: int, logits: bool, offset: int = 0, tail: Optional[bool] = None
) -> None:
    """A row (or a long row's chunk after ``offset`` earlier positions) whose backward would need more activation
    memory than the plan counted: ``busy``, naming both. ``logits``: the estimate counts the LM head's; ``tail``
    (default: ``logits``) without them: a classification row's score head at the tail."""
    if needed > budget:
        tail = logits if tail is None else tail
        where = f"{blocks} blocks" + (" and the LM head" if logits else " and the score head" if tail else "")
        after = f" after {offset} earlier positions of its row" if offset else ""
        raise ProtocolError(
            ErrorCode.BUSY,
            f"a backward of {positions} positions{after} through {where} needs {needed / MiB:.1f} MiB of "
            f"activations; this server's backward budget is {budget / MiB:.1f} MiB (--max-backward-mib)",
        )
