"""NgramDrafter: prompt lookup decoding, the baseline retrieval drafter."""

from __future__ import annotations

from collections.abc import Sequence

from client.drafting.base import _AdaptiveDrafter


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
