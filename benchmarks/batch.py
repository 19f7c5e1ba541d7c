"""What a padded batch costs: 4 prompts of different lengths generated one at a time and as one
left-padded batch of 4 (each row its own session, all concurrent), in a local 3-server swarm of
SmolLM2-135M.

    python -m benchmarks.batch --delays 0 25

Greedy, no speculation (one token per lap, so every row takes the same laps) and no EOS (every row
generates exactly ``--tokens`` tokens). Checks that each batch row equals its prompt alone, then
reports the median time of one row (the 4 prompts' singles), of the batch, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarm.local import LocalSwarm
from tests.kit.prompts import OPEN_CHAT

SERVER_ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]


def run(delay: float, tokens: int, repeats: int) -> dict:
    from swarm import AutoDistributedModel

    with LocalSwarm("smollm2-135m", 3, hop_delay_ms=delay, server_args=SERVER_ARGS) as swarm:
        model = AutoDistributedModel.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
        tokenizer = model.tokenizer
        tokenizer.padding_side = "left"
        chats = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in OPEN_CHAT[:4]
        ]
        batch = tokenizer(chats, return_tensors="pt", padding=True)
        rows = [tokenizer(c, return_tensors="pt")["input_ids"] for c in chats]
        kwargs = dict(max_new_tokens=tokens, speculation=None, eos_token_id=[])
        model.generate(rows[0], max_new_tokens=4, speculation=None)  # connections warm
        single, batched = [], []
        for _ in range(repeats):
            alone = []
            for ids in rows:
                began = time.perf_counter()
                alone.append(model.generate(ids, **kwargs)[0, ids.shape[1] :])
                single.append(time.perf_counter() - began)
            began = time.perf_counter()
            out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
            batched.append(time.perf_counter() - began)
            width = batch["input_ids"].shape[1]
            same = all(torch.equal(out[i, width:], alone[i]) for i in range(4))
            assert same, "a batch row differs from its prompt alone"
        model.shutdown()
    one, four = statistics.median(single), statistics.median(batched)
    lengths = batch["attention_mask"].sum(1).tolist()
    return dict(delay_ms=delay, one_s=one, four_s=four, ratio=four / one, lengths=lengths, tokens=tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=float, nargs="+", default=[0, 25])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    results = [run(d, args.tokens, args.repeats) for d in args.delays]
    print(f"prompt lengths {results[0]['lengths']} tokens, {args.tokens} new tokens per row, median of {args.repeats}")
    print("| delay/hop | 1 row | 4 rows (one batch) | 4 rows / 1 row |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['delay_ms']:.0f} ms | {r['one_s']:.2f} s | {r['four_s']:.2f} s | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
