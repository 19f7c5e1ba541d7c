"""Retrieval drafters: what they propose, their store, and their adaptive length."""

from __future__ import annotations

import random

import pytest

from client.drafting import NgramDrafter, SuffixDrafter, SuffixStore, make_drafter
from client.drafting.suffix_automaton import _Automaton

A, B, C, D, E, F, G, H = range(10, 18)
EOS = 2
KINDS = ["suffix", "ngram"]


def drafter(kind: str, context=(), **kwargs):
    d = make_drafter(kind, **kwargs)
    assert d is not None
    d.reset(context)
    return d


def count(text: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(text[i : i + n] == pattern for i in range(len(text) - n + 1))


@pytest.mark.parametrize("horizon", [6, 1000])
@pytest.mark.parametrize("incremental", [False, True])
def test_automaton_counts_every_pattern_within_the_horizon(incremental: bool, horizon: int) -> None:
    rng = random.Random(0)
    text = [rng.randrange(3) for _ in range(60)] + [1] * 30 + [rng.randrange(2) for _ in range(40)]
    sam = _Automaton.build(text[: 20 if incremental else None], horizon)
    for i in range(20, len(text)) if incremental else ():
        sam.append(text[i])
        assert sam.tail_len == min(horizon, i + 1)
        state = 0
        for tok in text[i + 1 - sam.tail_len : i + 1]:
            state = sam.nxt[state][tok]
        assert sam.tail == state  # the window of the last `horizon` tokens, exactly
    for i in range(len(text)):
        for j in range(i + 1, min(i + min(horizon, 12), len(text)) + 1):
            state = 0
            for tok in text[i:j]:
                state = sam.nxt[state][tok]
            assert sam.occ[state] == count(text, text[i:j])


@pytest.mark.parametrize("kind", KINDS)
def test_longest_match_is_continued(kind: str) -> None:
    d = drafter(kind, [A, B, C, D, E, F, G, H, A, B])
    assert d.propose(4) == [C, D, E, F]


def test_suffix_prefers_the_longest_match() -> None:
    # "B" alone was last followed by F, but "A B" was followed by C.
    d = drafter("suffix", [A, B, C, D, E, B, F, G, A, B])
    assert d.propose(2) == [C, D]


@pytest.mark.parametrize("kind", KINDS)
def test_max_tokens_is_respected(kind: str) -> None:
    d = drafter(kind, [A, B, C, D, E, F, G, H, A, B, C])
    assert d.propose(3) == [D, E, F]
    assert d.propose(0) == []


def test_suffix_draft_capped_at_alpha_times_match_length() -> None:
    context = [A, B, C, D, E, F, G, H, 30, 31, A]  # match length p = 1
    d = SuffixDrafter(16, alpha=2.0)
    d.reset(context)
    assert d.propose(16) == [B, C]
    d = SuffixDrafter(16, alpha=3.0)
    d.reset(context)
    assert d.propose(16) == [B, C, D]


def test_suffix_probability_floor_is_on_the_cumulative_product() -> None:
    # After "A": B or C (1/2 each); after either, two equally likely tokens again (1/4).
    context = [A, B, 30, A, B, 31, A, C, 32, A, C, 33, A]
    drafts = {}
    for floor in (0.6, 0.3, 0.2):
        d = SuffixDrafter(16, alpha=4.0, min_prob=floor)
        d.reset(context)
        drafts[floor] = d.propose(8)
    assert drafts[0.6] == []
    assert drafts[0.3] == [C]
    assert drafts[0.2] == [C, 33, A]  # then "A" again: 1/8 < 0.2


@pytest.mark.parametrize("kind", KINDS)
def test_empty_context_proposes_nothing(kind: str) -> None:
    assert drafter(kind).propose(8) == []


@pytest.mark.parametrize("kind", KINDS)
def test_no_repeats_proposes_nothing(kind: str) -> None:
    assert drafter(kind, list(range(100, 200))).propose(8) == []


@pytest.mark.parametrize("kind", KINDS)
def test_eos_ends_a_draft(kind: str) -> None:
    d = drafter(kind, [A, B, C, EOS, D, E, A, B], eos_token_ids=[EOS])
    assert d.propose(8) == [C, EOS]


@pytest.mark.parametrize("kind", KINDS)
def test_loops_keep_drafting_past_the_end(kind: str) -> None:
    d = drafter(kind, [A, B, C, A, B, C, A])
    assert d.propose(7) == [B, C, A, B, C, A, B]


def test_store_bound_and_oldest_evicted() -> None:
    store = SuffixStore(max_tokens=10)
    old, new = [A, B, C, D, E, F], [30, 31, 32, 33, 34, 35]
    store.add(old)
    assert store.num_tokens == 6
    store.add(new)
    assert store.num_tokens <= 10
    assert new in store and old not in store
    d = drafter("suffix", [A, B, C], store=store)
    assert d.propose(8) == []  # the evicted sequence is no longer proposed
    d.reset([30, 31, 32])
    assert d.propose(8) == [33, 34, 35]


def test_store_refresh_is_lru_and_no_duplicates() -> None:
    store = SuffixStore(max_tokens=12, low_water=1.0)
    first, second, third = [A, B, C, D], [30, 31, 32, 33], [40, 41, 42, 43]
    store.add(first)
    store.add(second)
    store.add(first)  # refresh: now the newest, stored once
    assert len(store) == 2 and store.num_tokens == 8
    store.add(third)
    store.add([50, 51])
    assert first in store and second not in store


def test_finished_outputs_feed_later_streams() -> None:
    store = SuffixStore()
    d = drafter("suffix", [1, 2, 3], store=store)
    d.extend([A, B, C, D, E, F])
    d.finish()
    d.reset([7, 8, A, B])
    assert d.propose(4) == [C, D, E, F]


@pytest.mark.parametrize("kind", KINDS)
def test_corpus_sequences_are_proposed(kind: str) -> None:
    d = drafter(kind, [7, 8, A, B], corpus=[[A, B, C, D, E, F]])
    assert d.propose(4) == [C, D, E, F]


def test_store_match_beats_a_weaker_context_match() -> None:
    # The context has seen "B" followed by 30 once; the store has "A B C D E F".
    store = SuffixStore()
    store.add([A, B, C, D, E, F])
    d = drafter("suffix", [B, 30, 31, A, B], store=store)
    assert d.propose(4) == [C, D, E, F]  # equal scores: the longer match wins


def test_context_wins_a_full_tie() -> None:
    store = SuffixStore()
    store.add([A, B, 40, 41, 42, 43, 44, 45, 46, 47])
    d = drafter("suffix", [A, B, 30, 31, 32, 33, A, B], store=store)
    assert d.propose(6) == [30, 31, 32, 33, A, B]


def _stream(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(2, 8))] for _ in range(6)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(50)]
    return out[:length]


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_extend_matches_full_reset(kind: str) -> None:
    text = _stream(1, 300)
    store = SuffixStore()
    store.add(_stream(2, 200))
    kwargs = {"corpus": [_stream(3, 50)]} | ({"store": store} if kind == "suffix" else {})
    inc, full = drafter(kind, text[:40], **kwargs), drafter(kind, **kwargs)
    for i in range(40, len(text), 3):
        inc.extend(text[i : i + 3])
        full.reset(text[: i + 3])
        assert inc.propose(16) == full.propose(16), i
        if i == 151 and kind == "suffix":
            store.add(_stream(4, 100))  # the store changes mid-stream
            assert len(store) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_adaptive_length_shrinks_and_grows(kind: str) -> None:
    d = drafter(kind, num_draft_tokens=16)
    assert d.draft_cap == 16
    caps = []
    for _ in range(6):
        d.observe(d.draft_cap, 0)
        caps.append(d.draft_cap)
    assert caps == sorted(caps, reverse=True) and caps[-1] == 1 and caps[3] == 3
    d.observe(0, 0)  # nothing drafted: no evidence, no change
    assert d.draft_cap == 1
    for _ in range(6):
        d.observe(d.draft_cap, d.draft_cap)
    assert d.draft_cap == 16
    d.reset([])
    assert d.draft_cap == 16
    for _ in range(4):
        d.observe(16, 0)
    assert d.draft_cap == 3
    d.observe(2, 2)  # a short draft accepted whole: the cap did not bind, no change
    assert d.draft_cap == 3


