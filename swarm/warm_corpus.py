"""Rebuild a model's warm corpus for the client's suffix store (client/warm_corpus.py).

It runs the whole model locally over the tail drafter's training prompts, so it lives with the
programs (it needs server/'s training helpers and client/'s corpus format, which share nothing).

    python -m swarm.warm_corpus --out client/corpora/smollm2-135m.json   # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from client.warm_corpus import CORPORA, FORMAT
from protocol.models import config_fingerprint

logger = logging.getLogger(__name__)


def build(model_path: str, out: Path, answer_tokens: int = 192) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from server.drafter_train import SELF_PROMPTS, own_answers

    config = AutoConfig.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        sequences = own_answers(model, tokenizer, SELF_PROMPTS, answer_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "format": FORMAT,
                "fingerprint": config_fingerprint(config),
                "model_type": config.model_type,
                "prompts": "server.drafter_train.SELF_PROMPTS",
                "answer_tokens": answer_tokens,
                "sequences": sequences,
            }
        )
    )
    logger.info(f"{out}: {len(sequences)} sequences, {sum(map(len, sequences))} tokens")


def main() -> None:
    from protocol.models import ensure_smollm2_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local checkpoint folder (default: the embedded smollm2-135m)")
    p.add_argument("--out", default=str(CORPORA / "smollm2-135m.json"))
    p.add_argument("--answer-tokens", type=int, default=192)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    build(args.model or str(ensure_smollm2_checkpoint()), Path(args.out), args.answer_tokens)


if __name__ == "__main__":
    main()
