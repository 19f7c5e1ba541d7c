"""Train the EAGLE-style tail drafter of a Llama-family model on this machine's CPU, offline.

``python -m server.drafter_train --model smollm2-135m --out server/drafters/`` (``make train-drafter``)

Data, all available offline: the model's own greedy answers to chat prompts written here (neither
the benchmarks' nor any test's), and Python standard library sources and docs under
``sys.prefix/lib/python3.11``. The target runs over them once; the final hidden states (after the
final norm) and the target's own next-token choices are kept, and the drafter is fitted to them with
EAGLE's loss: a smooth-L1 regression of the next feature plus the cross-entropy of the LM head's
logits over the predicted feature against the target's own choice (what greedy verification
accepts). The drafter proposes only the ``--draft-vocab`` ids the target chose most often over the data
(FR-Spec): the LM head rows it multiplies per draft shrink by that factor.

Sized to finish within an hour on 2 CPU cores (``nice -n 15``, one torch thread by default).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from server.tail_drafter import EagleModule, save_drafter

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


def stdlib_texts(limit_chars: int, seed: int = 0) -> list[str]:
    """Source files and the docs' topics from the standard library, shuffled, about ``limit_chars``."""
    root = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = [
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts
        and "test" not in p.parts
        and "tests" not in p.parts
        and "idlelib" not in p.parts
    ]
    random.Random(seed).shuffle(files)
    docs = root / "pydoc_data" / "topics.py"
    texts, total = [], 0
    if docs.exists():  # the language reference's topics, as text
        namespace: dict = {}
        exec(compile(docs.read_text(), str(docs), "exec"), namespace)
        topics = list(namespace.get("topics", {}).values())
        random.Random(seed).shuffle(topics)
        for topic in topics:
            if total > limit_chars // 3:
                break
            texts.append(topic)
            total += len(topic)
    for path in files:
        if total > limit_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        start = random.Random(str(path)).randrange(max(1, len(text) - 6000))
        texts.append(text[start : start + 6000])
        total += min(6000, len(text))
    return texts


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


@torch.inference_mode()
def collect(
    model: PreTrainedModel, sequences: list[list[int]], chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features [N, chunk, H] (fp16), token ids [N, chunk] and the target's own next-token choice at
    each position [N, chunk] (the argmax of its logits there)."""
    feats, ids, labels = [], [], []
    for seq in sequences:
        for start in range(0, len(seq) - chunk + 1, chunk):
            piece = torch.tensor([seq[start : start + chunk]])
            hidden = model.model(input_ids=piece).last_hidden_state  # after the final norm
            feats.append(hidden[0].half())
            ids.append(piece[0])
            labels.append(model.lm_head(hidden)[0].argmax(-1))
    return torch.stack(feats), torch.stack(ids), torch.stack(labels)


def chunks_of(tokenizer: PreTrainedTokenizerBase, texts: list[str], chunk: int) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        out += [ids[i : i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)]
    return out


def train(
    model: PreTrainedModel,
    feats: torch.Tensor,
    ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    draft_vocab: torch.Tensor,
    seconds: float,
    lr: float,
    batch: int,
    seed: int = 0,
) -> EagleModule:
    """Fit the drafter by EAGLE's loss within ``seconds``. Position t's input is (feature_t, token_{t+1});
    its output should be feature_{t+1}, whose LM head argmax is the target's choice at t + 1."""
    torch.manual_seed(seed)
    config = model.config
    net = EagleModule(config)
    with torch.no_grad():  # start from the target's last layer as an identity (its output projections
        # zeroed: the residual passes the input through), the fc passing the feature through
        net.layer.load_state_dict(model.model.layers[-1].state_dict())
        net.layer.self_attn.o_proj.weight.zero_()
        net.layer.mlp.down_proj.weight.zero_()
        hidden = config.hidden_size
        net.fc.weight.zero_()
        net.fc.weight[:, :hidden].copy_(torch.eye(hidden))
        net.fc.weight[:, hidden:].normal_(0, 0.02)
    net.train()
    norm = model.model.norm
    rows = model.lm_head.weight[draft_vocab].detach().clone()  # [V', H]
    to_draft = torch.full((config.vocab_size,), -100, dtype=torch.long)
    to_draft[draft_vocab] = torch.arange(len(draft_vocab))
    embed = model.model.embed_tokens.weight.detach()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    n, seq = ids.shape
    from server.adapters.llama import _causal_mask

    mask = _causal_mask(0, seq - 1, torch.device("cpu"))
    positions = torch.arange(seq - 1).unsqueeze(0)
    began, step, estimated_steps = time.perf_counter(), 0, None
    while True:
        elapsed = time.perf_counter() - began
        if elapsed > seconds:
            break
        if step == 20:
            estimated_steps = int(seconds / (elapsed / 20))
        total = estimated_steps or 10**9
        warm = min(1.0, (step + 1) / 20)
        scale = warm * (0.5 * (1 + math.cos(math.pi * min(step / total, 1.0))) if estimated_steps else warm)
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.02)
        pick = torch.randint(0, n, (batch,))
        f = feats[pick].float()  # [B, S, H]
        x_next = ids[pick][:, 1:]  # token at t + 1
        f_in = f[:, :-1] + torch.randn_like(f[:, :-1]) * 0.05 * f.std()  # EAGLE: noise on the inputs
        out = net(f_in, embed[x_next], positions, None, mask)
        predicted = norm(out)
        reg = torch.nn.functional.smooth_l1_loss(predicted, f[:, 1:])
        target = to_draft[labels[pick][:, 1:]]
        ce = torch.nn.functional.cross_entropy((predicted @ rows.T).flatten(0, 1), target.flatten(), ignore_index=-100)
        loss = reg + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            with torch.no_grad():
                valid = target != -100
                top1 = ((predicted @ rows.T).argmax(-1) == target)[valid].float().mean().item()
            logger.info(
                f"step {step} ({elapsed:.0f}s): loss {loss.item():.3f} reg {reg.item():.3f} ce "
                f"{ce.item():.3f} top1 {top1:.3f}"
            )
        step += 1
    net.eval()
    return net


