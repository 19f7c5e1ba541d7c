"""The tail's side of constraints (docs/design.md, "Constraints at the tail"): one compiler per
span, made from the checkpoint's tokenizer on the first constrained session, and a session's
:class:`~protocol.constraints.Guide` kept while its sampling parameters name the same constraint.

Why a tokenizer at the tail: a grammar is text, the mask is over token ids, and only the tokenizer
says which ids spell which text. The checkpoint the tail loads its weights from carries it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Optional

from protocol.constraints import ConstraintCompiler, Guide
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Constraint
from server.compile_budget import CompileBudget, Requester

if TYPE_CHECKING:
    from server.weights import Checkpoint

logger = logging.getLogger(__name__)


class TailConstraints:
    """Compiles constraints for a tail span; the tokenizer loads on first use (most sessions carry none)."""

    def __init__(self, source: str, revision: Optional[str], vocab_size: int, budget: Optional[CompileBudget] = None):
        self.source, self.revision, self.vocab_size = source, revision, vocab_size
        self._compiler: Optional[ConstraintCompiler] = None
        self._lock = threading.Lock()
        # compiling a large schema takes CPU seconds: a stranger sending many distinct ones must not
        # starve the server, so fresh compiles are rationed per requester (server/compile_budget.py)
        self.budget = budget or CompileBudget()

    @classmethod
    def of(cls, checkpoint: "Checkpoint", vocab_size: int, budget: CompileBudget) -> "TailConstraints":
        """For a tail loaded from ``checkpoint``, rationing fresh compiles by ``budget`` (the server's flags)."""
        return cls(checkpoint.source, checkpoint.revision, vocab_size, budget)

    def _load(self) -> ConstraintCompiler:
        with self._lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(self.source, revision=self.revision)
                except Exception as e:
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST,
                        f"this tail cannot enforce constraints: no tokenizer at {self.source} ({e!r})",
                    ) from None
                self._compiler = ConstraintCompiler(tokenizer, self.vocab_size)
            return self._compiler

    def guide(self, constraint: Constraint, start: int, requester: Optional[Requester] = None) -> Guide:
        """A fresh Guide for ``constraint`` from position ``start``; ProtocolError naming what does not
        compile (bad_request), or the compile budget ``requester`` has spent (compile_budget)."""
        compiler = self._load()
        if not compiler.is_compiled(constraint):  # a cached constraint costs nothing
            self.budget.spend(requester)
        try:
            return compiler.guide(constraint, start)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None


def session_guide(
    constraints: Optional[TailConstraints],
    current: Optional[Guide],
    constraint: Optional[Constraint],
    start: int,
    requester: Optional[Requester] = None,
) -> Optional[Guide]:
    """The Guide a session's next run verifies with: the current one while the constraint is the same
    (its matcher follows the history by position), a new one when it changed (compiled on
    ``requester``'s budget), None without one."""
    if constraint is None:
        return None
    if current is not None and current.constraint == constraint and current.start == start:
        return current
    if constraints is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "this server cannot enforce constraints (it loaded no tokenizer)")
    return constraints.guide(constraint, start, requester)
