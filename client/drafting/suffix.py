"""SuffixDrafter: SuffixDecoding (arXiv 2411.04975) over the context and the client's store."""

from __future__ import annotations

import math
from collections.abc import Sequence

from client.drafting.base import _AdaptiveDrafter
from client.drafting.suffix_automaton import _Automaton
from client.drafting.suffix_store import SuffixStore


class SuffixDrafter(_AdaptiveDrafter):
    """SuffixDecoding over the stream's own context and the client's `SuffixStore`.

    Per lap: in each source, take the longest suffix of the context seen before (length p,
    capped at max_depth), then follow the most frequent continuation (`_Automaton.draft`),
    at most min(max_tokens, adaptive cap, ceil(alpha * p)) tokens: a long match earns a long
    draft (SuffixDecoding's MAX_SPEC = alpha * p; alpha = 4, the top of the paper's range,
    since on a WAN a lap costs ~200 ms and a longer draft only a little server compute; the
    adaptive cap trims the waste). The draft with the higher score (expected accepted
    tokens) wins; on a tie the longer match (more specific evidence), then the context's
    own (the freshest).
    A draft ends after an EOS id. `finish()` adds the stream's output to the store; `corpus`
    sequences are added to the store at construction and refreshed on every reset.
    """

    def __init__(
        self,
        num_draft_tokens: int = 16,
        *,
        store: SuffixStore | None = None,
        corpus: Sequence[Sequence[int]] = (),
        eos_token_ids: Sequence[int] = (),
        alpha: float = 4.0,
        max_depth: int = 64,
        min_prob: float = 0.1,
    ) -> None:
        super().__init__(num_draft_tokens)
        self.store = store if store is not None else SuffixStore()
        self.alpha, self.max_depth, self.min_prob = alpha, max_depth, min_prob
        self._eos = frozenset(eos_token_ids)
        self._corpus = [tuple(seq) for seq in corpus if len(seq)]
        self.reset(())

    def reset(self, context: Sequence[int]) -> None:
        self._tokens = list(context)
        self._prompt_len = len(self._tokens)
        self._sam = _Automaton.build(self._tokens, self.max_depth + self.num_draft_tokens)
        for seq in self._corpus:
            self.store.add(seq)
        self._rematch()
        self._restart_ema()

    def extend(self, new_tokens: Sequence[int]) -> None:
        self._sync_store()
        sam, store_sam, depth = self._sam, self.store.automaton, self.max_depth
        state, matched = self._match
        for tok in new_tokens:
            self._tokens.append(tok)
            sam.append(tok)
            state, matched = store_sam.step(state, matched, tok, depth)
        self._match = (state, matched)

    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        if max_tokens <= 0 or not (self._tokens or after):
            return []
        (ctx_state, ctx_len), (store_state, store_len) = self._matches(after)
        draft, score = self._draft_from(self._sam, ctx_state, ctx_len, max_tokens)
        if store_len:
            store_draft, store_score = self._draft_from(self.store.automaton, store_state, store_len, max_tokens)
            if (store_score, store_len) > (score, ctx_len):
                return store_draft
        return draft

    def alternatives(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """The likeliest next tokens in the source `draft` would follow (the longer match)."""
        found = self._longest_match(k, after)
        if found is None:
            return []
        sam, state = found
        return [tok for tok, _ in sam.ranked_next(state, k, self.min_prob)]

    def _longest_match(self, k: int, after: Sequence[int]):
        """(automaton, state) of the longer of the context's and the store's matches, None if none."""
        if k <= 0 or not (self._tokens or after):
            return None
        (ctx_state, ctx_len), (store_state, store_len) = self._matches(after)
        if max(ctx_len, store_len) <= 0:
            return None
        return (self.store.automaton, store_state) if store_len > ctx_len else (self._sam, ctx_state)

    BACKOFF = 0.5  # a continuation seen only after a shorter match: its estimate times this, per step back
    MIN_BACKOFF_LENGTH = 2  # the shortest match backed off to

    def ranked(self, k: int, after: Sequence[int] = ()) -> list[tuple[int, float]]:
        """Up to k likeliest next tokens with an estimate of each one's probability, best first:
        the continuations of the longest match (`alternatives`, at their empirical frequencies),
        then those seen only after shorter matches of the same text (up the suffix links, down to
        MIN_BACKOFF_LENGTH tokens), each at BACKOFF times its frequency there per step back: a
        long match is often followed by one token only, which is where the target most needs
        alternatives to it. What token trees branch on (client/_trees.py)."""
        match = self._longest_match(k, after)
        if match is None:
            return []
        sam, state = match
        found: dict[int, float] = {}
        weight = 1.0
        while state > 0 and len(found) < k:
            if sam.nxt[state]:
                for tok, prob in sam.ranked_next(state, k, self.min_prob):
                    found.setdefault(tok, weight * prob)
                weight *= self.BACKOFF
            state = sam.link[state]
            if sam.length[state] < self.MIN_BACKOFF_LENGTH:
                break
        return sorted(found.items(), key=lambda item: -item[1])[:k]

    def _matches(self, after: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The matchers of context + `after` in the context's automaton and in the store's."""
        self._sync_store()
        if not after:
            return self._sam.earlier_match(self.max_depth), self._match
        sam, store_sam, depth = self._sam, self.store.automaton, self.max_depth
        (ctx_state, ctx_len), (store_state, store_len) = sam.text_suffix(depth), self._match
        for tok in after:
            ctx_state, ctx_len = sam.step(ctx_state, ctx_len, tok, depth)
            store_state, store_len = store_sam.step(store_state, store_len, tok, depth)
        return (ctx_state, ctx_len), (store_state, store_len)

    def finish(self) -> None:
        output = self._tokens[self._prompt_len :]
        if output:
            self.store.add(output)
        self._prompt_len = len(self._tokens)

    def _draft_from(self, sam: _Automaton, state: int, matched: int, limit: int) -> tuple[list[int], float]:
        if matched <= 0:
            return [], 0.0
        length = min(limit, math.ceil(self.alpha * matched))
        return sam.draft(state, length, self.min_prob, self._eos)

    def _sync_store(self) -> None:
        if self._store_version != self.store.version:
            self._rematch()

    def _rematch(self) -> None:
        """Match the context's last max_depth tokens in the store afresh (after it changed)."""
        sam, state, matched = self.store.automaton, 0, 0
        for tok in self._tokens[-self.max_depth :]:
            state, matched = sam.step(state, matched, tok, self.max_depth)
        self._match = (state, matched)
        self._store_version = self.store.version
