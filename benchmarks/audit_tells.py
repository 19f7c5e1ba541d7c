"""What a tail can tell of an audit from the verdicts it computes (docs/reliability.md, "Audits look like
live laps"; issue 35).

    python -m benchmarks.audit_tells --tokens 128      # make bench-audit-tells

SmolLM2-135M (30 blocks): a head H (0:15) and two tails (15:30), T and R, all honest; R records what it
sees of every Step it verifies, with the verdict it computed (tests/kit/faults.py ``record_verdicts``).
Per prompt, greedy, with the client's defaults, four generations: live on H -> R (T its only witness),
then live on H -> T (R its only witness: R's sessions are audits), once as the client runs, once with an
audit after every live lap (``paced``: ``verdict_audit_every=1``, the alternative to an audit every 16
tokens measured for timing) and once with the shadow's drafts the committed tokens (``committed_only``, the
client before 2026-12-06). Audit
Steps copy what a tail sees of a live lap (draft counts, ``loop_runs``, ``max_length``, top log-probs)
and now replay the live laps' own drafts, rejected ones too (client/_audit_shape.py ``drafts_at``).
With committed tokens as drafts an honest tail accepted every draft of every audit Step, where a live
lap's drafts are guesses: a tell no Step's shape hides, measured here.

Counted, over sessions of more than one Step (the live ones; the shadows'; a spot-check's session has
one Step, counted apart, and verifies on the live route too): drafted Steps (a Step with at least one
draft, looped runs included) and the share fully accepted, live against audit; sessions with at least
``--streak`` drafted Steps, every one fully accepted (the detector a framer could run:
tests/kit/faults.py ``frame(by_acceptance=True)``), live against audit; and timing (``timing``): each
session's gaps between Steps, and the sessions whose longest gap is more than ``--burst`` times their median,
a detector a tail could run for audits that idle between bursts. ``--hop-delay-ms D`` puts every server
behind a delay proxy (D ms a hop). Writes ``benchmarks/results/audit_tells.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.lying_tails import connect, wait_online

PACED_EVERY = 1  # the alternative measured: an audit after every live lap (once the last one ended)
ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]
PROMPTS = [  # the demo's (code), a plain continuation, and two chat turns (the instruct model's template)
    (Path(__file__).parent / "demo_prompt.txt").read_text(),
    "The history of the printing press begins in",
    [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
    [{"role": "user", "content": "List the planets of the solar system in order, with one fact about each."}],
]


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"])


def sessions(path: Path) -> dict[str, list[dict]]:
    """R's recorded Steps by session, in order."""
    by_session: dict[str, list[dict]] = defaultdict(list)
    if path.exists():
        for line in path.read_text().splitlines():
            step = json.loads(line)
            by_session[step["session"]].append(step)
    return dict(by_session)


def committed_only(self, ids: list[int], position: int, rng, room: int) -> list[int]:
    """``LiveShape.drafts_at`` before 2026-12-06: a live lap's count of committed tokens."""
    return list(ids[position : position + self.draft_count(rng, min(room, len(ids) - position))])


def accepted_share(drafted: list[dict]) -> float:
    return round(sum(s["accepted"] for s in drafted) / max(1, sum(s["n_draft"] for s in drafted)), 3)


def summary(by_session: dict[str, list[dict]], streak: int) -> dict:
    """Drafted Steps, the share fully accepted, and sessions the acceptance detector flags."""
    drafted = [s for steps in by_session.values() for s in steps if s["n_draft"] > 0]
    full = [s for s in drafted if s["accepted"] == s["n_draft"]]
    long_enough = {k: [s for s in v if s["n_draft"] > 0] for k, v in by_session.items()}
    long_enough = {k: v for k, v in long_enough.items() if len(v) >= streak}
    flagged = [k for k, v in long_enough.items() if all(s["accepted"] == s["n_draft"] for s in v)]
    return {
        "sessions": len(by_session),
        "steps": sum(len(v) for v in by_session.values()),
        "drafted_steps": len(drafted),
        "fully_accepted": len(full),
        "fully_accepted_share": round(len(full) / len(drafted), 3) if drafted else None,
        "drafts_accepted_share": accepted_share(drafted),
        f"sessions_with_{streak}_drafted_steps": len(long_enough),
        "flagged_by_acceptance": len(flagged),
    }


