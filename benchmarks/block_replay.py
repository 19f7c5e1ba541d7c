"""What a dispute's bisection costs the client, and how far an honest 16-bit server's block is from the
client's float32 replay of it (docs/reliability.md, "Bisection over the span's blocks").

``python -m benchmarks.block_replay [--model PATH] [--positions N] [--block K]``: reads one block's tensors
from the checkpoint (client/_block_replay.py) and prints their parameters and float32 bytes, the time of
three replays over N random states (the first cold), and the largest relative difference (client/_bisection.py
``spread``) between transformers' bfloat16 blocks (what an honest bfloat16 server computes) and the client's
float32 replay of each from the same input, over the model's blocks and N positions of random ids: the
figure the bisection's 16-bit tolerance (0.08) must stay above.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from client._bisection import spread
from client._block_replay import BlockReplay
from protocol.models import ensure_smollm2_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local checkpoint folder (default: SmolLM2-135M)")
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--block", type=int, default=15)
    args = parser.parse_args()
    path = str(args.model or ensure_smollm2_checkpoint())
    config = AutoConfig.from_pretrained(path)
    replay = BlockReplay(path, config)
    weights = replay.tensors(f"model.layers.{args.block}.")
    params = sum(w.numel() for w in weights.values())
    print(f"block {args.block}: {params:,} parameters, {params * 4 / 1e6:.1f} MB in float32")
    x = torch.randn(args.positions, config.hidden_size)
    for _ in range(3):
        started = time.perf_counter()
        replay.replay(args.block, x)
        print(f"replay over {args.positions} positions: {time.perf_counter() - started:.3f} s")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.positions), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    worst = max(
        spread(states[k + 1][0].float(), replay.replay(k, states[k][0].float()))
        for k in range(config.num_hidden_layers - 1)  # the last state is after the final norm
    )
    print(f"bfloat16 blocks against the float32 replay: largest relative difference {worst:.4f}")


if __name__ == "__main__":
    main()
