"""Quantized weights: bytes per block and tokens/s for ``--quant none|int8|nf4``.

    python -m benchmarks.quant                 # sizes + a 3-server SmolLM2 swarm per mode
    python -m benchmarks.quant --sizes-only    # the size table alone (seconds, no swarm)

Sizes: every block's resident bytes estimated on the meta device from the config (what the
memory plan uses), for SmolLM2-135M, the tiny test DeepSeek-V4 and DeepSeek-V4-Pro's real
shapes; for SmolLM2 and the tiny V4 also measured on a loaded span (storage bytes of every
parameter, buffer and quantization state). Speed: one 3-server local swarm per mode, no added
delay, greedy generation of the WAN benchmark's prompts without speculation and with the default
speculation; tokens/s medians, and how many answers are identical to the unquantized ones.
Results go to stdout as Markdown and to benchmarks/results/quant.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from server.quantization import Quant

GiB, MiB = 1 << 30, 1 << 20
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def deepseek_v4_pro_config():
    """DeepSeek-V4-Pro's shapes, from the published config the package ships
    (protocol/configs/deepseek-v4-pro/config.json: 61 layers + 1 MTP, hidden 7168, 128 heads x 512,
    q_lora_rank 1536, 384 routed experts of 3072 with 6 active and 1 shared, 16 output groups of
    rank 1024, sliding window 128, layers 0-1 HCA then CSA/HCA interleaved, vocabulary 129,280; the
    indexer's shapes are transformers' defaults). The hub's config.json cannot be read from here."""
    from transformers import AutoConfig

    from protocol.models import shipped_config_dir

    return AutoConfig.from_pretrained(shipped_config_dir("deepseek-v4-pro"))


def size_table() -> list[dict]:
    from transformers import AutoConfig

    from protocol.models import ensure_smollm2_checkpoint
    from server.adapters import load_span
    from server.memory import model_bytes
    from server.quantization import resident_bytes
    from server.weights import Checkpoint
    from tests.kit.checkpoints import build_tiny_deepseek_v4

    rows = []
    tiny_v4 = build_tiny_deepseek_v4(Path(tempfile.mkdtemp()) / "tiny-v4")
    models = [
        ("DeepSeek-V4-Pro (bfloat16 compute)", deepseek_v4_pro_config(), torch.bfloat16, None),
        (
            "SmolLM2-135M (float32, CPU)",
            AutoConfig.from_pretrained(ensure_smollm2_checkpoint()),
            torch.float32,
            ensure_smollm2_checkpoint(),
        ),
        ("tiny DeepSeek-V4 (tests, float32)", AutoConfig.from_pretrained(tiny_v4), torch.float32, str(tiny_v4)),
    ]
    for name, config, dtype, path in models:
        for quant in Quant:
            per_block, ends = model_bytes(config, dtype, quant)
            row = dict(model=name, quant=quant.value, estimated_block_bytes=per_block, ends_bytes=ends)
            if path is not None:  # measured on block 1 (an MoE block with hash routing in the tiny V4)
                span = load_span(config, Checkpoint(path), 1, 2, dtype, "cpu", quant)
                hidden = torch.zeros(1, 2, *span.hidden_shape)
                span.forward(hidden, torch.zeros(1, 2, dtype=torch.long), 0, span.new_cache(), range(1, 2))
                row["measured_block_bytes"] = resident_bytes(span.layers)
                row["estimated_block1_bytes"] = _block_estimate(config, dtype, quant, 1)
            rows.append(row)
    return rows


def _block_estimate(config, dtype, quant, index) -> int:
    from transformers import AutoModelForCausalLM

    from server.adapters import adapter_class
    from server.quantization import estimate_module_bytes

    adapter = adapter_class(config)
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(config, dtype=dtype).model.layers[index]
    return estimate_module_bytes(layer, quant, dtype, adapter.dtype_plan(dtype), adapter.stacked_linears)


def speed_table(args) -> list[dict]:
    from swarm import AutoDistributedModelForCausalLM
    from swarm.local import LocalSwarm
    from tests.kit.prompts import CODE_EDITING, OPEN_CHAT

    prompts = [*CODE_EDITING[: args.prompts], *OPEN_CHAT[: args.prompts]]
    rows, answers = [], {}
    for quant in Quant:
        server_args = ["--torch-threads", "1", "--log-level", "WARNING", "--quant", quant.value]
        with LocalSwarm("smollm2-135m", 3, server_args=server_args) as swarm:
            model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
            try:
                tokenizer = model.tokenizer
                model.generate(tokenizer("Hello", return_tensors="pt")["input_ids"], max_new_tokens=4, speculation=None)
                for mode, kwargs in (("none", dict(speculation=None)), ("default", {})):
                    speeds, same, agree, positions, same_as_unspeculated = [], 0, 0, 0, 0
                    for index, prompt in enumerate(prompts):
                        ids = tokenizer.apply_chat_template(
                            [{"role": "user", "content": prompt}],
                            add_generation_prompt=True,
                            return_tensors="pt",
                            return_dict=True,
                        )["input_ids"]
                        began = time.perf_counter()
                        output = model.generate(ids, max_new_tokens=args.max_new_tokens, **kwargs)
                        seconds = time.perf_counter() - began
                        new = output[0, ids.shape[1] :].tolist()
                        speeds.append(len(new) / seconds)
                        answers.setdefault((mode, index), {})[quant.value] = new
                        reference = answers[(mode, index)]["none"]
                        same += new == reference
                        agree += _common_prefix(new, reference)
                        positions += len(reference)
                        same_as_unspeculated += new == answers[("none", index)][quant.value]
                    rows.append(
                        dict(
                            quant=quant.value,
                            speculation=mode,
                            tokens_per_s=statistics.median(speeds),
                            answers_identical_to_none=f"{same}/{len(prompts)}",
                            tokens_before_first_difference=f"{agree}/{positions}",
                            identical_to_no_speculation=f"{same_as_unspeculated}/{len(prompts)}",
                        )
                    )
                    print(rows[-1], flush=True)
            finally:
                model.shutdown()
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-only", action="store_true")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per workload (code editing, open chat)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/quant.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = size_table()
    print("| model | --quant | one block (estimated) | one block, loaded (measured) | embeddings + LM head |")
    print("|---|---|---|---|---|")
    for r in sizes:
        measured = (
            f"{r['measured_block_bytes'] / MiB:.3f} MiB (estimate {r['estimated_block1_bytes'] / MiB:.3f})"
            if "measured_block_bytes" in r
            else "-"
        )
        unit, scale = ("GiB", GiB) if r["estimated_block_bytes"] > GiB else ("MiB", MiB)
        print(
            f"| {r['model']} | {r['quant']} | {r['estimated_block_bytes'] / scale:.3f} {unit} | {measured} | "
            f"{r['ends_bytes'] / scale:.3f} {unit} |"
        )
    speeds = [] if args.sizes_only else speed_table(args)
    if speeds:
        print(
            "\n| --quant | speculation | tokens/s (median) | answers identical to --quant none | tokens "
            "before the first "
            "difference from --quant none | answers identical without speculation |\n|---|---|---|---|---|---|"
        )
        for r in speeds:
            print(
                f"| {r['quant']} | {r['speculation']} | {r['tokens_per_s']:.1f} | {r['answers_identical_to_none']} | "
                f"{r['tokens_before_first_difference']} | {r['identical_to_no_speculation']} |"
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            dict(
                commit=commit + ("+dirty" if dirty else ""), date=time.strftime("%Y-%m-%d"), sizes=sizes, speeds=speeds
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
