"""make_drafter: the drafter a ``speculation=`` kind names."""

from __future__ import annotations

from collections.abc import Sequence

from client.drafting.base import Drafter, _AdaptiveDrafter
from client.drafting.ngram import NgramDrafter
from client.drafting.suffix import SuffixDrafter
from client.drafting.suffix_store import SuffixStore
from client.drafting.tail_drafts import TailDrafts

DRAFTER_KINDS = ("suffix", "ngram", "tail", "suffix+tail", "ngram+tail")


def make_drafter(
    kind: str | None = "suffix",
    *,
    num_draft_tokens: int = 16,
    corpus: Sequence[Sequence[int]] = (),
    store: SuffixStore | None = None,
    eos_token_ids: Sequence[int] = (),
    lap_costs: tuple[float, float] | None = None,
) -> Drafter | None:
    """The drafter for `kind` ("suffix", "ngram"), or None for kind None (no speculation).

    `store` is shared across a client's streams (suffix only; a private one when None);
    `corpus` holds token id sequences the user knows are relevant to this stream;
    `lap_costs` (fixed_s, per_position_s) fixes the draft cost model's lap prices (cost_model.ChainCosts).
    """
    drafter = _make_drafter(kind, num_draft_tokens, corpus, store, eos_token_ids)
    if lap_costs is not None and isinstance(drafter, (_AdaptiveDrafter, TailDrafts)):
        drafter.price_laps(lap_costs)
    return drafter


def _make_drafter(
    kind: str | None,
    num_draft_tokens: int,
    corpus: Sequence[Sequence[int]],
    store: SuffixStore | None,
    eos_token_ids: Sequence[int],
) -> Drafter | None:
    if kind is None:
        return None
    if kind == "tail" or kind.endswith("+tail"):  # the tail's drafts, alone or with retrieval
        inner = (
            None
            if kind == "tail"
            else make_drafter(
                kind.removesuffix("+tail"),
                num_draft_tokens=num_draft_tokens,
                corpus=corpus,
                store=store,
                eos_token_ids=eos_token_ids,
            )
        )
        return TailDrafts(inner)
    if kind == "suffix":
        return SuffixDrafter(num_draft_tokens, store=store, corpus=corpus, eos_token_ids=eos_token_ids)
    if kind == "ngram":
        return NgramDrafter(num_draft_tokens, corpus=corpus, eos_token_ids=eos_token_ids)
    raise ValueError(f"unknown drafter kind {kind!r}; expected one of {DRAFTER_KINDS} or None")
