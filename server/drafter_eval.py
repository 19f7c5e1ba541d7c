"""How often the tail drafter's drafts are right on held-out prompts, per draft depth.

Why two figures: teacher-forced acceptance chains k drafts from every position of the target's own
greedy answer (the context is the target's, the chain the head's own): what a verification would
accept if drafting started there. Free-running acceptance runs the speculative loop itself, greedy,
the way the tail drafts (``--depth`` drafts per lap, each lap's accepted ids' features fed to the
head before it drafts again): the fraction of laps whose first k drafts were all accepted, and the
tokens per lap. The prompts are the held-out split of server/drafter_prompts.py (never trained on),
chat and code reported apart. ``python -m server.drafter_eval --drafter FILE``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from server.drafter_data import _atomic_write, answer_batch, chat_ids
from server.drafter_device import DEVICES, pick_device
from server.drafter_prompts import held_out_prompts
from server.drafter_ttt import Head, ttt_forward
from server.tail_drafter import cache_kwarg

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from server.tail_drafter import EagleModule

ANSWER_TOKENS = 128


def held_out_rows(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data: Path, per_kind: int
) -> dict[str, list[tuple[list[int], int]]]:
    """{"chat": ..., "code": ...}: (prompt + greedy answer ids, prompt length) for the first
    ``per_kind`` held-out prompts of each kind, generated once and kept in ``data``."""
    cache = data / f"held-out-{per_kind}.pt"
    if cache.exists():
        return torch.load(cache, weights_only=False)
    prompts = held_out_prompts()
    out = {}
    for kind in ("chat", "code"):
        ids = [chat_ids(tokenizer, p.text) for p in prompts if p.kind == kind][:per_kind]
        answers = []
        for i in range(0, len(ids), 8):
            answers += answer_batch(model, tokenizer, ids[i : i + 8], ANSWER_TOKENS, 0.0, 0)
        out[kind] = [(p + a, len(p)) for p, a in zip(ids, answers)]
    data.mkdir(parents=True, exist_ok=True)
    _atomic_write(cache, lambda f: torch.save(out, f))
    return out


@torch.inference_mode()
def teacher_forced(
    model: PreTrainedModel, net: EagleModule, head: Head, rows: list[tuple[list[int], int]], depth: int
) -> list[float]:
    """Fraction of answer positions whose first k chained drafts all equal the target's choices."""
    hits, count = [0] * depth, 0
    for ids, prompt_len in rows:
        x = torch.tensor([ids], device=model.device)
        feats = model.model(input_ids=x).last_hidden_state
        labels = model.lm_head(feats).argmax(-1)
        predicted = ttt_forward(net, head, feats[:, :-1], x[:, 1:], depth)
        # position t's chain drafts the ids after t + 1: from t = prompt_len - 1 on, all are the answer's
        first, last = max(0, prompt_len - 1), x.shape[1] - depth
        if last <= first:
            continue
        ok = None
        for k, pred in enumerate(predicted, start=1):
            right = head.draft_ids(pred[0, first:last]) == labels[0, first + k : last + k]
            ok = right if ok is None else ok & right
            hits[k - 1] += int(ok.sum())
        count += last - first
    return [h / max(count, 1) for h in hits]


def _crop(cache: DynamicCache, length: int) -> None:
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # transformers 5: crop takes the count to remove