def timing(by_session: dict[str, list[dict]], burst: float) -> dict:
    """The timing a tail sees, over sessions of at least four Steps: each one's longest gap between two Steps
    against its median gap. A session that idles between bursts of laps (audits every 16 tokens) has a long
    gap where a live one laps on; flagged: the longest gap more than ``burst`` times the median (live sessions
    are counted alike: what flags them too tells nothing)."""
    ratios, shapes = [], []
    for steps in by_session.values():
        at = [s["at"] for s in steps if "at" in s]
        gaps = sorted(b - a for a, b in zip(at, at[1:]))
        if len(gaps) >= 3 and gaps[len(gaps) // 2] > 0:
            ratios.append(gaps[-1] / gaps[len(gaps) // 2])
            quantiles = [round(gaps[int(q * (len(gaps) - 1))], 3) for q in (0.1, 0.5, 0.9, 1.0)]
            shapes.append({"steps": len(at), "span_s": round(at[-1] - at[0], 2), "gap_quantiles_s": quantiles})
    ratios.sort()
    return {
        "sessions_timed": len(ratios),
        "median_longest_to_median_gap": round(ratios[len(ratios) // 2], 2) if ratios else None,
        "largest_longest_to_median_gap": round(ratios[-1], 2) if ratios else None,
        f"flagged_by_timing_over_{burst:g}x": sum(r > burst for r in ratios),
        "sessions_gaps": shapes,  # per session: Steps, first to last (s), gaps at 10/50/90/100%
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96, help="new tokens per generation")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--streak", type=int, default=2, help="drafted Steps a session needs before the detector judges it")
    p.add_argument("--burst", type=float, default=4.0, help="the timing detector: longest gap over median gap")
    p.add_argument("--hop-delay-ms", type=float, default=0.0, help="each server behind a delay proxy (WAN emulation)")
    p.add_argument("--out", default="benchmarks/results/audit_tells.json")
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from client._audit_shape import LiveShape
    from client._verdict_audits import DEFAULT_AUDIT_EVERY
    from protocol.models import ensure_smollm2_checkpoint
    from swarm.local import LocalSwarm
    from tests.kit.faulty_server import faulty

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    log_dir = Path(tempfile.mkdtemp(prefix="audit-tells-"))
    record = log_dir / "steps.jsonl"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {"commit": commit, "tokens": args.tokens, "streak": args.streak, "log_dir": str(log_dir)}
    result |= {"hop_delay_ms": args.hop_delay_ms, "audit_every": DEFAULT_AUDIT_EVERY, "paced_every": PACED_EVERY}
    live: dict[str, list[dict]] = {}
    audits: dict[str, list[dict]] = {}
    before: dict[str, list[dict]] = {}
    paced: dict[str, list[dict]] = {}
    replayed = LiveShape.drafts_at
    runs = []
    began = time.perf_counter()
    delay = args.hop_delay_ms
    with LocalSwarm("smollm2-135m", spans=[], server_args=ARGS, log_dir=str(log_dir), hop_delay_ms=delay) as swarm:
        swarm.start_server(0, 15, name="H")
        swarm.start_server(15, 30, name="T")
        swarm.start_server(15, 30, name="R", launcher=faulty("--record-steps", str(record)))
        phases = (
            ("live", "R", live, False, DEFAULT_AUDIT_EVERY),
            ("audit", "T", audits, False, DEFAULT_AUDIT_EVERY),
            ("paced", "T", paced, False, PACED_EVERY),
            ("before", "T", before, True, DEFAULT_AUDIT_EVERY),
        )
        for phase, tail, into, committed, every in phases:
            LiveShape.drafts_at = committed_only if committed else replayed
            model = connect(swarm, [("H", 0, 15), (tail, 15, 30)])
            model.verdict_audit_every = every
            wait_online(model, ["H", "T", "R"], time.monotonic() + 600)
            for index, prompt in enumerate(PROMPTS[: args.prompts]):
                record.unlink(missing_ok=True)
                ids = prompt_ids(tokenizer, prompt)
                started = time.perf_counter()
                out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens)
                stats = model.last_generation_stats
                into.update({f"{index}:{k}": v for k, v in sessions(record).items()})
                runs.append(
                    {
                        "phase": phase,
                        "prompt": index,
                        "new_tokens": len(out[0]) - len(ids),
                        "verdict_audits": stats.verdict_audits,
                        "spot_checks": stats.spot_checks,
                        "disputed": len(stats.disputed_peers),
                        "verdict_audit_positions": stats.verdict_audit_positions,
                        "seconds": round(time.perf_counter() - started, 2),
                        "output": out[0, len(ids) :].tolist(),
                    }
                )
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "output"}), flush=True)
            model.shutdown()
    result["runs"] = runs
    outputs: dict[int, list] = defaultdict(list)
    for run in runs:
        outputs[run["prompt"]].append(run["output"])
    result["same_output_in_every_phase"] = all(all(o == v[0] for o in v) for v in outputs.values())
    for phase, by_session in (("live", live), ("audit", audits), ("paced", paced), ("before", before)):
        laps = {k: v for k, v in by_session.items() if len(v) > 1}
        result[phase] = summary(laps, args.streak)  # the live sessions; the shadows' (pool, last audit)
        result[phase] |= timing(laps, args.burst)
        # one Step each: spot-checks (in the live phase too: they verify on the live route as well)
        result[f"{phase}_one_step_sessions"] = summary({k: v for k, v in by_session.items() if len(v) == 1}, 1)
    result["seconds"] = round(time.perf_counter() - began)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    shown = ("live", "audit", "paced", "before", "same")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(shown)}, indent=1))


if __name__ == "__main__":
    main()
