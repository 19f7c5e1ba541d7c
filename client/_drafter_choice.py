"""Which drafter a generate() stream drafts with: the one place generate() and agenerate_stream() choose it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from client.draft_model import ModelDrafter
from client.drafting import Drafter, SuffixStore, make_drafter
from client.drafting.grammar import with_grammar_drafts

if TYPE_CHECKING:
    from client._calls import Call


def call_drafter(call: Call, store: SuffixStore, tokenizer: Any, vocab_size: int) -> Drafter:
    """The drafter of one generate() stream: a draft model (its own KV cache, the model shared), or the
    chosen speculation over the model's suffix store; under a constraint, the tokens it forces first."""
    options = call.options
    if options.draft_model is not None:
        sample = options.verification == "rejection"
        return ModelDrafter(options.draft_model, call.sampling, options.num_draft_tokens, sample=sample)
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
