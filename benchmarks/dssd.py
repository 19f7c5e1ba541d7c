"""The rejection (DSSD) exchange against token match, for the same stochastic drafter.

    python -m benchmarks.dssd                       # 4 prompts, 64 sampled tokens each, 8 seeds
    python -m benchmarks.dssd --prompts 1 --tokens 16 --seeds 2   # a quick look

In process, no network: the target is SmolLM2-135M-Instruct (float32). For each prompt it samples
an answer (temperature 0.8, top-k 50), then runs prompt + answer teacher-forced through the target
(p) and through each drafter (q) once, so every answer position has both distributions. Drafters:
"layer-skip" (the target's first 24 of 30 blocks with its final norm and head: a self-speculative
drafter) and "hot target" (the target at 1.5x the temperature: a stochastic drafter close to p).

(a) Acceptance of one draft x ~ q per position, under each sampling setting: "exact" is the
expectation (token match accepts with sum_x q(x) p(x), rejection with sum_x min(p, q)), "measured"
runs the real functions (protocol/sampling.py: draw_draft, then choose_token for token match and
verify_rejection with q(x) rounded to float16 for rejection) over ``--seeds`` seeds per position.

(b) The correction's total-variation error when p's support exceeds the top-K (sampling at
temperature 1 with no top-k or top-p, so p covers the whole vocabulary): per position, the
distribution of the committed token, min(p, q) + P(reject) * norm(max(0, p - q) over the top-K of p),
against p, for K in 8, 16, 32, 64 (64 is the protocol's limit); and for top-k 50 with K = 50 (exact).

Results go to stdout as Markdown tables and to benchmarks/results/dssd.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import msgspec
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.wan import _commit
from protocol.messages import SamplingParams
from protocol.models import ensure_smollm2_checkpoint
from protocol.sampling import (
    check_draft_q,
    choose_token,
    correction_top_k,
    draw_draft,
    pack_f16,
    processed_scores,
    verify_rejection,
)
from tests.kit.prompts import CODE_EDITING, OPEN_CHAT

SETTINGS = {
    "T=0.8, top-k 50": SamplingParams(do_sample=True, temperature=0.8, top_k=50),
    "T=1.0, top-p 0.95": SamplingParams(do_sample=True, top_p=0.95),
}
SKIP_BLOCKS = 24
HOT = 1.5


def load(path: Path, blocks: int = 0):
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    if blocks:
        model.model.layers = model.model.layers[:blocks]
        model.config.num_hidden_layers = blocks
    return model


def positions(target, tokenizer, prompts: list[str], tokens: int) -> list[tuple[list[int], int]]:
    """(ids, first answer position) per prompt: the prompt and a sampled answer."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        torch.manual_seed(i)
        with torch.no_grad():
            full = target.generate(
                torch.tensor([ids]), max_new_tokens=tokens, do_sample=True, temperature=0.8, top_k=50
            )
        out.append((full[0].tolist(), len(ids)))
    return out


