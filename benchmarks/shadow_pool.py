"""What the witness pool costs (docs/reliability.md, "Witnesses of the pool"; issue 35).

    python -m benchmarks.shadow_pool --runs 4      # make bench-shadow-pool

Every verdict audit is verified by each witness of a pool of up to ``SHADOW_POOL`` (6; 3 before 2026-12-06)
independent tails (client/_shadow_turns.py), where one shadow was kept a generation before. This
measures what that costs on an honest swarm, side by side in one run: SmolLM2-135M (30 blocks), a head
H (0:15) and four honest tails T, U, V, W (15:30), one client (its route H -> T), greedy generations of
``--tokens`` tokens with the client's defaults (verdict audits every 16 tokens, spot-checks 1/50,
looped runs, suffix drafting), in three modes taken in turn in every round, so the machine's load falls
on each alike:

- ``pool of 6``: the default (``--pools``: one mode per pool size; 6 and 3 unless given);
- ``pool of 3``: ``audit_witnesses=3``, the default before 2026-12-06 (``pool of 1``: the old one-shadow audit);
- ``no verdict audits``: ``verdict_audit_every=0``.

``--tails N --pools 5 3 1`` runs N honest tails (N - 1 candidates beside the live one) and a pool of
each size given (``pool of 5``: with six tails, every candidate verifies every window, the cost of
``audit_witnesses`` set to the number of candidates). ``--pool-alone-last`` adds, for each pool, a mode
``pool of k, last audit by the pool`` whose last audit is verified by the pool alone (what the client did
before 2026-12-05: ``pool_alone``), where the default has every candidate
up to ``LAST_AUDIT_WITNESSES`` verify the last audit's window. ``--hop-delay-ms D`` puts every server behind a
delay proxy (D ms per hop, as benchmarks/wan.py), where the last audit's laps are round trips as the live
ones. ``--committed-drafts`` adds, for each pool,
a mode ``pool of k, committed drafts`` whose audit Steps carry committed tokens as drafts (the client
before 2026-12-06: benchmarks/audit_tells.py ``committed_only``), where the default replays the live
laps' own drafts, rejected ones too. ``--every 1 4`` adds, for each pool, a mode ``pool of k, audits every N``
(``verdict_audit_every=N``; the default is 16). ``--lap-costs F P`` fixes the drafts per lap alike in every
mode (``draft_lap_costs``): otherwise the cost model fits them on timed laps, and a lap beside an audit is
not timed, so modes whose audits run all the time draft as many as ``num_draft_tokens`` allows and the
others fewer, a difference in laps that is not the audits' (``laps``: the median live laps).

Per mode: the median wall time of ``generate()`` (audits in the background, but the last window's
audits run before it returns), the server positions the audits computed per generated token
(``verdict_audit_positions``), and that every output is the same. Writes
``benchmarks/results/shadow-pool.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.lying_tails import wait_online

ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]
PROMPT = "The history of the printing press begins in"
TAIL_NAMES = ("T", "U", "V", "W", "X", "Y", "Z")


def pool_alone(self, route, length, found=None) -> int:
    """The last audit by the pool alone (``--pool-alone-last``): what the client did before 2026-12-05."""
    return self.pool


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=4, help="rounds; each runs every mode once")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--tails", type=int, default=4, help=f"honest tails, 2 to {len(TAIL_NAMES)} (T is the live one)")
    p.add_argument("--pools", type=int, nargs="+", default=[6, 3], help="audit_witnesses, one mode each")
    p.add_argument("--pool-alone-last", action="store_true", help="each pool also with its last audit by the pool")
    p.add_argument(
        "--committed-drafts", action="store_true", help="each pool also with the committed tokens as audit drafts"
    )
    p.add_argument(
        "--every",
        type=int,
        nargs="+",
        default=[],
        help="each pool also with verdict audits every N tokens (16 is the default)",
    )
    p.add_argument(
        "--lap-costs",
        type=float,
        nargs=2,
        default=None,
        help="draft_lap_costs (fixed_s, per_position_s) in every mode: drafts per lap set alike, not by timed laps",
    )
    p.add_argument("--hop-delay-ms", type=float, default=0.0, help="each server behind a delay proxy (WAN emulation)")
    p.add_argument("--out", default="benchmarks/results/shadow-pool.json")
    args = p.parse_args()
    if not 2 <= args.tails <= len(TAIL_NAMES) or any(k < 1 for k in args.pools):
        p.error(f"--tails must be in 2..{len(TAIL_NAMES)} and every pool at least 1")
    tails = TAIL_NAMES[: args.tails]
    witnesses = {f"pool of {k}": k for k in args.pools}
    if args.pool_alone_last:
        witnesses |= {f"pool of {k}, last audit by the pool": k for k in args.pools}
    if args.committed_drafts:
        witnesses |= {f"pool of {k}, committed drafts": k for k in args.pools}
    every: dict[str, int] = {}  # mode -> verdict_audit_every, where not the default 16
    for k in args.pools:
        for n in args.every:
            mode = f"pool of {k}, audits every {n}"
            witnesses[mode], every[mode] = k, n
    witnesses |= {"no verdict audits": 3}
    modes = tuple(witnesses)
    import subprocess

    import torch
    from transformers import AutoTokenizer

    from benchmarks.audit_tells import committed_only
    from client import _shadow_turns
    from client._audit_shape import LiveShape
    from protocol.models import ensure_smollm2_checkpoint
    from swarm import AutoDistributedModelForCausalLM
    from swarm.local import LocalSwarm
    from tests.kit.routes import PreferredRoutes

    last_default, replayed = _shadow_turns.LAST_AUDIT_WITNESSES, LiveShape.drafts_at
    last_witnesses = _shadow_turns.ShadowTurns._last_audit_witnesses

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    log_dir = Path(tempfile.mkdtemp(prefix="shadow-pool-"))
    delay = args.hop_delay_ms
    costs = {"draft_lap_costs": tuple(args.lap_costs)} if args.lap_costs else {}
    with LocalSwarm("smollm2-135m", spans=[], server_args=ARGS, log_dir=str(log_dir), hop_delay_ms=delay) as swarm:
        swarm.start_server(0, 15, name="H")
        for name in tails:
            swarm.start_server(15, 30, name=name)
        model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
        try:
            wait_online(model, ["H", *tails], time.monotonic() + 600)
            model.swarm.router = PreferredRoutes([("H", 0, 15), ("T", 15, 30)])
            model.generate(prompt, max_new_tokens=8)  # warm-up: connections, caches, first routing
            for run in range(args.runs):
                for mode in modes:
                    model.verdict_audit_every = 0 if mode == "no verdict audits" else every.get(mode, 16)
                    by_the_pool = mode.endswith("by the pool")
                    _shadow_turns.ShadowTurns._last_audit_witnesses = pool_alone if by_the_pool else last_witnesses
                    LiveShape.drafts_at = committed_only if mode.endswith("committed drafts") else replayed
                    start = time.perf_counter()
                    with torch.no_grad():
                        out = model.generate(
                            prompt, max_new_tokens=args.tokens, audit_witnesses=witnesses[mode], **costs
                        )
                    seconds = time.perf_counter() - start
                    stats = model.last_generation_stats
                    new = out[0, prompt.shape[1] :].tolist()
                    row = {
                        "seconds": seconds,
                        "tokens": new,
                        "audit_positions_per_token": stats.verdict_audit_positions / max(1, len(new)),
                        "verdict_audits": stats.verdict_audits,
                        "laps": stats.laps,
                        "tokens_confirmed_untrusted": stats.tokens_confirmed_untrusted,
                        "tokens_unconfirmed": stats.tokens_unconfirmed,
                        "disputed": list(stats.disputed_peers),
                    }
                    rows[mode].append(row)
                    short = {k: v for k, v in row.items() if k != "tokens"}
                    print(f"run {run} {mode}: {short}", flush=True)
        finally:
            model.shutdown()
    outputs = {json.dumps(r["tokens"]) for mode in modes for r in rows[mode]}

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    baseline = median("no verdict audits", "seconds")
    summary = {
        mode: {
            "median_seconds": round(median(mode, "seconds"), 2),
            "ratio_to_no_audits": round(median(mode, "seconds") / baseline, 3),
            "audit_positions_per_token": round(median(mode, "audit_positions_per_token"), 2),
            "median_laps": median(mode, "laps"),
            "tokens_confirmed_untrusted": sum(r["tokens_confirmed_untrusted"] for r in rows[mode]),
            "tokens_unconfirmed": sum(r["tokens_unconfirmed"] for r in rows[mode]),
            "runs_with_a_dispute": sum(bool(r["disputed"]) for r in rows[mode]),
        }
        for mode in modes
    }
    result = {"commit": commit, "runs": args.runs, "tokens": args.tokens, "tails": args.tails, "hop_delay_ms": delay}
    result["last_audit_witnesses"] = last_default
    result["same_output"] = len(outputs) == 1
    result |= {"summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
