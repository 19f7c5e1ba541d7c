"""A local transformers causal LM as the client's drafter (``generate(..., draft_model=M)``).

Greedy (or ``verification="match"``): M drafts its argmax after the sampling parameters'
processing, and the tail keeps the drafts its own (seed, position) choices equal. With sampling
and ``verification="rejection"`` (the DSSD exchange, protocol/sampling.py): M samples each draft
x ~ q from its processed distribution q (the target's temperature, top-k, top-p, min-p and
repetition penalty applied to M's logits), keeps q for the correction, and the run sends q(x) up.

M keeps one KV cache over the context it has seen; a draft call trims it to the longest prefix
it shares with the new context (the rollback after a rejection costs nothing) and runs only the
new ids. One drafter per stream; the model itself may be shared by several drafters.

Under a constraint (``guided_*``, ``response_format``) M proposes under the same grammar the tail
masks with: its scores pass through the session's mask (a Guide of the client's own, protocol/
constraints.py), so it never drafts an id the tail could not choose, and the tokens the grammar
forces are drafted first without running M (``forced_first``; as GrammarDrafts does for the other
drafters). A forced draft is deterministic, so with ``sample=True`` its q is one-hot at it (q(x) =
1): the rejection rule accepts it with probability p(x), 1 where the mask leaves nothing else, and
a correction there draws from p without x, which keeps the exchange exact in distribution. Only the
ids the mask leaves no choice about are forced here: xgrammar's guess at the tokenization of forced
text (which GrammarDrafts also drafts) is often not the model's own, and M knows the model's better.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional, Sequence

import torch
from transformers import DynamicCache

from client.drafting import Drafter
from protocol.constraints import ConstraintCompiler, Guide
from protocol.messages import SamplingParams
from protocol.sampling import draw_draft, processed_scores, with_output_start

__all__ = ["ModelDrafter", "check_draft_model"]


def check_draft_model(draft_model: Any, vocab_size: int) -> None:
    """Refuse a draft model whose logits do not index the target's vocabulary."""
    config = getattr(draft_model, "config", None)
    if config is None or not callable(draft_model):
        raise TypeError(
            f"draft_model must be a transformers causal LM (a PreTrainedModel), got {type(draft_model).__name__}"
        )
    head = draft_model.get_output_embeddings() if hasattr(draft_model, "get_output_embeddings") else None
    draft_vocab = head.weight.shape[0] if head is not None else getattr(config, "vocab_size", None)
    if draft_vocab != vocab_size:
        raise ValueError(
            f"draft_model has {draft_vocab} output tokens; the target has {vocab_size}: "
            "a draft model must use the target's tokenizer (the same vocabulary)"
        )


class ModelDrafter(Drafter):
    """Drafts with a local causal LM; ``sample=True`` draws drafts from q and records q.

    After each ``draft`` call, ``last_q[i]`` is q of draft i and ``last_dists[i]`` M's whole
    processed distribution at that position (empty unless sampling).
    """

    def __init__(
        self,
        model: Any,
        sampling: SamplingParams,
        num_draft_tokens: int,
        *,
        sample: bool = False,
        compiler: Optional[ConstraintCompiler] = None,
        forced_first: bool = True,
    ):
        if sampling.constraint is not None and compiler is None:
            raise ValueError("a draft model under a constraint needs the client's ConstraintCompiler")
        self.model, self.sampling, self._call_sampling = model.eval(), sampling, sampling
        self.sample = sample and sampling.do_sample
        self._compiler, self.forced_first = compiler, forced_first
        self._guide: Optional[Guide] = None
        self.forced_drafted = 0  # ids drafted from the grammar alone (M did not run for them), over the stream
        self.num_draft_tokens = num_draft_tokens
        self.last_q: list[float] = []
        self.last_dists: list[torch.Tensor] = []
        self._context: list[int] = []
        self._cache: Optional[DynamicCache] = None
        self._cached: list[int] = []  # the ids whose keys and values the cache holds

    @property
    def draft_cap(self) -> int:
        return self.num_draft_tokens

    @property
    def samples(self) -> bool:
        return self.sample

    def reset(self, context: Sequence[int]) -> None:
        """``context`` is the prompt: a constraint and the output penalties start after it (as the tail's do)."""
        self._context = list(context)
        self._cache, self._cached = None, []
        self.sampling = with_output_start(self._call_sampling, len(context))
        constraint = self.sampling.constraint
        self._guide = self._compiler.guide(constraint, len(context)) if constraint is not None else None

    def extend(self, new_tokens: Sequence[int]) -> None:
        self._context += list(new_tokens)

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def finish(self) -> None:
        self._cache, self._cached = None, []

    def draft(self, max_tokens: int, after: Sequence[int] = ()) -> list[int]:
        sequence = self._context + list(after)
        self.last_q, self.last_dists = [], []
        drafts: list[int] = []
        while len(drafts) < max_tokens:
            try:
                forced = self._forced(sequence, max_tokens - len(drafts))
                drafts, sequence = drafts + forced, sequence + forced
                if len(drafts) >= max_tokens:
                    break
                logits = self._next_logits(sequence)  # [V], predicts position len(sequence)
                scores = processed_scores(logits, sequence, self.sampling, self._guide)
            except ValueError:  # ``after`` breaks the constraint (a hedge on an id the tail cannot choose)
                break
            if self.sample:
                probs = torch.softmax(scores, dim=-1)
                token = draw_draft(probs, self.sampling.seed, len(sequence))
                self.last_q.append(float(probs[token]))
                self.last_dists.append(probs)
            else:
                token = int(scores.argmax())
            drafts.append(token)
            sequence = sequence + [token]
        return drafts

    def _forced(self, sequence: list[int], limit: int) -> list[int]:
        """The ids the constraint leaves no choice about after ``sequence`` (up to ``limit``), recorded with a one-hot q
        when sampling: M does not run for them. ValueError when ``sequence`` breaks the constraint."""
        if self._guide is None or not self.forced_first:
            return []
        forced = self._guide.forced(sequence, limit, certain=True)
        if self.sample:
            for token in forced:
                q = torch.zeros(self._guide.vocab_size)
                q[token] = 1.0
                self.last_q.append(1.0)
                self.last_dists.append(q)
        self.forced_drafted += len(forced)
        return forced

    @torch.no_grad()
    def _next_logits(self, sequence: list[int]) -> torch.Tensor:
        """M's logits after ``sequence``, running only the ids its cache lacks."""
        keep = 0
        for a, b in zip(self._cached, sequence[:-1]):  # at least one id must run to get logits
            if a != b:
                break
            keep += 1
        if self._cache is None or keep == 0:
            self._cache, keep = DynamicCache(), 0
        elif keep < len(self._cached):
            self._cache.crop(keep - len(self._cached))  # a negative count: drop that many positions
        new = torch.tensor([sequence[keep:]], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=new, use_cache=True, **{self._cache_argument: self._cache})
        self._cached = list(sequence)  # the cache object grew in place
        return out.logits[0, -1]

    @functools.cached_property
    def _cache_argument(self) -> str:
        """transformers 5 names it ``cache``; earlier versions and remote code ``past_key_values``."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
