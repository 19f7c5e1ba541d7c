"""How much can asynchronous speculation gain at most, with this drafter on this model's answers?

    python -m benchmarks.async_ceiling                # the WAN benchmark's workloads, 5 prompts each
    python -m benchmarks.async_ceiling --prompts 2    # a quick look

Asynchronous speculation only saves time on a verdict whose run was already in flight when the
verdict before it arrived, and such a run is only valid if everything it assumed came true: every
draft of the run ahead accepted and that run's bonus token guessed. Every other verdict costs a
full lap. So the number of full laps is bounded from below by what the drafter cannot guess:

- this script takes the target's greedy answers (local transformers, float32: the swarm returns
  the same tokens), then drives the client's real decoder (`SpeculativeDecoder`, same drafter, same
  window) against an oracle target that verifies from those answers, with no network;
- it counts, per workload, the laps of synchronous suffix speculation, and the verdicts of
  asynchronous speculation whose run had been sent behind another (overlapped) or not (full laps);
- and the positions whose token the drafter's own first choice misses, given the true context up
  to there (`draft(1)`): a pipeline of runs in order, however long its window, holds one guess per
  position, so each such position costs a full lap (a draft made several tokens ahead can now and
  then guess a token the one-step choice misses, so this is a ceiling for this drafter, not a
  theorem; the real decoder's full laps stay above it in every replay). `top-16` counts a position
  as guessed when its token is anywhere among the drafter's 16 likeliest continuations there: what
  speculating on many outcomes at once, which runs in order cannot do, could at most reach.

With lap times from `benchmarks/results/wan.json` (`make bench-wan`), it turns the lap counts into
an upper bound on tokens/s: every unavoidable lap as cheap as a lap without drafts ("none"), every
speculative run free. That bound, against the synchronous suffix tokens/s measured in the same WAN
run, is the most asynchronous speculation could gain over synchronous there. Results go to stdout
and to benchmarks/results/async_ceiling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.wan import workloads
from client._generation import SessionState, SpeculativeDecoder
from client.drafting import SuffixStore, make_drafter
from protocol.messages import GREEDY
from tests.kit.oracle import OracleSwarm

RESULTS = Path(__file__).parent / "results"


@dataclass
class Replay:
    tokens: int
    laps: int  # verdicts
    full_laps: int  # verdicts whose run was not sent behind another one
    runs_cancelled: int
    positions_wasted: int


def replay(prompt: list[int], answer: list[int], eos: int, inflight: int, num_draft_tokens: int) -> Replay:
    """The client's decoder over an oracle target; counts only, no clock."""
    swarm = OracleSwarm(prompt + answer, eos)
    state = SessionState(max_length=len(prompt) + len(answer) + num_draft_tokens + 1)
    drafter = make_drafter("suffix", num_draft_tokens=num_draft_tokens, store=SuffixStore(), eos_token_ids=[eos])
    decoder = SpeculativeDecoder(
        swarm,
        state,
        GREEDY,
        drafter=drafter,
        num_draft_tokens=num_draft_tokens,
        max_inflight_runs=inflight,
        eos_token_ids=[eos],
    )
    out = asyncio.run(decoder.generate(prompt, len(answer)))
    assert out == answer, "the oracle replay must reproduce the answer"
    s = decoder.stats
    overlapped_verdicts = len(swarm.session.overlapped) - s.runs_cancelled
    return Replay(s.new_tokens, s.laps, s.laps - overlapped_verdicts, s.runs_cancelled, s.positions_wasted)


def unguessed(
    prompt: list[int], answer: list[int], eos: int, num_draft_tokens: int, width: int = 16
) -> tuple[int, int]:
    """Positions whose token is not the drafter's first choice given the true context, and those
    whose token is not among its `width` likeliest continuations either."""
    drafter = make_drafter("suffix", num_draft_tokens=num_draft_tokens, store=SuffixStore(), eos_token_ids=[eos])
    wide = make_drafter("suffix", num_draft_tokens=num_draft_tokens, store=SuffixStore(), eos_token_ids=[eos])
    wide.min_prob = 0.0  # rank every continuation seen, however rare
    drafter.reset(prompt)
    wide.reset(prompt)
    missed = missed_wide = 0
    for token in answer:
        first_choice = drafter.draft(1)[:1] == [token]
        missed += not first_choice
        missed_wide += not (first_choice or token in wide.alternatives(width))
        drafter.extend([token])
        wide.extend([token])
    return missed, missed_wide


