"""A warm start for the suffix drafter: the model's own answers to prompts of its kind.

A client's suffix store learns from every answer it sees (client.drafters.SuffixStore), so a
long-running client drafts the model's habits (its chat template, "Here's a Python function
that...", its code idioms) from memory. A fresh client starts cold, and first-turn work is where
retrieval drafts least. So the package ships, per model, the token ids of the model's own greedy
answers to 32 prompts that are neither the benchmarks' nor any test's (the drafter head's
training prompts, server.drafter_train.SELF_PROMPTS), and a client made with
``from_pretrained(..., warm_draft_store=True)`` puts them in its store first. They are drafts only:
verification decides every token, so the output never changes. Opt-in: on the 2-core CPU machine
they raised tokens per lap a little and tokens/s not at all (docs/benchmarks.md, "A warm draft store").

    python -m client.warm_corpus --out client/corpora/smollm2-135m.json   # rebuild (about 2 minutes)

The files are matched to a model by its config's fingerprint (server.drafter_head.config_fingerprint),
as drafter heads are; a model without one starts cold, as before.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

CORPORA = Path(__file__).resolve().parent / "corpora"
FORMAT = "specswarm-warm-corpus-1"


def load_warm_corpus(config: PretrainedConfig) -> list[list[int]]:
    """Token id sequences to put in a new client's suffix store: those of the committed corpus for
    this model ([] when none fits it), ids outside its vocabulary dropped with their sequence."""
    from server.drafter_head import config_fingerprint

    wanted = config_fingerprint(config)
    for candidate in sorted(CORPORA.glob("*.json")):
        try:
            corpus = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if corpus.get("format") == FORMAT and corpus.get("fingerprint") == wanted:
            vocab = config.vocab_size
            return [list(seq) for seq in corpus["sequences"]
                    if seq and all(isinstance(t, int) and 0 <= t < vocab for t in seq)]  # fmt: skip
    return []


def build(model_path: str, out: Path, answer_tokens: int = 192) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from server.drafter_head import config_fingerprint
    from server.drafter_train import SELF_PROMPTS, own_answers

    config = AutoConfig.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        sequences = own_answers(model, tokenizer, SELF_PROMPTS, answer_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "format": FORMAT, "fingerprint": config_fingerprint(config), "model_type": config.model_type,
        "prompts": "server.drafter_train.SELF_PROMPTS", "answer_tokens": answer_tokens, "sequences": sequences,
    }))  # fmt: skip
    logger.info(f"{out}: {len(sequences)} sequences, {sum(map(len, sequences))} tokens")


def main() -> None:
    from swarm.models import ensure_smollm2_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local checkpoint folder (default: the embedded smollm2-135m)")
    p.add_argument("--out", default=str(CORPORA / "smollm2-135m.json"))
    p.add_argument("--answer-tokens", type=int, default=192)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    build(args.model or str(ensure_smollm2_checkpoint()), Path(args.out), args.answer_tokens)


if __name__ == "__main__":
    main()
