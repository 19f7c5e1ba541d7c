"""The tail drafter's training data: the model's own answers to thousands of made-up prompts.

``python -m server.drafter_data --model smollm2-135m --target-tokens 1200000`` (``make train-drafter``
runs it before training)

Why the model's own answers: the drafter is right when it predicts what the target will say, so it
learns from what the target says (EAGLE-3 trains on the target's own outputs), greedy and sampled.
Generation is long CPU work (hours for a million tokens on one thread), so it is resumable: each
batch of prompts becomes one shard written atomically, and ``manifest.json`` lists the shards and
the prompts they answered; a restart skips those prompts and goes on. A lock file keeps two runs out
of one folder. Held-out prompts (:func:`server.drafter_prompts.is_held_out`) are never answered here.

A shard (``shard-00000.pt``, ``torch.save``) holds ``tokens`` (int32, the rows' prompt + answer ids
concatenated), ``prompt_lengths`` and ``answer_lengths`` per row, ``prompt_indices`` (positions in
the seeded prompt bank), and its sampling ``temperature`` (0: greedy).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from server.drafter_device import DATA_BATCH, DEVICES, default_for, pick_device
from server.drafter_prompts import Prompt, is_held_out, prompt_bank

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("server.drafter_data")

DEFAULT_DIR = Path.home() / ".cache" / "specswarm" / "drafter-data"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_clock = time.monotonic  # --max-seconds' clock (a test steps it by hand)
TEMPERATURES = (0.0, 0.7, 0.0, 1.0)  # by shard number: half greedy, half sampled (what verification meets)


@dataclass
class Manifest:
    """What a data folder holds: the settings it was made with and the shards written so far."""

    model: str
    seed: int
    max_new_tokens: int
    shards: list[dict[str, Any]]

    @property
    def tokens(self) -> int:
        return sum(s["answer_tokens"] for s in self.shards)

    def done_texts(self) -> set[str]:
        return {text for s in self.shards for text in s["prompts"]}

    def to_json(self) -> dict[str, Any]:
        return dict(version=MANIFEST_VERSION, model=self.model, seed=self.seed, max_new_tokens=self.max_new_tokens,
                    tokens=self.tokens, shards=self.shards)  # fmt: skip


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest, or None where there is none yet; a clear error where it is not one."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: manifest version {data.get('version')!r}, expected {MANIFEST_VERSION}")
    return Manifest(data["model"], data["seed"], data["max_new_tokens"], data["shards"])


def _atomic_write(path: Path, write) -> None:
    """Write to a temporary file beside ``path``, fsync, rename: a kill leaves the old file or the new."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    _atomic_write(folder / MANIFEST, lambda f: f.write(json.dumps(manifest.to_json(), indent=1).encode()))