def answers(args) -> tuple[list[tuple[str, list[int], list[int]]], int]:
    """(workload, prompt ids, greedy answer ids) for the WAN benchmark's workloads, and the EOS id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from protocol.models import ensure_smollm2_checkpoint

    path = ensure_smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[tuple[str, list[int], list[int]]] = []
    first_answers: list[str] = []
    for workload, conversations in workloads(first_answers, args.prompts):
        for messages in conversations:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            with torch.no_grad():
                generated = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1] :]
            out.append((workload, ids[0].tolist(), generated.tolist()))
            if workload == "code editing":
                first_answers.append(tokenizer.decode(generated, skip_special_tokens=True))
            print(f"  {workload:<22} answer of {len(generated)} tokens", flush=True)
    return out, tokenizer.eos_token_id


@dataclass
class Ceiling:
    workload: str
    tokens: int
    sync_laps: int
    async_laps: int
    async_full_laps: int
    async_wasted_per_token: float
    unguessed_top1: int
    unguessed_top16: int
    bounds: dict = field(default_factory=dict)  # delay -> {sync tok/s, bound tok/s, ratio}


def ceilings(samples, eos: int, args) -> list[Ceiling]:
    rows = []
    for workload in dict.fromkeys(w for w, _, _ in samples):
        mine = [(p, a) for w, p, a in samples if w == workload]
        sync = [replay(p, a, eos, 1, args.num_draft_tokens) for p, a in mine]
        asyn = [replay(p, a, eos, args.max_inflight_runs, args.num_draft_tokens) for p, a in mine]
        tokens = sum(r.tokens for r in sync)
        missed = [unguessed(p, a, eos, args.num_draft_tokens) for p, a in mine]
        rows.append(
            Ceiling(
                workload,
                tokens,
                sum(r.laps for r in sync),
                sum(r.laps for r in asyn),
                sum(r.full_laps for r in asyn),
                sum(r.positions_wasted for r in asyn) / tokens,
                sum(m[0] for m in missed),
                sum(m[1] for m in missed),
            )
        )
    return rows


def add_time_bounds(rows: list[Ceiling], wan_path: Path) -> bool:
    """Upper bounds on async tokens/s from the WAN run's lap times; False if there is no WAN run."""
    if not wan_path.exists():
        return False
    wan = json.loads(wan_path.read_text())
    for row in rows:
        for delay in sorted({r["delay_ms"] for r in wan["runs"]}):
            runs = [r for r in wan["runs"] if r["delay_ms"] == delay and r["workload"] == row.workload]
            lap_min = statistics.median(r["lap_seconds"] for r in runs if r["mode"] == "none")
            sync_tps = statistics.median(r["tokens"] / r["seconds"] for r in runs if r["mode"] == "suffix")
            measured = [r["tokens"] / r["seconds"] for r in runs if r["mode"] == "suffix+async"]
            bound_tps = row.tokens / (row.unguessed_top1 * lap_min)
            row.bounds[delay] = dict(
                lap_none_ms=1000 * lap_min,
                sync_tokens_per_s=sync_tps,
                bound_tokens_per_s=bound_tps,
                bound_vs_sync=bound_tps / sync_tps,
                async_vs_sync=statistics.median(measured) / sync_tps if measured else None,
            )
    return True


def markdown(rows: list[Ceiling]) -> str:
    lines = [
        "| workload | tokens | sync laps (tokens/lap) | async verdicts / full laps | async wasted positions/token "
        "| unguessed top-1 (tokens/lap ceiling) | unguessed top-16 | full laps: sync / ceiling |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        lines.append(
            f"| {r.workload} | {r.tokens} | {r.sync_laps} ({r.tokens / r.sync_laps:.2f}) | {r.async_laps} / "
            f"{r.async_full_laps} "
            f"| {r.async_wasted_per_token:.2f} | {r.unguessed_top1} ({r.tokens / r.unguessed_top1:.2f}) "
            f"| {r.unguessed_top16} ({r.tokens / r.unguessed_top16:.2f}) | {r.sync_laps / r.unguessed_top1:.2f}x |"
        )
    if any(r.bounds for r in rows):
        lines += [
            "",
            "| delay/hop | workload | lap without drafts ms | sync suffix tok/s | ceiling tok/s "
            "| ceiling vs sync | measured async vs sync |",
            "|" + "---|" * 7,
        ]
        for r in rows:
            for delay, b in r.bounds.items():
                measured = f"{b['async_vs_sync']:.2f}x" if b["async_vs_sync"] is not None else "-"
                lines.append(
                    f"| {delay:.0f} ms | {r.workload} | {b['lap_none_ms']:.0f} | {b['sync_tokens_per_s']:.1f} "
                    f"| {b['bound_tokens_per_s']:.1f} | {b['bound_vs_sync']:.2f}x | {measured} |"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=5, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--max-inflight-runs", type=int, default=3)
    p.add_argument("--wan", default=str(RESULTS / "wan.json"), help="lap times from `make bench-wan`")
    p.add_argument("--out", default=str(RESULTS / "async_ceiling.json"))
    args = p.parse_args()
    samples, eos = answers(args)
    rows = ceilings(samples, eos, args)
    if not add_time_bounds(rows, Path(args.wan)):
        print(f"(no {args.wan}: run `make bench-wan` first for the tokens/s bounds)")
    print(markdown(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
