"""The tail's side of constraints (docs/design.md, "Constraints at the tail"): one compiler per
span, made from the checkpoint's tokenizer on the first constrained session, and a session's
:class:`~protocol.constraints.Guide` kept while its sampling parameters name the same constraint.

Why a tokenizer at the tail: a grammar is text, the mask is over token ids, and only the tokenizer
says which ids spell which text. The checkpoint the tail loads its weights from carries it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Optional

from protocol.constraints import ConstraintCompiler, Guide
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Constraint

logger = logging.getLogger(__name__)

COMPILE_BUDGET = 16  # constraints compiled anew (cache misses) per window; cached ones are free
COMPILE_WINDOW_S = 60.0


class TailConstraints:
    """Compiles constraints for a tail span; the tokenizer loads on first use (most sessions carry none)."""

    def __init__(
        self,
        source: str,
        revision: Optional[str],
        vocab_size: int,
        budget: int = COMPILE_BUDGET,
        window_s: float = COMPILE_WINDOW_S,
        clock=time.monotonic,
    ):
        self.source, self.revision, self.vocab_size = source, revision, vocab_size
        self._compiler: Optional[ConstraintCompiler] = None
        self._lock = threading.Lock()
        # compiling a large schema takes CPU seconds: a stranger sending many distinct ones must not
        # starve the server, so fresh compiles are rationed (sessions reusing a cached one never wait)
        self.budget, self.window_s, self._clock = budget, window_s, clock
        self._fresh: deque[float] = deque()

    def _spend(self, compiler: ConstraintCompiler, constraint: Constraint) -> None:
        """Counts a cache-missing compile; ProtocolError (busy) naming the budget past it."""
        if compiler.is_compiled(constraint):
            return
        with self._lock:
            now = self._clock()
            while self._fresh and now - self._fresh[0] >= self.window_s:
                self._fresh.popleft()
            if len(self._fresh) >= self.budget:
                raise ProtocolError(
                    ErrorCode.BUSY,
                    f"constraint compile budget spent: {self.budget} new constraints per {self.window_s:g} s "
                    "on this tail; reuse a constraint or retry later",
                )
            self._fresh.append(now)

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

    def guide(self, constraint: Constraint, start: int) -> Guide:
        """A fresh Guide for ``constraint`` from position ``start``; ProtocolError (bad_request) naming
        what does not compile."""
        compiler = self._load()
        self._spend(compiler, constraint)
        try:
            return compiler.guide(constraint, start)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None


def session_guide(
    constraints: Optional[TailConstraints], current: Optional[Guide], constraint: Optional[Constraint], start: int
) -> Optional[Guide]:
    """The Guide a session's next run verifies with: the current one while the constraint is the same
    (its matcher follows the history by position), a new one when it changed, None without one."""
    if constraint is None:
        return None
    if current is not None and current.constraint == constraint and current.start == start:
        return current
    if constraints is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "this server cannot enforce constraints (it loaded no tokenizer)")
    return constraints.guide(constraint, start)
