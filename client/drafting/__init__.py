"""Client-side retrieval drafters: guess the next tokens from text already seen, no model.

Over a WAN the lap is the clock, and a lap verifies every drafted id for tens of bytes up,
so a drafter only has to be cheap (well under 1 ms per lap on the client's CPU) and right
often enough. Two drafters share one interface (`Drafter`):

* `SuffixDrafter`, after SuffixDecoding (arXiv 2411.04975): frequency statistics from a
  suffix automaton over the current context and from a per-client `SuffixStore` of earlier
  outputs and user corpus sequences. The default.
* `NgramDrafter`, prompt lookup decoding: copy what followed the most recent earlier
  occurrence of the last n tokens. The baseline.

Both shrink and grow their draft length from the acceptance they observe (`_AdaptiveDrafter`).
None of this is thread-safe: one drafter per stream, one event loop per store.

The package, one job per module: ``base`` (the interface and the adaptive cap), ``suffix_automaton``,
``suffix_store``, ``suffix`` (SuffixDrafter), ``ngram`` (NgramDrafter), ``tail_drafts`` (TailDrafts,
the tail's drafts merged with a retrieval drafter's) and ``factory`` (make_drafter).
"""

from client.drafting.base import Drafter
from client.drafting.factory import DRAFTER_KINDS, make_drafter
from client.drafting.ngram import NgramDrafter
from client.drafting.suffix import SuffixDrafter
from client.drafting.suffix_store import SuffixStore
from client.drafting.tail_drafts import TailDrafts

__all__ = ["DRAFTER_KINDS", "Drafter", "TailDrafts", "NgramDrafter", "SuffixDrafter", "SuffixStore", "make_drafter"]
