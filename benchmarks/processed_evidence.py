"""What settling a sampled-token dispute under top-k, top-p and a penalty costs the client
(docs/reliability.md, "Sampled tokens under any processing, and rejection decisions").

``python -m benchmarks.processed_evidence [--model PATH] [--runs N]``: reads every logit of two hidden
states from the checkpoint's head (client/_lm_head.py ``products``, 8,192 rows at a time), then bounds
them through top-k 50, top-p 0.9 and a repetition penalty over 100 ids and finds the possible winners of
a seeded draw (client/_processed_evidence.py); prints both times per run (the first one cold).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig

from client._lm_head import LMHeadRows
from client._processed_evidence import logit_bounds, possible_winners, processed_bounds
from protocol.messages import SamplingParams
from protocol.models import ensure_smollm2_checkpoint
from protocol.seeded_draws import draw_noise

PARAMS = SamplingParams(do_sample=True, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local checkpoint folder (default: SmolLM2-135M)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    path = args.model or str(ensure_smollm2_checkpoint())
    config = AutoConfig.from_pretrained(path)
    head = LMHeadRows(path, config)
    h = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(0))
    for run in range(args.runs):
        start = time.perf_counter()
        products = head.products(torch.stack([h, h]))
        read = time.perf_counter()
        if products is None:
            raise SystemExit(f"could not read the LM head of {path}")
        lo, hi = logit_bounds(h, h, products, 1e-4, 1e-5)
        bounds = processed_bounds(lo, hi, list(range(100)), PARAMS)
        winners = possible_winners(bounds, draw_noise(PARAMS.seed, 100, config.vocab_size).double())
        done = time.perf_counter()
        print(
            f"run {run}: head read {read - start:.2f} s, bounds {done - read:.2f} s "
            f"({int(bounds.sure.sum())} surely kept, {int(winners.sum())} possible winner(s))"
        )


if __name__ == "__main__":
    main()