@torch.inference_mode()
def free_running(
    model: PreTrainedModel, net: EagleModule, head: Head, rows: list[tuple[list[int], int]], depth: int, eos: int
) -> dict[str, Any]:
    """Greedy speculative decoding with ``depth`` tail drafts per lap over each row's prompt."""
    from server.adapters.llama import _causal_mask

    laps, hits, tokens = 0, [0] * depth, 0
    dev, kw = model.device, cache_kwarg(model.model)

    def t(rows_of_ids: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows_of_ids, device=dev)

    for ids, prompt_len in rows:
        x = t([ids[:prompt_len]])
        target_cache, draft_cache = DynamicCache(config=model.config), net.new_cache()
        feats = model.model(input_ids=x, use_cache=True, **{kw: target_cache}).last_hidden_state
        bonus = int(model.lm_head(feats[:, -1]).argmax(-1))
        length, made = prompt_len, 1
        next_ids = torch.cat([x[:, 1:], t([[bonus]])], dim=1)
        mask = _causal_mask(0, length, dev)
        out = net(feats, head.embed[next_ids], torch.arange(length, device=dev).unsqueeze(0), draft_cache, mask)
        while made < ANSWER_TOKENS and bonus != eos:
            drafts, o, pos = [], out[:, -1:], length
            for k in range(depth):
                predicted = head.norm(o)
                drafts.append(int(head.draft_ids(predicted[0, -1])))
                if k + 1 < depth:
                    o = net(predicted, head.embed[t([[drafts[-1]]])], t([[pos]]), draft_cache)
                    pos += 1
            _crop(draft_cache, length)
            run = t([[bonus] + drafts])
            feats = model.model(input_ids=run, use_cache=True, **{kw: target_cache}).last_hidden_state
            choice = model.lm_head(feats[0]).argmax(-1).tolist()
            accepted = 0
            while accepted < depth and drafts[accepted] == choice[accepted] and drafts[accepted] != eos:
                accepted += 1
            laps += 1
            for k in range(accepted):
                hits[k] += 1
            _crop(target_cache, length + 1 + accepted)
            committed = drafts[:accepted] + [choice[accepted]]
            positions = torch.arange(length, length + accepted + 1, device=dev).unsqueeze(0)
            mask = _causal_mask(length, accepted + 1, dev)
            out = net(feats[:, : accepted + 1], head.embed[t([committed])], positions, draft_cache, mask)
            length, made, bonus = length + accepted + 1, made + accepted + 1, committed[-1]
            if eos in committed:
                break
        tokens += made
    return dict(by_depth=[round(h / max(laps, 1), 4) for h in hits], tokens_per_lap=round(tokens / max(laps, 1), 3))


def held_out_acceptance(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    net: EagleModule,
    draft_vocab: torch.Tensor | None,
    data: Path,
    per_kind: int,
    depth: int = 3,
) -> dict[str, Any]:
    """{kind: {teacher_forced: [k=1..depth], free_running: {...}}} on held-out chat and code."""
    net.eval()
    vocab = draft_vocab if draft_vocab is not None else torch.arange(model.config.vocab_size)
    head = Head.of(model, vocab)
    figures: dict[str, Any] = {}
    for kind, rows in held_out_rows(model, tokenizer, data, per_kind).items():
        figures[kind] = dict(
            teacher_forced=[round(a, 4) for a in teacher_forced(model, net, head, rows, depth)],
            free_running=free_running(model, net, head, rows, depth, tokenizer.eos_token_id),
        )
    return figures


def main(argv: list[str] | None = None) -> int:
    from server.drafter_data import DEFAULT_DIR

    p = argparse.ArgumentParser(prog="python -m server.drafter_eval", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", required=True, help="a drafter file (.safetensors)")
    p.add_argument("--data", default=None, help=f"where held-out answers are kept (default {DEFAULT_DIR}/<model>)")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts of each kind")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when available (TF32 off)")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from protocol.models import resolve_model
    from server.tail_drafter import load_drafter

    source = resolve_model(args.model).source
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval().requires_grad_(False).to(device)
    net, vocab = load_drafter(args.drafter, model.config, device=device)
    data = Path(args.data) if args.data else DEFAULT_DIR / Path(args.model).name
    figures = held_out_acceptance(model, tokenizer, net, vocab, data, args.prompts)
    print(json.dumps(dict(drafter=args.drafter, prompts_per_kind=args.prompts, **figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
