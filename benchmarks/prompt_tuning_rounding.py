"""Is the 20-step prompt-tuning drift float rounding? Local SmolLM2 runs that differ only in arithmetic order.

The swarm computes each row alone (a batch of one per row, docs/design.md "Fine-tuning") while local transformers
computes the batch at once, and the two use other thread counts: so their sums run in other orders. This script
runs the same 20-step prompt-tuning run (same seed, same data, same Adam) locally in several such orders and prints,
per step, how far each run's loss is from the first:
  - batched, torch threads 2 (the reference)
  - batched, torch threads 1
  - row by row (as the swarm computes), torch threads 1
  - batched in float64 (the run without float32 rounding)
If two float32 local runs part as much as the swarm and local do, the drift is rounding amplified by training.

    python -m benchmarks.prompt_tuning_rounding [--steps 20] [--lr 0.01]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from protocol.models import ensure_smollm2_checkpoint

PRE_SEQ_LEN, BATCH, LENGTH = 8, 4, 32


def run(path: str, steps: int, lr: float, threads: int, by_row: bool, dtype: torch.dtype) -> list[float]:
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, LENGTH), generator=generator)
    prompts = (torch.randn(PRE_SEQ_LEN, model.config.hidden_size, generator=generator) * 0.02).to(dtype)
    prompts.requires_grad_(True)
    optimizer = torch.optim.Adam([prompts], lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        rows = [ids[i : i + 1] for i in range(BATCH)] if by_row else [ids]
        total = 0.0
        for chunk in rows:
            embeds = torch.cat([prompts.expand(chunk.shape[0], -1, -1), model.model.embed_tokens(chunk)], dim=1)
            logits = model(inputs_embeds=embeds).logits[:, PRE_SEQ_LEN:-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1), reduction="sum"
            ) / (BATCH * (LENGTH - 1))
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    path = str(ensure_smollm2_checkpoint())
    runs = {
        "batched, 2 threads": run(path, args.steps, args.lr, 2, False, torch.float32),
        "batched, 1 thread": run(path, args.steps, args.lr, 1, False, torch.float32),
        "row by row, 1 thread": run(path, args.steps, args.lr, 1, True, torch.float32),
        "batched, float64": run(path, args.steps, args.lr, 2, False, torch.float64),
    }
    reference = runs["batched, 2 threads"]
    print("step  loss(ref)   " + "  ".join(f"|d| {name}" for name in list(runs)[1:]))
    for step in range(args.steps):
        diffs = "  ".join(
            f"{abs(losses[step] - reference[step]):.2e}".rjust(len(name) + 4) for name, losses in list(runs.items())[1:]
        )
        print(f"{step + 1:4d}  {reference[step]:.6f}  {diffs}")


if __name__ == "__main__":
    main()
