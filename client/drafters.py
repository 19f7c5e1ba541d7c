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
"""

from __future__ import annotations

import abc
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["DRAFTER_KINDS", "Drafter", "TailDrafts", "NgramDrafter", "SuffixDrafter", "SuffixStore", "make_drafter"]

DRAFTER_KINDS = ("suffix", "ngram", "tail", "suffix+tail", "ngram+tail")
SEPARATOR = -1
"""Ends every sequence in a `SuffixStore`; never a real token id, so no match crosses it."""


class Drafter(abc.ABC):
    """One stream's draft source. The client calls, per stream:
    `reset(prompt)`, then per lap `propose(k)` -> send -> `observe(len(draft), accepted)` ->
    `extend(committed_tokens)`, and `finish()` when the stream ends.

    `after` (in `draft`, `propose`, `alternatives`) is a list of tokens assumed to follow the
    committed context without being committed: asynchronous speculation drafts past runs still
    in flight, and outcome hedging drafts past verdicts not yet received. The drafter's own
    state never holds uncommitted tokens, so a refuted assumption costs nothing to undo.
    """

    @abc.abstractmethod
    def reset(self, context: Sequence[int]) -> None:
        """Start a new stream whose context (prompt) is `context`."""

    @abc.abstractmethod
    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append committed tokens to the context, incrementally (no rebuild)."""

    @abc.abstractmethod
    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `max_tokens` ids that continue context + `after`; [] when there is no guess."""

    def propose(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        """`draft` under the drafter's current adaptive length limit."""
        return self.draft(min(max_tokens, self.draft_cap), after)

    @property
    def draft_cap(self) -> int:
        """The adaptive limit on `propose`; none unless a subclass adapts."""
        return 1 << 30

    def alternatives(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `k` likeliest next tokens after context + `after`, best first (what outcome
        hedging prepares drafts for). Default: none known."""
        return []

    def cap_after(self, drafted: int, accepted: int) -> int:
        """What `draft_cap` will be after `observe(drafted, accepted)`."""
        return self.draft_cap

    def extra_chains(self, max_tokens: int) -> list[list[int]]:
        """Other sources' proposals for this lap, besides `draft`'s (a token tree carries them as
        branches; client/_trees.py). Default: none."""
        return []

    @abc.abstractmethod
    def observe(self, drafted: int, accepted: int) -> None:
        """Feedback after a lap: `accepted` of the `drafted` ids were kept (bonus not counted)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """The stream ended (its tokens may now serve later streams)."""


class _AdaptiveDrafter(Drafter):
    """Adaptive draft length from an exponential moving average of accepted drafts per lap.

    cap = clamp(floor(GROWTH * ema) + 1, 1, num_draft_tokens), ema <- ema + DECAY * (a - ema).
    In steady state the cap is about twice the usual accepted run plus one: room to grow when
    the text turns predictable, without paying server compute for drafts that keep failing.
    The EMA starts optimistic (at num_draft_tokens) on every reset, so a stream begins with
    the full cap. Laps that say nothing about the cap are ignored: one that drafted nothing,
    and one whose draft, shorter than the cap, was accepted whole (the drafter's own
    evidence ended it, not the cap, and nothing was rejected).
    """

    DECAY = 0.5
    GROWTH = 2.0

    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens
        self._ema = float(num_draft_tokens)

    @property
    def draft_cap(self) -> int:
        """The current adaptive limit on the draft length, in [1, num_draft_tokens]."""
        return self._cap(self._ema)

    def observe(self, drafted: int, accepted: int) -> None:
        self._ema = self._ema_after(drafted, accepted)

    def cap_after(self, drafted: int, accepted: int) -> int:
        return self._cap(self._ema_after(drafted, accepted))

    def _ema_after(self, drafted: int, accepted: int) -> float:
        accepted = max(0, min(accepted, drafted))
        if drafted <= 0 or accepted == drafted < self.draft_cap:
            return self._ema
        return self._ema + self.DECAY * (accepted - self._ema)

    def _cap(self, ema: float) -> int:
        return max(1, min(self.num_draft_tokens, int(self.GROWTH * ema) + 1))

    def _restart_ema(self) -> None:
        self._ema = float(self.num_draft_tokens)


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
        ranked = sorted(((self.occ[child] / total, tok) for tok, child in kids.items() if tok != SEPARATOR), reverse=True)
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

    def draft(self, state: int, budget: int, min_prob: float, eos: frozenset[int]) -> tuple[list[int], float]:
        """Follow the most frequent continuation while the cumulative product of its
        empirical probabilities (child count / sum of child counts) stays >= min_prob.
        Returns the draft and its score, the sum of those products: the expected number of
        accepted tokens, as SuffixDecoding scores candidates. At a dead end (the text's own
        end) it backs off to the longest suffix seen elsewhere, so loops keep drafting."""
        nxt, occ, out = self.nxt, self.occ, []
        prob, score = 1.0, 0.0
        while len(out) < budget:
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
        budget = min(limit, math.ceil(self.alpha * matched))
        return sam.draft(state, budget, self.min_prob, self._eos)

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


class NgramDrafter(_AdaptiveDrafter):
    """Prompt lookup decoding: find the most recent earlier occurrence of the context's last
    n tokens (n = max_ngram down to 1) and copy what followed it, up to the draft limit.

    `_index` maps every n-gram whose continuation is known to the position right after its
    latest occurrence; extend() adds max_ngram keys per token, so a lap costs O(max_ngram).
    A copy that runs into the end of the context continues with its own draft (the text is
    read as periodic), which keeps loops drafting. Corpus sequences are searched after the
    context at each n. A draft ends after an EOS id.
    """

    def __init__(
        self,
        num_draft_tokens: int = 16,
        *,
        max_ngram: int = 3,
        corpus: Sequence[Sequence[int]] = (),
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        super().__init__(num_draft_tokens)
        self.max_ngram = max_ngram
        self._eos = frozenset(eos_token_ids)
        self._corpus = [list(seq) for seq in corpus if len(seq)]
        self._corpus_index: dict[tuple[int, ...], tuple[int, int]] = {}
        for ci, seq in enumerate(self._corpus):
            for i in range(1, len(seq)):
                for n in range(1, min(max_ngram, i) + 1):
                    self._corpus_index[tuple(seq[i - n : i])] = (ci, i)
        self.reset(())

    def reset(self, context: Sequence[int]) -> None:
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self._restart_ema()
        self.extend(context)

    def extend(self, new_tokens: Sequence[int]) -> None:
        toks, index, max_ngram = self._tokens, self._index, self.max_ngram
        for tok in new_tokens:
            i = len(toks)  # n-grams ending at i - 1 now have a known continuation at i
            for n in range(1, min(max_ngram, i) + 1):
                index[tuple(toks[i - n : i])] = i
            toks.append(tok)

    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        hit = self._lookup(after)
        if max_tokens <= 0 or hit is None:
            return []
        src, pos, wrap = hit
        return self._copy(src, pos, max_tokens, list(after) if wrap else None)

    def alternatives(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """What followed the latest occurrence of each suffix length n = max_ngram .. 1, in
        that order (longer evidence first), without repeats."""
        if k <= 0:
            return []
        tail = (self._tokens[-self.max_ngram :] + list(after))[-self.max_ngram :]
        out: list[int] = []
        for n in range(len(tail), 0, -1):
            for src, pos in self._hits(tuple(tail[-n:])):
                if pos < len(src) and src[pos] not in out:
                    out.append(src[pos])
        return out[:k]

    def finish(self) -> None:
        """Nothing to keep: the baseline has no cross-request memory."""

    def _lookup(self, after: Sequence[int]) -> tuple[list[int], int, bool] | None:
        """(source, position to copy from, whether it is the context) for the longest n."""
        tail = (self._tokens[-self.max_ngram :] + list(after))[-self.max_ngram :]
        for n in range(len(tail), 0, -1):
            for src, pos in self._hits(tuple(tail[-n:])):
                return src, pos, src is self._tokens
        return None

    def _hits(self, key: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """The context's latest occurrence of `key`, then the corpus's."""
        hits = []
        if (pos := self._index.get(key)) is not None:
            hits.append((self._tokens, pos))
        if (hit := self._corpus_index.get(key)) is not None:
            hits.append((self._corpus[hit[0]], hit[1]))
        return hits

    def _copy(self, src: list[int], pos: int, limit: int, tail: list[int] | None) -> list[int]:
        """Copy src[pos:] up to `limit` ids. With `tail` (the context's own copy) the text goes
        on past its end with `tail` (the assumed tokens) and then this very draft, so a copy
        that runs into the end continues periodically and loops keep drafting."""
        out: list[int] = []
        for j in range(pos, pos + limit):
            if j < len(src):
                tok = src[j]
            elif tail is not None:
                tok = tail[j - len(src)]
            else:
                break
            out.append(tok)
            if tail is not None:
                tail.append(tok)
            if tok in self._eos:
                break
        return out


class TailDrafts(Drafter):
    """The tail's drafter-drafter ids (``StepResult.drafts``) merged with a retrieval drafter's.

    The tail drafts with a drafter over the final hidden states it has just computed
    (server/tail_drafter.py); its ids arrive with a verdict and continue the committed text after
    that verdict's next token. Each lap this drafter proposes one source's drafts, the one whose
    proposals have matched the committed text for more tokens lately (an EMA of the tokens each
    proposal got right, measured on every proposal of both sources, sent or not: the verdicts'
    exact rule accepts a draft iff it equals the target's own token, so the committed text says
    how many a proposal would have had accepted). Where the chosen one proposes nothing, the other.
    `inner` None: tail drafts only.
    """

    SOURCES = ("tail", "retrieval")
    DECAY = 0.3

    def __init__(self, inner: Drafter | None, head_tokens: int = 4) -> None:
        self.inner = inner
        self.head_tokens = head_tokens  # asked of the tail per run (Step.tail_drafts)
        self._context: list[int] = []
        self._head: tuple[int, list[int]] | None = None  # (position of the first id, ids)
        self._pending: list[tuple[int, str, list[int]]] = []  # proposals waiting for committed text
        self._score = {source: 1.0 for source in self.SOURCES}
        self._last_source = "retrieval"
        self.fresh = False  # drafter ids arrived with the last verdict and no draft has used them yet
        # per source: proposals measured, ids proposed, ids that matched the committed text
        self.sources = {source: [0, 0, 0] for source in self.SOURCES}
        self.chosen = {source: 0 for source in self.SOURCES}  # laps whose run carried that source's drafts

    def reset(self, context: Sequence[int]) -> None:
        self._context = list(context)
        self._head, self._pending, self.fresh = None, [], False
        self._score = {source: 1.0 for source in self.SOURCES}
        if self.inner is not None:
            self.inner.reset(context)

    def offer(self, position: int, drafts: Sequence[int]) -> None:
        """Drafter ids continuing the committed text from ``position`` (where the verdict's next token ends)."""
        self._head = (position, list(drafts))
        self.fresh = bool(drafts)

    def extend(self, new_tokens: Sequence[int]) -> None:
        self._context.extend(new_tokens)
        if self.inner is not None:
            self.inner.extend(new_tokens)
        still = []
        for position, source, ids in self._pending:
            seen = self._context[position : position + len(ids)]
            matched = next((i for i, (a, b) in enumerate(zip(ids, seen)) if a != b), len(seen))
            if matched < len(seen) or len(seen) == len(ids):
                stats = self.sources[source]
                stats[0], stats[1], stats[2] = stats[0] + 1, stats[1] + len(ids), stats[2] + matched
                self._score[source] += self.DECAY * (matched - self._score[source])
            else:
                still.append((position, source, ids))
        self._pending = still

    def _tail_after(self, after: Sequence[int]) -> list[int]:
        """The drafter's ids that continue context + ``after``, if the text so far follows them."""
        if self._head is None:
            return []
        position, ids = self._head
        context = self._context + list(after)
        if not position <= len(context) <= position + len(ids) or context[position:] != ids[: len(context) - position]:
            return []
        return ids[len(context) - position :]

    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        tail = self._tail_after(after)[:max_tokens]
        retrieval = self.inner.draft(max_tokens, after) if self.inner is not None else []
        if not after:  # a lap's own proposal: measure both, whichever is sent
            position = len(self._context)
            self._pending += [(position, source, ids) for source, ids in (("tail", tail), ("retrieval", retrieval)) if ids]
            self.fresh = False
        source = "tail" if self._score["tail"] >= self._score["retrieval"] else "retrieval"
        chosen = tail if source == "tail" else retrieval
        if not chosen:
            source, chosen = ("retrieval", retrieval) if source == "tail" else ("tail", tail)
        if not after and chosen:
            self._last_source = source
            self.chosen[source] += 1
        return chosen

    @property
    def draft_cap(self) -> int:
        cap = self.inner.draft_cap if self.inner is not None else 0
        return max(cap, len(self._tail_after(())), 1)

    def alternatives(self, k: int, after: Sequence[int] = ()) -> list[int]:
        return self.inner.alternatives(k, after) if self.inner is not None else []

    def ranked(self, k: int, after: Sequence[int] = ()) -> list[tuple[int, float]]:
        inner = self.inner
        if inner is None:
            return []
        if hasattr(inner, "ranked"):
            return inner.ranked(k, after)
        return [(tok, 1.0 / (rank + 2)) for rank, tok in enumerate(inner.alternatives(k, after))]

    def extra_chains(self, max_tokens: int) -> list[list[int]]:
        """The source the last `draft` did not send: a token tree carries both (no measurement)."""
        if self._last_source == "tail":
            other = self.inner.draft(max_tokens) if self.inner is not None else []
        else:
            other = self._tail_after(())[:max_tokens]
        return [other] if other else []

    def cap_after(self, drafted: int, accepted: int) -> int:
        return self.inner.cap_after(drafted, accepted) if self.inner is not None else self.head_tokens

    def observe(self, drafted: int, accepted: int) -> None:
        if self.inner is not None and self._last_source == "retrieval":
            self.inner.observe(drafted, accepted)

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()


def make_drafter(
    kind: str | None = "suffix",
    *,
    num_draft_tokens: int = 16,
    corpus: Sequence[Sequence[int]] = (),
    store: SuffixStore | None = None,
    eos_token_ids: Sequence[int] = (),
) -> Drafter | None:
    """The drafter for `kind` ("suffix", "ngram"), or None for kind None (no speculation).

    `store` is shared across a client's streams (suffix only; a private one when None);
    `corpus` holds token id sequences the user knows are relevant to this stream.
    """
    if kind is None:
        return None
    if kind == "tail" or kind.endswith("+tail"):  # the tail's drafts, alone or with retrieval
        inner = None if kind == "tail" else make_drafter(kind.removesuffix("+tail"), num_draft_tokens=num_draft_tokens,
                                                         corpus=corpus, store=store, eos_token_ids=eos_token_ids)  # fmt: skip
        return TailDrafts(inner)
    if kind == "suffix":
        return SuffixDrafter(num_draft_tokens, store=store, corpus=corpus, eos_token_ids=eos_token_ids)
    if kind == "ngram":
        return NgramDrafter(num_draft_tokens, corpus=corpus, eos_token_ids=eos_token_ids)
    raise ValueError(f"unknown drafter kind {kind!r}; expected one of {DRAFTER_KINDS} or None")