@torch.inference_mode()
def evaluate(
    net: EagleModule,
    model: PreTrainedModel,
    feats: torch.Tensor,
    ids: torch.Tensor,
    labels: torch.Tensor,
    draft_vocab: torch.Tensor,
    depth: int = 4,
) -> list[float]:
    """Fraction of positions whose first k tail drafts all equal the target's choices, k = 1..depth
    (teacher-forced context, the drafter's own features for the chain): the expected acceptance."""
    from server.adapters.llama import _causal_mask

    norm, rows, embed = model.model.norm, model.lm_head.weight[draft_vocab], model.model.embed_tokens.weight
    hits = [0] * depth
    count = 0
    for i in range(feats.shape[0]):
        f, x, y = feats[i : i + 1].float(), ids[i], labels[i]
        seq = f.shape[1]
        cache = net.new_cache()
        half = seq // 2
        out = net(
            f[:, :half],
            embed[x[1 : half + 1]].unsqueeze(0),
            torch.arange(half).unsqueeze(0),
            cache,
            _causal_mask(0, half, torch.device("cpu")),
        )
        # the bonus token is x[half]; the drafts should be the target's choices at half, half + 1, ...
        o = out[:, -1:]
        pos = half
        ok = True
        for k in range(depth):
            predicted = norm(o)
            tok = int(draft_vocab[int((predicted[0, -1] @ rows.T).argmax())])
            if ok and pos < seq and tok == int(y[pos]):
                hits[k] += 1
            else:
                ok = False
            o = net(predicted, embed[torch.tensor([[tok]])], torch.tensor([[pos]]), cache, None)
            pos += 1
        count += 1
    return [h / max(count, 1) for h in hits]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m server.drafter_train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "drafters"),
        help="folder for <model>.safetensors (--drafter auto looks there, matching config fingerprints)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--stdlib-chars", type=int, default=250_000, help="characters of standard library text")
    p.add_argument("--answer-tokens", type=int, default=160, help="new tokens per own answer")
    p.add_argument("--chunk", type=int, default=128, help="positions per training sequence")
    p.add_argument("--draft-vocab", type=int, default=16384, help="ids the drafter may propose (most frequent first)")
    p.add_argument("--train-seconds", type=float, default=900.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from protocol.models import resolve_model

    source = resolve_model(args.model).source
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval().requires_grad_(False)
    began = time.perf_counter()
    answers = own_answers(model, tokenizer, SELF_PROMPTS, args.answer_tokens)
    logger.info(f"own answers: {sum(map(len, answers))} tokens in {time.perf_counter() - began:.0f}s")
    # the answers as whole sequences cut into chunks (several chunks where long), the stdlib after
    sequences = [
        s[i : i + args.chunk] for s in answers for i in range(0, max(1, len(s) - args.chunk + 1), args.chunk // 2)
    ]
    sequences = [s for s in sequences if len(s) == args.chunk]
    sequences += chunks_of(tokenizer, stdlib_texts(args.stdlib_chars, args.seed), args.chunk)
    random.Random(args.seed).shuffle(sequences)
    feats, ids, labels = collect(model, sequences, args.chunk)
    logger.info(f"features: {feats.shape[0]} x {args.chunk} positions in {time.perf_counter() - began:.0f}s")
    held_out = max(4, feats.shape[0] // 20)
    counts = torch.bincount(labels[held_out:].flatten(), minlength=model.config.vocab_size)
    draft_vocab = torch.sort(torch.argsort(counts, descending=True)[: args.draft_vocab]).values
    coverage = counts[draft_vocab].sum().item() / counts.sum().item()
    logger.info(f"draft vocabulary: {len(draft_vocab)} ids cover {coverage:.3f} of the target's choices")
    net = train(
        model,
        feats[held_out:],
        ids[held_out:],
        labels[held_out:],
        draft_vocab=draft_vocab,
        seconds=args.train_seconds,
        lr=args.lr,
        batch=args.batch,
        seed=args.seed,
    )
    acceptance = evaluate(net, model, feats[:held_out], ids[:held_out], labels[:held_out], draft_vocab)
    logger.info(f"held-out: first k drafts all right, k=1..4: {[round(a, 3) for a in acceptance]}")
    out = Path(args.out) / f"{Path(args.model).name}.safetensors"  # --drafter auto matches it by config fingerprint
    save_drafter(
        net,
        out,
        model.config,
        draft_vocab=draft_vocab,
        extra={
            "model": args.model,
            "positions": str(feats.shape[0] * args.chunk),
            "held_out_acceptance": str(acceptance),
            "train_seconds": str(args.train_seconds),
        },
    )
    logger.info(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) after {time.perf_counter() - began:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
