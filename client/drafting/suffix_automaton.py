"""The suffix automaton behind SuffixDrafter and SuffixStore: online, with occurrence counts."""

from __future__ import annotations

from collections.abc import Iterable

SEPARATOR = -1
"""Ends every sequence in a `SuffixStore`; never a real token id, so no match crosses it."""


class _Automaton:
    """Suffix automaton over a token sequence, with occurrence counts per state.

    Why an automaton: it is built online in amortized O(1) per token (a suffix tree or a
    depth-bounded trie costs O(depth) per token), and one state's outgoing transitions are
    the continuations of every occurrence of its strings. `occ[v]` = |endpos(v)|, the number
    of occurrences of v's strings. Bulk builds count offline (one pass in length order).
    `append` adds the new end position only to states whose shortest string is at most
    `horizon` tokens (found from `tail`, the state of the text's last `horizon` tokens), so
    it costs O(horizon) even in a long loop, where the suffix-link path is O(n / period).
    Counts of longer patterns go stale; drafting never reads them (see SuffixDrafter).
    """

    __slots__ = ("nxt", "link", "length", "occ", "last", "horizon", "tail", "tail_len")

    def __init__(self, horizon: int) -> None:
        self.nxt: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.occ: list[int] = [0]
        self.last = self.tail = self.tail_len = 0
        self.horizon = horizon

    @classmethod
    def build(cls, tokens: Iterable[int], horizon: int) -> _Automaton:
        sam = cls(horizon)
        for tok in tokens:
            sam._add(tok, 1)
        occ, link, length = sam.occ, sam.link, sam.length
        for v in sorted(range(1, len(occ)), key=length.__getitem__, reverse=True):
            occ[link[v]] += occ[v]
        sam.tail, sam.tail_len = sam.last, min(horizon, length[sam.last])
        sam.tail = sam._climb(sam.tail, sam.tail_len)
        return sam

    def append(self, tok: int) -> None:
        """Extend by one token, keeping `occ` exact within the horizon."""
        self._add(tok, 0)
        state, n = self.tail, self.tail_len  # if _add split it, the clone has the same nxt
        if n == self.horizon:  # the oldest token leaves the window
            n -= 1
            state = self._climb(state, n)
        self.tail, self.tail_len = self.nxt[state][tok], n + 1
        v, occ, link = self.tail, self.occ, self.link
        while v > 0:
            occ[v] += 1
            v = link[v]

    def _climb(self, state: int, n: int) -> int:
        """The state holding the length-n suffix of `state`'s strings."""
        link, length = self.link, self.length
        while state > 0 and length[link[state]] >= n:
            state = link[state]
        return state

    def _add(self, tok: int, own: int) -> int:
        """Standard online construction; `own` = 1 for raw counts (bulk), 0 when tracked."""
        nxt, link, length, occ = self.nxt, self.link, self.length, self.occ
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        occ.append(own)
        p = self.last
        while p != -1 and tok not in nxt[p]:
            nxt[p][tok] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][tok]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone takes the strings of length <= length[p] + 1
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                occ.append(0 if own else occ[q])
                while p != -1 and nxt[p].get(tok) == q:
                    nxt[p][tok] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        return cur

    def earlier_match(self, max_depth: int) -> tuple[int, int]:
        """(state, p): the longest suffix of the text that also occurs earlier, capped at
        max_depth, so counts are those of a pattern of at most max_depth tokens."""
        state = self._climb(self.tail, min(max_depth, self.tail_len))
        if self.occ[state] < 2:  # occurs only at the end: the next shorter class recurs
            state = self.link[state]
        if state <= 0:
            return 0, 0
        return state, min(self.length[state], max_depth)

    def text_suffix(self, max_depth: int) -> tuple[int, int]:
        """(state, n): the text's last n = min(max_depth, available) tokens, end occurrence
        included; a matcher to `step` with tokens assumed to follow the text."""
        n = min(max_depth, self.tail_len)
        return self._climb(self.tail, n), n

    def ranked_next(self, state: int, k: int, min_prob: float) -> list[tuple[int, float]]:
        """Up to k (token, empirical probability) continuations of `state`, likeliest first,
        each at least min_prob; never SEPARATOR."""
        kids = self.nxt[state]
        total = sum(self.occ[child] for child in kids.values())
        if not total:
            return []
        ranked = sorted(
            ((self.occ[child] / total, tok) for tok, child in kids.items() if tok != SEPARATOR), reverse=True
        )
        return [(tok, prob) for prob, tok in ranked[:k] if prob >= min_prob]

    def step(self, state: int, matched: int, tok: int, max_depth: int) -> tuple[int, int]:
        """Advance a matcher of some other text's suffix (matched tokens long) by `tok`."""
        nxt, link, length = self.nxt, self.link, self.length
        while state and tok not in nxt[state]:
            state = link[state]
            matched = length[state]
        if tok not in nxt[state]:
            return 0, 0
        state, matched = nxt[state][tok], matched + 1
        if matched > max_depth:  # keep only the last max_depth tokens: history-independent
            while length[link[state]] >= max_depth:
                state = link[state]
            matched = max_depth
        return state, matched

    def draft(self, state: int, max_tokens: int, min_prob: float, eos: frozenset[int]) -> tuple[list[int], float]:
        """Follow the most frequent continuation while the cumulative product of its
        empirical probabilities (child count / sum of child counts) stays >= min_prob.
        Returns the draft and its score, the sum of those products: the expected number of
        accepted tokens, as SuffixDecoding scores candidates. At a dead end (the text's own
        end) it backs off to the longest suffix seen elsewhere, so loops keep drafting."""
        nxt, occ, out = self.nxt, self.occ, []
        prob, score = 1.0, 0.0
        while len(out) < max_tokens:
            kids = nxt[state]
            if not kids:
                state = self.link[state]
                if state <= 0:
                    break
                continue
            total = best_n = 0
            best_tok = best = 0
            for tok, child in kids.items():
                n = occ[child]
                total += n
                if n >= best_n:
                    best_n, best_tok, best = n, tok, child
            if total == 0:  # only past the horizon, where counts are stale
                break
            prob *= best_n / total
            if best_tok == SEPARATOR or prob < min_prob:
                break
            out.append(best_tok)
            score += prob
            state = best
            if best_tok in eos:
                break
        return out, score