def rows(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [L, V]: row i predicts position i + 1


def dist(logits: torch.Tensor, context: list[int], params: SamplingParams) -> torch.Tensor:
    return torch.softmax(processed_scores(logits, context, params), dim=-1)


def acceptance(samples, drafter_rows, params: SamplingParams, seeds: int, hot: bool) -> dict:
    exact_match, exact_reject, hits_match, hits_reject, trials = [], [], 0, 0, 0
    q_params = msgspec.structs.replace(params, temperature=params.temperature * HOT) if hot else params
    for (ids, first), (p_rows, q_rows) in zip(samples, drafter_rows):
        for t in range(first, len(ids)):
            context = ids[:t]
            p = dist(p_rows[t - 1], context, params)
            q = dist(q_rows[t - 1], context, q_params)
            exact_match.append(float((p * q).sum()))
            exact_reject.append(float(torch.minimum(p, q).sum()))
            for seed in range(seeds):
                seeded = msgspec.structs.replace(params, seed=seed)
                x = draw_draft(q, seed, t)
                hits_match += choose_token(p_rows[t - 1], context, t, seeded) == x
                wire_q = check_draft_q(pack_f16([float(q[x])]), 1)
                # n_draft=1; the second row (the bonus token's) does not change the verdict on x
                accepted, *_ = verify_rejection([p_rows[t - 1], p_rows[t - 1]], context + [x], t - 1, 1, seeded, wire_q)
                hits_reject += accepted
                trials += 1
    return {
        "positions": len(exact_match),
        "trials": trials,
        "exact_match": statistics.fmean(exact_match),
        "exact_rejection": statistics.fmean(exact_reject),
        "measured_match": hits_match / trials if trials else None,
        "measured_rejection": hits_reject / trials if trials else None,
    }


def tv_error(samples, drafter_rows, params: SamplingParams, k: int) -> float:
    """Mean TV distance between the exchange's committed-token distribution and p."""
    errors = []
    for (ids, first), (p_rows, q_rows) in zip(samples, drafter_rows):
        for t in range(first, len(ids)):
            context = ids[:t]
            p, q = dist(p_rows[t - 1], context, params), dist(q_rows[t - 1], context, params)
            overlap = torch.minimum(p, q)
            reject = 1 - float(overlap.sum())
            top_p, top_ids = p.topk(k)
            residual = (top_p - q[top_ids]).clamp(min=0)
            if not float(residual.sum()) > 0:  # sample_correction's fallback
                residual = top_p
            committed = overlap.clone()
            committed[top_ids] += reject * residual / residual.sum()
            errors.append(0.5 * float((committed - p).abs().sum()))
    return statistics.fmean(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dssd.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = ensure_smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target, skip = load(path), load(path, SKIP_BLOCKS)
    prompts = [p for pair in zip(OPEN_CHAT, CODE_EDITING) for p in pair][: args.prompts]
    began = time.perf_counter()
    samples = positions(target, tokenizer, prompts, args.tokens)
    p_rows = [rows(target, ids) for ids, _ in samples]
    drafters = {
        f"layer-skip ({SKIP_BLOCKS}/30 blocks)": (
            [(p, rows(skip, ids)) for p, (ids, _) in zip(p_rows, samples)],
            False,
        ),
        f"hot target ({HOT}x temperature)": ([(p, p) for p in p_rows], True),
    }
    accept = {}
    print("| drafter | sampling | positions | token match: exact | measured | rejection: exact | measured |")
    print("|---|---|---|---|---|---|---|")
    for name, (pairs, hot) in drafters.items():
        for setting, params in SETTINGS.items():
            r = accept[f"{name} | {setting}"] = acceptance(samples, pairs, params, args.seeds, hot)
            print(
                f"| {name} | {setting} | {r['positions']} | {r['exact_match']:.3f} | {r['measured_match']:.3f} | "
                f"{r['exact_rejection']:.3f} | {r['measured_rejection']:.3f} |"
            )
    full = SamplingParams(do_sample=True)
    layer_skip = drafters[f"layer-skip ({SKIP_BLOCKS}/30 blocks)"][0]
    tv = {f"T=1.0, no top-k/top-p, K={k}": tv_error(samples, layer_skip, full, k) for k in (8, 16, 32, 64)}
    top50 = SETTINGS["T=0.8, top-k 50"]
    tv[f"T=0.8, top-k 50, K={correction_top_k(top50)}"] = tv_error(samples, layer_skip, top50, correction_top_k(top50))
    print("\n| layer-skip drafter, sampling and K | mean TV error of the committed token |\n|---|---|")
    for name, value in tv.items():
        print(f"| {name} | {value:.2e} |")
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "commit": _commit(),
                "seconds": round(time.perf_counter() - began, 1),
                "acceptance": accept,
                "tv_error": tv,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
