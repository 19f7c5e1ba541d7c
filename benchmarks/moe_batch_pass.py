"""What packing a batch's members costs against running them one after another, on a mixture of
experts whose attention cannot be packed (issue #37): DeepSeek-V3's latent attention.

    python -m benchmarks.moe_batch_pass --sizes 1 4 8 --drafts 0 4

A small random DeepSeek-V3 written to a temporary folder by transformers' ``save_pretrained`` (hub
layout; --hidden 512, --blocks 4 with the first dense, --experts 64 routed of --expert-size 256,
--top-k 6 per token in 8 groups of which 4 are picked, one shared expert, latent attention as
DeepSeek-V3's with smaller ranks), served as one span (head and tail), float32, one torch thread.
For each batch size N: N sessions with --context positions cached each decode one position (or
--drafts + 1 positions), and one pass of all of them is timed two ways, side by side:

- packed: ``LlamaFamilyAdapter.forward_batch`` (attention member by member, norms and every
  block's experts once over all members' positions; server/adapters/llama_batch.py);
- one after another: ``SpanAdapter.forward_batch``, what a DeepSeek-V3 server did before (each
  member through the whole span in turn);

each followed by one call of the LM head over every member's first row (as the scheduler does
either way). Median of --repeats passes; every packed output is checked against its
one-after-another twin (1e-4). Reports ms a pass and passes/s, positions/s.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build(path: Path, args: argparse.Namespace) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.blocks,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=8,
        topk_group=4,
        q_lora_rank=args.hidden // 2,
        kv_lora_rank=args.hidden // 4,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routing far from uniform, as a trained model's
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 4])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--expert-size", type=int, default=256)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--out", default="benchmarks/results/moe_batch_pass.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoConfig

    from server.adapters import SpanAdapter, load_span
    from server.adapters.base import BatchMember
    from server.weights import Checkpoint

    with tempfile.TemporaryDirectory() as folder:
        path = build(Path(folder), args)
        config = AutoConfig.from_pretrained(path)
        span = load_span(config, Checkpoint(str(path)), 0, args.blocks, torch.float32, "cpu")
    assert not span.packs_attention  # latent attention: the path this benchmark is about
    blocks = range(0, args.blocks)
    generator = torch.Generator().manual_seed(0)

    def session(num_new: int):
        cache = span.new_cache()
        ids = torch.randint(0, config.vocab_size, (1, args.context), generator=generator)
        span.forward(span.embed(ids), ids, 0, cache, blocks)
        new = torch.randint(0, config.vocab_size, (1, num_new), generator=generator)
        return cache, new, span.embed(new)

    def timed(forward_batch, sessions) -> tuple[float, list[torch.Tensor]]:
        members = [BatchMember(h, ids, args.context, copy.deepcopy(c)) for c, ids, h in sessions]
        t0 = time.perf_counter()
        outs = forward_batch(members, blocks)
        span.logits(torch.stack([o[:, 0] for o in outs], dim=1))
        return time.perf_counter() - t0, outs

    rows = []
    for drafts in args.drafts:
        for size in args.sizes:
            sessions = [session(drafts + 1) for _ in range(size)]
            packed_s, serial_s = [], []
            for _ in range(args.repeats):
                seconds, serial = timed(lambda m, b: SpanAdapter.forward_batch(span, m, b), sessions)
                serial_s.append(seconds)
                seconds, packed = timed(span.forward_batch, sessions)
                packed_s.append(seconds)
                for a, b in zip(serial, packed):
                    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            row = dict(
                sessions=size,
                positions_each=drafts + 1,
                one_after_another_ms=1000 * statistics.median(serial_s),
                packed_ms=1000 * statistics.median(packed_s),
            )
            row["speedup"] = row["one_after_another_ms"] / row["packed_ms"]
            rows.append(row)
            positions = size * (drafts + 1)
            print(
                f"{size:>2} sessions x {drafts + 1} positions: one after another {row['one_after_another_ms']:7.1f} ms "
                f"({1000 / row['one_after_another_ms']:5.1f} passes/s, "
                f"{1000 * positions / row['one_after_another_ms']:6.1f} positions/s); "
                f"packed {row['packed_ms']:7.1f} ms ({1000 / row['packed_ms']:5.1f} passes/s, "
                f"{1000 * positions / row['packed_ms']:6.1f} positions/s): {row['speedup']:.2f}x",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
