"""WAN benchmark: tokens/s and tokens per lap of a local SmolLM2 swarm behind delay proxies.

    python -m benchmarks.wan                      # 0, 25, 50 ms per hop; every mode; every workload
    python -m benchmarks.wan --delays 25 --max-new-tokens 32 --prompts 2   # a quick look

A lap crosses servers + 1 delayed links (client -> head -> ... -> tail -> client), so its floor is
(servers + 1) x delay. Modes run alternately on each prompt in the same swarm, so they share
whatever noise the machine has; ratios are against "none" (no speculation) in the same run.
Workloads: code editing (the answer should repeat the prompt's code), open chat (answers not in
the prompt), and the second turn of each code-editing conversation (a follow-up edit: the context
now holds the model's own first rewrite). Results go to stdout as a Markdown table and to
benchmarks/results/wan.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.local import LocalSwarm
from tests.kit.heldout_prompts import HELD_OUT_CHAT, HELD_OUT_CODE
from tests.kit.prompts import CODE_EDITING, CODE_FOLLOW_UP, OPEN_CHAT

MODES = {  # loop_runs=False: the client sends every run (as before looped runs existed)
    "none": dict(speculation=None, loop_runs=False),
    "default": dict(),  # generate() with no speculation argument: what a user gets
    "ngram": dict(speculation="ngram", loop_runs=False),
    "suffix": dict(speculation="suffix", loop_runs=False),
    "suffix+async": dict(speculation="suffix", async_speculation=True, max_inflight_runs=3),
    "tail": dict(speculation="tail", loop_runs=False),  # the tail's drafter alone (server/tail_drafter.py)
    "suffix+tail": dict(
        speculation="suffix+tail", loop_runs=False
    ),  # per lap the source measured better (client.drafting.TailDrafts)
    "suffix-tree": dict(speculation="suffix", draft_tree=True),  # token trees sized per lap (client/_trees.py)
    "ngram-tree": dict(speculation="ngram", draft_tree=True),
    # looped runs: the tail starts each next run at the head, one link earlier (docs/protocol.md)
    "none+loop": dict(speculation=None, loop_runs=True),
    "tail+loop": dict(speculation="tail", loop_runs=True),
    "suffix+loop": dict(
        speculation="suffix", loop_runs=True
    ),  # generate()'s default; retrieval drafts ride as DraftOffers
    "suffix+tail+loop": dict(speculation="suffix+tail", loop_runs=True),
    # the suffix store starts with the model's warm corpus (client/warm_corpus.py; opt-in for users)
    "suffix+warm": dict(speculation="suffix", loop_runs=False, warm_store=True),
    "suffix+loop+warm": dict(speculation="suffix", loop_runs=True, warm_store=True),
    # the cost model before 2026-12-06: the tail's blocks priced per position, no fixed part (TailFit.blocks_fit)
    "suffix+loop, blocks per position": dict(speculation="suffix", loop_runs=True, blocks_per_position=True),
}
DEFAULT_MODES = ["none", "ngram", "suffix", "suffix+async", "suffix+loop"]  # docs/benchmarks.md's WAN table


@dataclass
class Run:
    delay_ms: float
    workload: str
    mode: str
    prompt: int
    tokens: int
    seconds: float
    laps: int
    accepted_per_lap: float
    bytes_up: int
    bytes_down: int
    lap_seconds: float
    runs_cancelled: int = 0
    positions_wasted: int = 0
    turnaround_seconds: float = 0.0
    hedge_hits: int = 0
    hedge_seconds: float = 0.0
    # head-drafting modes: per source, [proposals, ids proposed, ids matching the committed text]
    # (client.drafting.TailDrafts measures both sources on every lap, whichever it sent)
    sources: dict = None
    choices: dict = None
    # tree modes: laps sent as trees, draft nodes they carried, drafts accepted on them, laps by nodes sent
    tree_laps: int = 0
    tree_nodes: int = 0
    tree_accepted: int = 0
    tree_sizes: dict = None


WORKLOADS = ["code editing", "open chat", "code editing, turn 2", "held-out chat", "held-out code"]


def workloads(first_answers: list[str], limit: int, names: list[str] = WORKLOADS):
    """(name, conversations) per workload in ``names``. The second code-editing turn is built from the
    first turn's answers (identical in every mode), so it is only ready after the first turn ran. The
    held-out workloads (tests/kit/heldout_prompts.py) are request-first prompts no drafter trained on."""
    single = {
        "code editing": CODE_EDITING,
        "open chat": OPEN_CHAT,
        "held-out chat": HELD_OUT_CHAT,
        "held-out code": HELD_OUT_CODE,
    }
    for name in names:
        if name in single:
            yield name, [[{"role": "user", "content": p}] for p in single[name][:limit]]
    if "code editing, turn 2" not in names:
        return
    yield (
        "code editing, turn 2",
        [
            [
                {"role": "user", "content": p},
                {"role": "assistant", "content": a},
                {"role": "user", "content": CODE_FOLLOW_UP},
            ]
            for p, a in zip(CODE_EDITING, first_answers)
        ],
    )


def blocks_per_position(self) -> tuple[float, float]:
    """``TailFit.blocks_fit`` before 2026-12-06: the tail's blocks, their whole time per position."""
    line = self.blocks
    return (0.0, line.y / line.x) if line.x > 0 else (0.0, 0.0)