def test_adaptive_cap_limits_the_draft() -> None:
    d = drafter("ngram", [A, B, C, D, E, F, G, H, A, B])
    for _ in range(6):
        d.observe(4, 0)
    assert len(d.propose(16)) == d.draft_cap < 4


@pytest.mark.parametrize("kind", KINDS)
def test_draft_after_assumed_tokens_leaves_the_drafter_unchanged(kind: str) -> None:
    d = drafter(kind, [A, B, C, D, E, F, G, H, G])
    before = d.draft(4)
    assert d.draft(4, after=[A, B]) == [C, D, E, F]  # as if [A, B] were committed
    assert d.draft(4, after=[E]) == [F, G, H, G]
    assert d.draft(4) == before  # nothing of the assumption stayed behind
    d.extend([A, B])
    assert d.draft(4) == [C, D, E, F]


@pytest.mark.parametrize("kind", KINDS)
def test_cap_after_predicts_the_cap_an_observation_leaves(kind: str) -> None:
    """Outcome hedging drafts under the cap the verdict it hedges will leave."""
    rng = random.Random(7)
    d = drafter(kind, num_draft_tokens=12)
    for _ in range(200):
        drafted = rng.randrange(0, 13)
        accepted = rng.randrange(0, drafted + 1)
        predicted = d.cap_after(drafted, accepted)
        d.observe(drafted, accepted)
        assert d.draft_cap == predicted


@pytest.mark.parametrize("kind", KINDS)
def test_alternatives_are_the_likeliest_next_tokens(kind: str) -> None:
    d = drafter(kind, [A, B, H, A, C, H, A, B, H, A, D, H, E])
    alts = d.alternatives(3, after=[A])
    if kind == "suffix":  # by frequency: B follows A twice, C and D once each
        assert alts[0] == B and set(alts) == {B, C, D}
    else:  # by recency: the latest occurrence of A was followed by D (one n-gram, one position)
        assert alts == [D]
    after_ha = d.alternatives(3, after=[H, A])  # "H A" was followed by C, B, D once each
    assert (set(after_ha) == {B, C, D}) if kind == "suffix" else (after_ha == [D])
    assert d.alternatives(0, after=[A]) == []
    assert drafter(kind).alternatives(3) == []


def test_make_drafter_kinds() -> None:
    assert make_drafter(None) is None
    assert isinstance(make_drafter("suffix"), SuffixDrafter)
    assert isinstance(make_drafter(), SuffixDrafter)
    assert isinstance(make_drafter("ngram"), NgramDrafter)
    with pytest.raises(ValueError, match="suffix.*ngram"):
        make_drafter("eagle")
