"""What one pass through a span costs by batch size (issue #25): the figures behind "where the CPU
stops batching" and the arithmetic for a GPU, without a swarm or a network.

    python -m benchmarks.batch_pass --blocks 10 --sizes 1 4 16 32 --context 64

SmolLM2-135M, blocks [0, --blocks) with the LM head (a span that is head and tail), float32, one
torch thread. For each batch size N: N sessions, each with --context positions cached, decode one
position each (speculation off) or --drafts + 1 positions each; the time of one batched pass
(``forward_batch``, plus the LM head's first row of each) against N passes of one session.
Median of --repeats passes; every batched output is checked against its one-session twin.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/batch_pass.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoConfig

    from protocol.models import ensure_smollm2_checkpoint
    from server.adapters import load_span
    from server.adapters.base import BatchMember
    from server.weights import Checkpoint

    source = ensure_smollm2_checkpoint()
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = args.blocks  # the span ends at "the last block": it holds the LM head
    span = load_span(config, Checkpoint(source), 0, args.blocks, torch.float32, "cpu")
    blocks = range(0, args.blocks)
    generator = torch.Generator().manual_seed(0)

    def session(num_new: int):
        cache = span.new_cache()
        ids = torch.randint(0, config.vocab_size, (1, args.context), generator=generator)
        span.forward(span.embed(ids), ids, 0, cache, blocks)
        new = torch.randint(0, config.vocab_size, (1, num_new), generator=generator)
        return cache, new, span.embed(new)

    rows = []
    for drafts in args.drafts:
        for size in args.sizes:
            sessions = [session(drafts + 1) for _ in range(size)]
            alone_s, batched_s = [], []
            for _ in range(args.repeats):
                caches = [copy.deepcopy(c) for c, _, _ in sessions]
                t0 = time.perf_counter()
                alone = []
                for cache, ids, hidden in sessions:
                    out = span.forward(hidden, ids, args.context, cache, blocks)
                    span.logits(out[:, :1])
                    alone.append(out)
                alone_s.append(time.perf_counter() - t0)
                for cache, _, _ in sessions:
                    span.trim_cache(cache, args.context)
                members = [BatchMember(h, ids, args.context, c) for c, (_, ids, h) in zip(caches, sessions)]
                t0 = time.perf_counter()
                outs = span.forward_batch(members, blocks)
                span.logits(torch.stack([o[:, 0] for o in outs], dim=1))
                batched_s.append(time.perf_counter() - t0)
                for a, b in zip(alone, outs):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            row = dict(
                sessions=size,
                positions_each=drafts + 1,
                alone_ms=1000 * statistics.median(alone_s),
                batched_ms=1000 * statistics.median(batched_s),
            )
            row["speedup"] = row["alone_ms"] / row["batched_ms"]
            rows.append(row)
            print(
                f"{size:>2} sessions x {drafts + 1} positions: {row['alone_ms']:7.1f} ms one by one, "
                f"{row['batched_ms']:7.1f} ms batched ({row['speedup']:.1f}x)",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(blocks=args.blocks, context=args.context, rows=rows), indent=1))


if __name__ == "__main__":
    main()