def run_setting(args, delay_ms: float, modes: dict) -> list[Run]:
    from client.drafting.cost_model import TailFit
    from swarm import AutoDistributedModelForCausalLM

    fitted = TailFit.blocks_fit

    runs: list[Run] = []
    server_args = ["--torch-threads", "1", "--log-level", "WARNING"]
    with LocalSwarm("smollm2-135m", args.servers, hop_delay_ms=delay_ms, server_args=server_args) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            "smollm2-135m", initial_peers=swarm.initial_peers, warm_draft_store=True
        )  # for the +warm modes
        tokenizer = model.tokenizer
        warm = tokenizer("Hello", return_tensors="pt")["input_ids"]
        model.generate(warm, max_new_tokens=4, speculation=None)  # connections and caches warm
        first_answers: list[str] = []
        names = list(args.workloads)
        if "code editing, turn 2" in names and "code editing" not in names:
            names.insert(0, "code editing")  # turn 2 continues turn 1's answers
        for workload, conversations in workloads(first_answers, args.prompts, names):
            for index, messages in enumerate(conversations):
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
                )["input_ids"]
                outputs = {}
                for mode, kwargs in modes.items():
                    kwargs = dict(kwargs)
                    model.reset_draft_store(
                        warm=kwargs.pop("warm_store", False)
                    )  # no mode learns from another's answer
                    per_position = kwargs.pop("blocks_per_position", False)
                    TailFit.blocks_fit = blocks_per_position if per_position else fitted
                    try:
                        out = model.generate(ids, max_new_tokens=args.max_new_tokens, **kwargs)
                    finally:
                        TailFit.blocks_fit = fitted
                    outputs[mode] = out.tolist()
                    s = model.last_generation_stats
                    runs.append(
                        Run(
                            delay_ms,
                            workload,
                            mode,
                            index,
                            s.new_tokens,
                            s.wall_time,
                            s.laps,
                            s.accepted_per_lap,
                            s.bytes_up,
                            s.bytes_down,
                            s.wall_time / max(s.laps, 1),
                            s.runs_cancelled,
                            s.positions_wasted,
                            s.turnaround_time,
                            s.hedge_hits,
                            s.hedge_time,
                            s.drafter_sources or None,
                            s.drafter_choices or None,
                            s.tree_laps,
                            s.tree_nodes,
                            s.tree_accepted,
                            dict(s.tree_sizes) or None,
                        )
                    )
                    print(
                        f"  {delay_ms:>4.0f} ms {workload:<12} #{index} {mode:<7} {s.new_tokens:>3} tok "
                        f"{s.tokens_per_second:6.1f} tok/s {s.laps:>3} laps {s.accepted_per_lap:4.2f} tok/lap",
                        flush=True,
                    )
                if len({json.dumps(o) for o in outputs.values()}) != 1:
                    print(f"  WARNING: modes disagree on prompt {index} ({workload}): a bug", flush=True)
                if workload == "code editing":
                    first_answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        model.shutdown()
    return runs


def summarize(runs: list[Run], servers: int) -> list[dict]:
    rows = []
    keys = sorted({(r.delay_ms, r.workload) for r in runs})
    for delay, workload in keys:
        group = [r for r in runs if r.delay_ms == delay and r.workload == workload]
        base = statistics.median(r.tokens / r.seconds for r in group if r.mode == "none")
        for mode in dict.fromkeys(r.mode for r in group):
            mine = [r for r in group if r.mode == mode]
            tps = statistics.median(r.tokens / r.seconds for r in mine)
            laps = sum(r.laps for r in mine)
            rows.append(
                dict(
                    delay_ms=delay,
                    workload=workload,
                    mode=mode,
                    tokens_per_s=tps,
                    ratio=tps / base,
                    tokens_per_lap=sum(r.tokens for r in mine) / laps,
                    lap_ms=1000 * statistics.median(r.lap_seconds for r in mine),
                    floor_ms=(servers + 1) * delay,
                    bytes_up_per_lap=sum(r.bytes_up for r in mine) / laps,
                    bytes_down_per_lap=sum(r.bytes_down for r in mine) / laps,
                    wasted_per_token=sum(r.positions_wasted for r in mine) / sum(r.tokens for r in mine),
                    client_ms_per_lap=1000 * sum(r.turnaround_seconds for r in mine) / laps,
                    hedge_hits_per_lap=sum(r.hedge_hits for r in mine) / laps,
                    **_source_acceptance(mine),
                    **_tree_sizes(mine),
                )
            )
    compute = {(r["workload"], r["mode"]): r["lap_ms"] for r in rows if r["delay_ms"] == 0}
    for r in rows:
        r["floor_plus_compute_ms"] = r["floor_ms"] + compute.get((r["workload"], r["mode"]), 0.0)
    return rows


