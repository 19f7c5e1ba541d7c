"""A client's store of earlier outputs and corpus sequences, shared by its suffix drafters."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from client.drafting.suffix_automaton import SEPARATOR, _Automaton


class SuffixStore:
    """A client's memory of earlier outputs and corpus sequences, for every stream it drafts.

    Bounded at `max_tokens` tokens; whole sequences leave in least-recently-added-or-used
    order (adding a sequence already stored refreshes it instead of storing it twice). All
    sequences sit in one suffix automaton, each followed by SEPARATOR. An automaton cannot
    delete, so eviction rebuilds it; to amortize that, an overflow evicts down to
    `low_water * max_tokens`. `version` changes whenever the automaton does, so drafters
    holding a match into it know to re-match. Counts are exact for patterns of up to
    `horizon` tokens (a drafter's max_depth plus its draft length should fit in it).
    """

    def __init__(self, max_tokens: int = 1 << 16, low_water: float = 0.75, horizon: int = 128) -> None:
        if max_tokens < 1 or not 0.0 < low_water <= 1.0:
            raise ValueError("need max_tokens >= 1 and 0 < low_water <= 1")
        self.max_tokens = max_tokens
        self.low_water = low_water
        self.horizon = horizon
        self.num_tokens = 0
        self.version = 0
        self._seqs: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._sam = _Automaton(horizon)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and tuple(seq) in self._seqs

    @property
    def automaton(self) -> _Automaton:
        return self._sam

    def add(self, seq: Sequence[int]) -> None:
        """Store `seq` (its last max_tokens tokens), evicting the oldest sequences if full."""
        key = tuple(seq[-self.max_tokens :])
        if not key:
            return
        if key in self._seqs:
            self._seqs.move_to_end(key)
            return
        self._seqs[key] = None
        self.num_tokens += len(key)
        self.version += 1
        if self.num_tokens <= self.max_tokens:
            for tok in key:
                self._sam.append(tok)
            self._sam.append(SEPARATOR)
            return
        while self.num_tokens > self.low_water * self.max_tokens and len(self._seqs) > 1:
            self.num_tokens -= len(self._seqs.popitem(last=False)[0])
        self._sam = _Automaton.build((t for s in self._seqs for t in (*s, SEPARATOR)), self.horizon)