def load_shard(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def shard_rows(shard: dict[str, Any]) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) per row of a shard."""
    rows, at = [], 0
    flat = shard["tokens"].tolist()
    for p, a in zip(shard["prompt_lengths"].tolist(), shard["answer_lengths"].tolist()):
        rows.append((flat[at : at + p + a], p))
        at += p + a
    return rows


def chat_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The prompt as the model's chat template frames a user turn, ready for the answer."""
    turn = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def answer_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> list[list[int]]:
    """The model's answers (ids after the prompt, up to and including the end-of-turn id) to
    ``prompts``, one left-padded batch with the KV cache; greedy where ``temperature`` is 0."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sampling: dict[str, Any] = dict(do_sample=False)
    if temperature > 0:
        torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_p=0.95, top_k=0)
    out = model.generate(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling
    )
    stops = {tokenizer.eos_token_id, pad}
    answers = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        answers.append(row[:end])
    return answers


def make_shard(indices: list[int], prompts: list[list[int]], answers: list[list[int]], temperature: float) -> dict:
    flat = [t for p, a in zip(prompts, answers) for t in p + a]
    return dict(
        tokens=torch.tensor(flat, dtype=torch.int32),
        prompt_lengths=torch.tensor([len(p) for p in prompts]),
        answer_lengths=torch.tensor([len(a) for a in answers]),
        prompt_indices=torch.tensor(indices),
        temperature=torch.tensor(temperature),
    )


def pending_prompts(bank: list[Prompt], manifest: Manifest) -> list[tuple[int, Prompt]]:
    """(bank index, prompt) of the training prompts no shard has answered yet, in bank order."""
    done = manifest.done_texts()
    return [(i, p) for i, p in enumerate(bank) if not is_held_out(p.text) and p.text not in done]


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    *,
    model_name: str,
    target_tokens: int,
    batch: int = 16,
    max_new_tokens: int = 256,
    seed: int = 0,
    max_shards: int | None = None,
    max_seconds: float | None = None,
    bank: list[Prompt] | None = None,
    progress: bool = True,
) -> Manifest:
    """Answer pending prompts shard by shard until the folder holds ``target_tokens`` answer tokens
    (or ``max_shards`` new shards, or ``max_seconds`` have passed: the shard under way is finished
    first, so a wall-clock budget never leaves half a shard, or no prompt is left). Resumes from
    ``folder``'s manifest."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    bank = bank if bank is not None else prompt_bank(seed)
    manifest = read_manifest(folder) or Manifest(model_name, seed, max_new_tokens, [])
    if (manifest.model, manifest.seed, manifest.max_new_tokens) != (model_name, seed, max_new_tokens):
        raise ValueError(
            f"{folder} holds data for model={manifest.model} seed={manifest.seed} "
            f"max_new_tokens={manifest.max_new_tokens}; asked for {model_name}, {seed}, {max_new_tokens}: "
            "use another --out"
        )
    pending = pending_prompts(bank, manifest)
    logger.info(f"{folder}: {len(manifest.shards)} shards, {manifest.tokens} tokens; {len(pending)} prompts pending")
    bar = tqdm(total=target_tokens, initial=min(manifest.tokens, target_tokens), unit="tok", disable=not progress)
    written, started = 0, _clock()
    while manifest.tokens < target_tokens and pending and (max_shards is None or written < max_shards):
        if max_seconds is not None and _clock() - started >= max_seconds:
            logger.info(f"stop: --max-seconds {max_seconds:g} spent after {written} new shards")
            break
        number = len(manifest.shards)
        chosen, pending = pending[:batch], pending[batch:]
        ids = [chat_ids(tokenizer, p.text) for _, p in chosen]
        temperature = TEMPERATURES[number % len(TEMPERATURES)]
        began = time.perf_counter()
        answers = answer_batch(model, tokenizer, ids, max_new_tokens, temperature, seed * 100_003 + number)
        seconds = time.perf_counter() - began
        name = f"shard-{number:05d}.pt"
        shard = make_shard([i for i, _ in chosen], ids, answers, temperature)
        _atomic_write(folder / name, lambda f, s=shard: torch.save(s, f))
        tokens = sum(map(len, answers))
        manifest.shards.append(
            dict(
                file=name,
                indices=[i for i, _ in chosen],
                prompts=[p.text for _, p in chosen],
                answer_tokens=tokens,
                temperature=temperature,
                seconds=round(seconds, 1),
            )  # fmt: skip
        )
        write_manifest(folder, manifest)
        written += 1
        bar.update(min(tokens, max(0, target_tokens - bar.n)))
        logger.info(
            f"{name}: {len(chosen)} answers, {tokens} tokens in {seconds:.0f}s ({tokens / seconds:.1f} tokens/s), "
            f"T={temperature}; total {manifest.tokens}/{target_tokens}"
        )
    bar.close()
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m server.drafter_data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="alias or local checkpoint folder")
    p.add_argument("--out", default=None, help=f"data folder (default {DEFAULT_DIR}/<model>)")
    p.add_argument("--target-tokens", type=int, default=1_200_000, help="stop once the answers hold this many tokens")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="prompts per shard, one padded batch (16 on cpu, 192 on cuda)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-shards", type=int, default=None, help="stop after this many new shards")
    p.add_argument("--max-seconds", type=float, default=None, help="start no new shard after this many seconds")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when available (TF32 off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the log file still grows)")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    folder = Path(args.out) if args.out else DEFAULT_DIR / Path(args.model).name
    folder.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(folder / "log.txt")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", handlers=[handler])
    torch.set_num_threads(args.threads)
    lock = open(folder / "lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"{folder} is being written by another run (its lock file is held)", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from protocol.models import resolve_model

    source = resolve_model(args.model).source
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval().to(device)
    logger.info(f"start: {' '.join(sys.argv)} (pid {os.getpid()}, {args.threads} threads, {device})")
    manifest = generate(
        model,
        tokenizer,
        folder,
        model_name=Path(args.model).name,
        target_tokens=args.target_tokens,
        batch=args.batch or default_for(DATA_BATCH, device),
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        max_shards=args.max_shards,
        max_seconds=args.max_seconds,
        progress=not args.no_progress,
    )
    logger.info(f"stop: {len(manifest.shards)} shards, {manifest.tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
