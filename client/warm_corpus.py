"""A warm start for the suffix drafter: the model's own answers to prompts of its kind.

A client's suffix store learns from every answer it sees (client.drafting.SuffixStore), so a
long-running client drafts the model's habits (its chat template, "Here's a Python function
that...", its code idioms) from memory. A fresh client starts cold, and first-turn work is where
retrieval drafts least. So the package ships, per model, the token ids of the model's own greedy
answers to 32 prompts that are neither the benchmarks' nor any test's (the tail drafter's
training prompts, server.drafter_train.SELF_PROMPTS), and a client made with
``from_pretrained(..., warm_draft_store=True)`` puts them in its store first. They are drafts only:
verification decides every token, so the output never changes. Opt-in: on the 2-core CPU machine
they raised tokens per lap a little and tokens/s not at all (docs/benchmarks.md, "A warm draft store").

    python -m swarm.warm_corpus --out client/corpora/smollm2-135m.json   # rebuild (about 2 minutes)

The files are matched to a model by its config's fingerprint (protocol.models.config_fingerprint),
as tail drafters are; a model without one starts cold, as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import PretrainedConfig

from protocol.models import config_fingerprint

logger = logging.getLogger(__name__)

CORPORA = Path(__file__).resolve().parent / "corpora"
FORMAT = "specswarm-warm-corpus-1"


def load_warm_corpus(config: PretrainedConfig) -> list[list[int]]:
    """Token id sequences to put in a new client's suffix store: those of the committed corpus for
    this model ([] when none fits it), ids outside its vocabulary dropped with their sequence."""
    wanted = config_fingerprint(config)
    for candidate in sorted(CORPORA.glob("*.json")):
        try:
            corpus = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if corpus.get("format") == FORMAT and corpus.get("fingerprint") == wanted:
            vocab = config.vocab_size
            return [
                list(seq)
                for seq in corpus["sequences"]
                if seq and all(isinstance(t, int) and 0 <= t < vocab for t in seq)
            ]
    return []
