"""Train the EAGLE-style tail drafter of a Llama-family model on this machine's CPU, offline.

``python -m server.drafter_train --model smollm2-135m`` (``make train-drafter`` makes the data first)

Data: the shards of ``python -m server.drafter_data`` (the model's own greedy and sampled answers to
made-up prompts); the target runs over them once per shard (features cached beside the shard,
server/drafter_features.py). The drafter is fitted with EAGLE's loss under a training-time test
(server/drafter_ttt.py): several chained draft steps, steps 2..k on the head's own predictions; the
loop (server/drafter_fit.py) resumes from its checkpoint and stops at ``--train-seconds`` in all. The
drafter proposes only the ``--draft-vocab`` ids the answers use most (FR-Spec), so the LM head rows
it multiplies per draft shrink by that factor. At the end it is measured on held-out chat and code
prompts (server/drafter_eval.py) and written to ``--out``.

``SELF_PROMPTS`` and :func:`own_answers` stay for the warm suffix corpus (swarm/warm_corpus.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from server.drafter_device import DEVICES, FEATURE_BATCH, TRAIN_BATCH, default_for, pick_device
from server.tail_drafter import save_drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("server.drafter_train")

# Prompts for the model's own answers: none of tests/kit/prompts.py's, none of the tests'.
SELF_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "How do I read a CSV file in Python?",
    "Write a Python class for a simple stack with push, pop and peek.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a function that merges two sorted lists into one sorted list.",
    "How do I reverse a dictionary in Python?",
    "Write a Python script that counts the words in a text file.",
    "What is the difference between a tuple and a list in Python?",
    "Write a JavaScript function that removes duplicates from an array.",
    "Explain recursion in simple terms.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "How does a hash table work?",
    "Write a SQL query that finds the five most recent orders.",
    "Write a Python function that flattens a nested list.",
    "What does the `with` statement do in Python?",
    "Describe the water cycle.",
    "What are some healthy breakfast ideas?",
    "How do plants make their food?",
    "Write a short poem about autumn.",
    "Why do we have seasons on Earth?",
    "Give me three tips for writing a good essay.",
    "What is photosynthesis?",
    "How can I stay focused while studying?",
    "Tell me a short story about a brave cat.",
    "What is the capital of France, and what is it famous for?",
    "How do I make a cup of tea?",
    "Explain what a computer network is.",
    "List five fun things to do on a rainy day.",
    "What is the difference between weather and climate?",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "How do I handle exceptions in Python?",
]


@torch.inference_mode()
def own_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int, batch: int = 8
) -> list[list[int]]:
    """Prompt + greedy answer ids for each prompt (batched, left-padded)."""
    tokenizer.padding_side = "left"
    sequences = []
    for i in range(0, len(prompts), batch):
        chats = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts[i : i + batch]
        ]
        enc = tokenizer(chats, return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for row, mask in zip(out, enc["attention_mask"]):
            ids = row[int((mask == 0).sum()) :].tolist()
            while ids and ids[-1] == tokenizer.pad_token_id:
                ids.pop()
            sequences.append(ids)
        logger.info(f"answers: {len(sequences)}/{len(prompts)}")
    return sequences


def main(argv: list[str] | None = None) -> int:
    from server.drafter_data import DEFAULT_DIR
    from server.drafter_fit import Fit, FitConfig, answer_vocab

    p = argparse.ArgumentParser(
        prog="python -m server.drafter_train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="alias or local checkpoint folder")
    p.add_argument("--data", default=None, help=f"data folder of server.drafter_data (default {DEFAULT_DIR}/<model>)")
    p.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "drafters"),
        help="folder for <model>.safetensors (--drafter auto looks there, matching config fingerprints)",
    )
    p.add_argument("--checkpoint", default=None, help="resume file (default <data>/train/checkpoint.pt)")
    p.add_argument("--fresh", action="store_true", help="start over: delete the checkpoint first")
    p.add_argument("--init-from", default=None, help="start from this drafter file (and its draft vocabulary)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--chunk", type=int, default=128, help="positions per training window")
    p.add_argument("--draft-vocab", type=int, default=16384, help="ids the drafter may propose (most frequent first)")
    p.add_argument("--steps", type=int, default=3, help="draft steps of the training-time test")
    p.add_argument("--train-seconds", type=float, default=3600.0, help="seconds of training in all (resumes count)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: planned from the time)")
    p.add_argument("--batch", type=int, default=None, help="windows per step (default 4 on cpu, 64 on cuda)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when available (TF32 off)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eval-prompts", type=int, default=24, help="held-out chat and code prompts each to measure on (0: none)"
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    data = Path(args.data) if args.data else DEFAULT_DIR / Path(args.model).name
    checkpoint = Path(args.checkpoint) if args.checkpoint else data / "train" / "checkpoint.pt"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log_file = logging.FileHandler(checkpoint.parent / "log.txt")  # on the logger: kept when logging is set up
    log_file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(log_file)
    logger.setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from protocol.models import resolve_model
    from server.drafter_eval import held_out_acceptance
    from server.tail_drafter import load_drafter

    source = resolve_model(args.model).source
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval().requires_grad_(False).to(device)
    if args.fresh and checkpoint.exists():
        checkpoint.unlink()
    if read_manifest_or_none(data) is None:
        raise SystemExit(f"{data} holds no data: run python -m server.drafter_data --out {data} first")
    net, draft_vocab = None, None
    if not checkpoint.exists():
        if args.init_from:
            net, draft_vocab = load_drafter(args.init_from, model.config)
            net.requires_grad_(True)
        if draft_vocab is None:
            draft_vocab = answer_vocab(data, args.draft_vocab, model.config.vocab_size)
    config = FitConfig(
        steps=args.steps, batch=args.batch or default_for(TRAIN_BATCH, device), chunk=args.chunk, lr=args.lr,
        seed=args.seed, max_steps=args.max_steps, train_seconds=args.train_seconds,
        feature_batch=default_for(FEATURE_BATCH, device),
    )  # fmt: skip
    fit = Fit(model, data, checkpoint, config, net=net, draft_vocab=draft_vocab)
    logger.info(f"{'resumed at step ' + str(fit.step) if fit.resumed else 'start'}: {vars(args)}")
    fit.run(progress=not args.no_progress)
    logger.info(f"trained {fit.step} steps in {fit.seconds:.0f}s")
    figures = "not measured"
    if args.eval_prompts > 0:
        figures = held_out_acceptance(model, tokenizer, fit.net, fit.draft_vocab, data, args.eval_prompts)
    logger.info(f"held-out acceptance: {figures}")
    out = Path(args.out) / f"{Path(args.model).name}.safetensors"  # --drafter auto matches it by config fingerprint
    save_drafter(
        fit.net,
        out,
        model.config,
        draft_vocab=fit.draft_vocab,
        extra={"model": args.model, "steps": str(fit.step), "held_out": str(figures), "ttt_steps": str(args.steps)},
    )
    logger.info(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    logger.removeHandler(log_file)
    log_file.close()
    return 0


def read_manifest_or_none(data: Path):
    from server.drafter_data import read_manifest

    return read_manifest(data) if data.exists() else None


if __name__ == "__main__":
    sys.exit(main())