def _source_acceptance(runs: list[Run]) -> dict:
    """Head-drafting modes: per source, the share of its proposed ids that matched the committed
    text and the ids it got right per proposal; and the share of laps that sent the head's drafts."""
    out = {}
    for source in ("tail", "retrieval"):
        stats = [r.sources[source] for r in runs if r.sources]
        if stats and sum(s[0] for s in stats):
            out[f"{source}_acceptance"] = sum(s[2] for s in stats) / max(1, sum(s[1] for s in stats))
            out[f"{source}_right_per_proposal"] = sum(s[2] for s in stats) / sum(s[0] for s in stats)
    choices = [r.choices for r in runs if r.choices]
    if choices:
        sent = sum(sum(c.values()) for c in choices)
        out["tail_share_of_laps"] = sum(c["tail"] for c in choices) / max(1, sent)
    return out


def _tree_sizes(runs: list[Run]) -> dict:
    """Tree modes: draft nodes sent and drafts accepted per lap, and the median and largest tree the
    cost model chose (client/_trees.py TreeSizer)."""
    laps = sum(r.tree_laps for r in runs)
    if not laps:
        return {}
    sizes = [int(size) for r in runs for size, count in (r.tree_sizes or {}).items() for _ in range(count)]
    return dict(
        tree_nodes_per_lap=sum(r.tree_nodes for r in runs) / laps,
        tree_accepted_per_lap=sum(r.tree_accepted for r in runs) / laps,
        tree_size_median=statistics.median(sizes),
        tree_size_max=max(sizes),
    )


def markdown(rows: list[dict]) -> str:
    head = (
        "| delay/hop | workload | mode | tokens/s (median) | vs none | tokens/lap | lap ms (median) "
        "| floor ms | floor+compute ms | bytes up/lap | bytes down/lap | wasted positions/token "
        "| client ms/lap | hedge hits/lap |\n|" + "---|" * 14
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['delay_ms']:.0f} ms | {r['workload']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x "
            f"| {r['tokens_per_lap']:.2f} | {r['lap_ms']:.0f} | {r['floor_ms']:.0f} | {r['floor_plus_compute_ms']:.0f} "
            f"| {r['bytes_up_per_lap']:.0f} | {r['bytes_down_per_lap']:.0f} | {r['wasted_per_token']:.2f} "
            f"| {r['client_ms_per_lap']:.2f} | {r['hedge_hits_per_lap']:.2f} |"
        )
    sourced = [r for r in rows if "head_acceptance" in r or "retrieval_acceptance" in r]
    if sourced:  # what each draft source got right, measured on every lap of the head-drafting modes
        lines += [
            "",
            "| delay/hop | workload | mode | head: ids right/proposed | head: right/proposal "
            "| retrieval: ids right/proposed | retrieval: right/proposal | laps sending tail drafts |",
            "|" + "---|" * 8,
        ]
        for r in sourced:
            cells = [
                f"{r.get(f'{s}_acceptance', 0):.2f} | {r.get(f'{s}_right_per_proposal', 0):.2f}"
                for s in ("tail", "retrieval")
            ]
            lines.append(
                f"| {r['delay_ms']:.0f} ms | {r['workload']} | {r['mode']} | {cells[0]} | {cells[1]} "
                f"| {r.get('head_share_of_laps', 0):.2f} |"
            )
    treed = [r for r in rows if "tree_nodes_per_lap" in r]
    if treed:  # what the tree modes sent: sizes chosen per lap by the cost model
        lines += [
            "",
            "| delay/hop | workload | mode | tree nodes/lap | drafts accepted/lap | median tree | largest tree |",
            "|" + "---|" * 7,
        ]
        for r in treed:
            lines.append(
                f"| {r['delay_ms']:.0f} ms | {r['workload']} | {r['mode']} | {r['tree_nodes_per_lap']:.1f} "
                f"| {r['tree_accepted_per_lap']:.2f} | {r['tree_size_median']:.0f} | {r['tree_size_max']} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=float, nargs="+", default=[0, 25, 50])
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--prompts", type=int, default=5, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    p.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "wan.json"))
    args = p.parse_args()
    modes = {m: MODES[m] for m in ["none"] + [m for m in args.modes if m != "none"]}
    began, commit = time.time(), _commit()  # the code as it ran, read before any later checkout or commit
    runs: list[Run] = []
    for delay in args.delays:
        print(f"== {delay:.0f} ms per hop ==", flush=True)
        runs += run_setting(args, delay, modes)
    rows = summarize(runs, args.servers)
    table = markdown(rows)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "commit": commit,
                "rows": rows,
                "runs": [asdict(r) for r in runs],
                "wall_seconds": time.time() - began,
            },
            indent=1,
        )
    )


def _commit() -> str:
    """The checkout's commit, so a result file says what it measured ("" outside a git checkout)."""
    try:
        here = Path(__file__).parent
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=here
        )
        return git.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except OSError:
        return ""


if __name__ == "__main__":
    main()
