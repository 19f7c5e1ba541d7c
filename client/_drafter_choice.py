"""Which drafter a generate() stream drafts with: the one place generate() and agenerate_stream() choose it."""

from __future__ import annotations

from typing import Any

from client._calls import Call, compiler_for
from client.draft_model import ModelDrafter
from client.drafting import Drafter, SuffixStore, make_drafter
from client.drafting.grammar import with_grammar_drafts


def call_drafter(call: Call, store: SuffixStore, tokenizer: Any, vocab_size: int) -> Drafter:
    """The drafter of one generate() stream: a draft model (its own KV cache, the model shared), or the
    chosen speculation over the model's suffix store; under a constraint, the tokens it forces first (a
    draft model also proposes under the constraint's mask)."""
    options = call.options
    if options.draft_model is not None:
        sample = options.verification == "rejection"
        compiler = compiler_for(tokenizer, vocab_size) if call.sampling.constraint is not None else None
        return ModelDrafter(
            options.draft_model,
            call.sampling,
            options.num_draft_tokens,
            sample=sample,
            compiler=compiler,
            forced_first=options.grammar_drafts,
        )
    drafter = make_drafter(
        options.speculation,
        num_draft_tokens=options.num_draft_tokens,
        corpus=call.corpus,
        store=store,
        eos_token_ids=call.eos,
        lap_costs=options.draft_lap_costs,
    )
    if options.grammar_drafts:
        drafter = with_grammar_drafts(drafter, call.sampling.constraint, tokenizer, vocab_size)
    return drafter
