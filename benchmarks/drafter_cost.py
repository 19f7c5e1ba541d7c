"""What the tail's drafter costs per run, on one CPU thread, next to the tail's own work.

    python -m benchmarks.drafter_cost [--drafts 4] [--repeats 30]

Loads the tail span of a 3-server smollm2-135m swarm (blocks 20:30) and the committed head
(server/drafters/), then times, per decode run of one position: the span's blocks plus one
LM-head row (what verification reads on most laps), and the head drafting ``--drafts`` ids after
it. Prints milliseconds (medians) and writes benchmarks/results/drafter_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "drafter_cost.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from protocol.models import ensure_smollm2_checkpoint
    from server.adapters import load_span
    from server.tail_drafter import build_tail_drafter, committed_drafter
    from server.weights import Checkpoint

    source = str(ensure_smollm2_checkpoint())
    config = AutoConfig.from_pretrained(source)
    checkpoint = Checkpoint(source)
    span = load_span(config, checkpoint, 20, 30, torch.float32, "cpu")
    path = committed_drafter(config)
    span.drafter = build_tail_drafter(span, config, checkpoint, path, max_drafts=args.drafts)
    cache, state = span.new_cache(), span.drafter.new_session()
    tokens = list(range(1000, 1064))
    blocks = range(span.start, span.end)
    hidden = span.forward(torch.randn(1, len(tokens), config.hidden_size), None, 0, cache, blocks)
    span.drafter.draft(state, hidden, tokens, 0, len(tokens), 7, args.drafts)
    tail_ms, head_ms = [], []
    for i in range(args.repeats):
        position = len(tokens) + i
        began = time.perf_counter()
        hidden = span.forward(torch.randn(1, 1, config.hidden_size), None, position, cache, blocks)
        next_token = int(span.logits(hidden[:, :1]).argmax())
        middle = time.perf_counter()
        drafts = span.drafter.draft(state, hidden, [next_token], position, 1, next_token, args.drafts)
        end = time.perf_counter()
        tail_ms.append(1000 * (middle - began))
        head_ms.append(1000 * (end - middle))
        assert len(drafts) >= 1
    result = dict(
        head=str(path),
        drafts=args.drafts,
        tail_run_ms=statistics.median(tail_ms),
        drafter_ms=statistics.median(head_ms),
        threads=1,
    )
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
