"""Lying tails among honest ones, with the client's defaults (docs/reliability.md, "Lying tails: figures").

    python -m benchmarks.lying_tails --runs 10      # make bench-lies

SmolLM2-135M (30 blocks) on the smallest swarm with three servers of the last span: H (0:15), T and
U (15:30) honest, and per kind of lie a liar L (15:30) started through ``tests/kit/faulty_server.py``.
Each client's route is H -> L (``PreferredRoutes``: H -> T, then H -> U once L is excluded); the
verdict audits' shadow tail and the third server of a dispute are T and U. The client keeps every
default (looped runs, suffix drafting, verdict audits every 16 tokens, spot-checks at 1/50).

a) per kind, ``--runs`` greedy and ``--runs`` seeded-sampling generations of ``--tokens`` tokens
   (a fresh seed per run; the liar forgiven before each, every other exclusion kept across runs):
   equal to local transformers? the liar convicted (with ``--trusted T U``: convictions need a
   trusted server's word, docs/reliability.md "Disputes and witnesses") or disputed whenever it
   lied (its log counts its lies)? any honest server convicted, in any run? how many returned
   tokens were confirmed, and how many flagged unconfirmed? For the inflated claim: what the client
   measured of L against its claim, and whether the client's own router then leaves L;
b) detection: in every generation whose liar lied, the tokens generated from its first lie to the
   moment the generation left it (``re-verifying K generated tokens``);
c) cost: on the honest route H -> T, the verdict audits' server positions per generated token at
   contexts of ~100 and ~1,000 tokens (``--cost-tokens`` generated), against the old full-replay
   spot-check: its positions per audit (measured at rate 1) x its default rate 1/50 per verdict.
Writes ``benchmarks/results/lying_tails.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

SPANS = {"H": (0, 15), "T": (15, 30), "U": (15, 30)}
ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]
PROMPT = "The history of the printing press begins in"
LIE_AFTER = 24  # generated tokens before the "after" liar starts lying


def kinds(prompt_len: int) -> dict[str, list[str]]:
    """Each kind of liar: its tests/kit/faulty_server.py options."""
    return {
        "second choice, 30% of laps": ["--lie-in-verdicts", "0.3", "--lie", "second"],
        "random token, 30% of laps": ["--lie-in-verdicts", "0.3", "--lie", "random"],
        f"only after position {prompt_len + LIE_AFTER}": [
            "--lie-in-verdicts",
            "1",
            "--lie-after",
            str(prompt_len + LIE_AFTER),
        ],
        "only on short laps (<= 2 positions)": ["--lie-in-verdicts", "1", "--lie-short", "2"],
        "1% of laps": ["--lie-in-verdicts", "0.01"],
        "10% of laps": ["--lie-in-verdicts", "0.1"],
        "100% of laps": ["--lie-in-verdicts", "1"],
        "claims 10x its throughput": ["--claim-factor", "10"],
    }


def lies_in(log: Path) -> list[int]:
    """The positions of the lies a liar's log records so far."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [
        int(p) for p in re.findall(r"Fault injection: verdict on run \d+ says \d+, not \d+, at position (\d+)", text)
    ]


def left_at(events: list[str]) -> int | None:
    """Generated tokens when the generation left a convicted tail (its first re-verification)."""
    for event in events:
        found = re.search(r"re-verifying (\d+) generated tokens", event)
        if found:
            return int(found.group(1))
    return None


def wait_online(model, names, deadline: float) -> dict:
    from tests.kit.swarms import servers_by_name

    while True:
        records = servers_by_name(model, 30)
        if all(n in records and records[n].state == "online" for n in names):
            return records
        if time.monotonic() > deadline:
            raise RuntimeError(f"servers not online: {names}")
        time.sleep(1.0)


def connect(swarm, *routes, trusted=()):
    from swarm import AutoDistributedModelForCausalLM
    from tests.kit.routes import PreferredRoutes

    model = AutoDistributedModelForCausalLM.from_pretrained(
        "smollm2-135m", initial_peers=swarm.initial_peers, request_timeout=60.0
    )
    model.swarm.router = PreferredRoutes(*routes)
    model.trusted_names = list(trusted)  # public names: their peer ids are set once the servers are online
    return model


def one_kind(
    swarm, log_dir: Path, index: int, name: str, flags: list[str], prompt: list[int], references, args
) -> dict:
    import torch

    from client._swarm import ExclusionList
    from protocol.routing import MaxFlowRouter
    from tests.kit.faulty_server import faulty
    from tests.kit.reference import reference_sample  # noqa: F401  (references are made by the caller)

    liar = f"L{index}"
    process = swarm.start_server(15, 30, name=liar, launcher=faulty(*flags))
    model = connect(
        swarm,
        [("H", 0, 15), (liar, 15, 30)],
        [("H", 0, 15), ("T", 15, 30)],
        [("H", 0, 15), ("U", 15, 30)],
        trusted=args.trusted,
    )
    row: dict = {"kind": name, "flags": flags, "runs": []}
    try:
        records = wait_online(model, ["H", "T", "U", liar], time.monotonic() + 600)
        peer = records[liar].peer_id
        model.trusted_peers = frozenset(records[n].peer_id for n in model.trusted_names)
        honest = {records[n].peer_id: n for n in ("H", "T", "U")}
        log = log_dir / f"{liar}.log"
        for run in range(args.runs):
            for sampled in (False,) if args.greedy_only else (False, True):
                kept = model.swarm.excluded.banned - {peer}  # forgive L only: each run meets it afresh
                model.swarm.excluded = ExclusionList()
                for banned in kept:  # an honest server convicted in an earlier run stays convicted
                    model.swarm.excluded.ban(banned)
                before = len(lies_in(log))
                sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1000 + run) if sampled else {}
                began = time.perf_counter()
                out = model.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, **sampling)
                stats = model.last_generation_stats
                lies = lies_in(log)[before:]
                expected = references(1000 + run if sampled else None)
                first_lie = min(lies) - len(prompt) if lies else None
                left = left_at(stats.spot_check_events)
                row["runs"].append(
                    {
                        "sampled": sampled,
                        "exact": out[0, len(prompt) :].tolist() == expected,
                        "lies": len(lies),
                        "convicted": peer in stats.liars_excluded,
                        "disputed": peer in stats.disputed_peers,
                        "honest_convicted": sorted(honest[p] for p in stats.liars_excluded if p in honest),
                        "honest_disputed": sorted(honest[p] for p in stats.disputed_peers if p in honest),
                        "tokens_confirmed_trusted": stats.tokens_confirmed_trusted,
                        "tokens_confirmed_untrusted": stats.tokens_confirmed_untrusted,
                        "tokens_unconfirmed": stats.tokens_unconfirmed,
                        "first_lie_token": first_lie,
                        "left_at_token": left,
                        "detection_tokens": None if left is None or first_lie is None else left - first_lie,
                        "new_tokens": stats.new_tokens,
                        "laps": stats.laps,
                        "laps_timed": stats.laps_timed,
                        "verdict_audits": stats.verdict_audits,
                        "verdict_audit_positions": stats.verdict_audit_positions,
                        "tokens_retracted": stats.tokens_retracted,
                        "failovers": stats.failovers,
                        "seconds": round(time.perf_counter() - began, 2),
                    }
                )
                print(f"  {name} run {run} {'sampled' if sampled else 'greedy'}: {row['runs'][-1]}", flush=True)
        if "--claim-factor" in flags:
            claim = records[liar].throughput
            measured = model.swarm.meter.measured()
            row["claim"] = claim
            row["measured"] = {n: measured.get(records[n].peer_id) for n in ("H", liar)}
            model.swarm.router = MaxFlowRouter()  # the client's own router, on what it measured
            model.generate(torch.tensor([prompt]), max_new_tokens=8)
            row["next_route_tail_is_liar"] = model.last_generation_stats.route[-1][0] == peer
            print(
                f"  {name}: claim {claim:.1f}, measured {row['measured']}, next route's tail is L: "
                f"{row['next_route_tail_is_liar']}",
                flush=True,
            )
        row["honest_banned_after_all_runs"] = sorted(honest[p] for p in model.swarm.liars if p in honest)
        row["honest_reported_after_all_runs"] = sorted(honest[p] for p in model.swarm.reports if p in honest)
    finally:
        model.shutdown()
        from swarm.local import kill_group

        kill_group(process)
    return row


def cost(swarm, tokenizer, args) -> list[dict]:
    """Server positions the audits cost per generated token on the honest route H -> T."""
    import torch

    from tests.kit.prompts import CODE_EDITING, OPEN_CHAT

    text = "\n\n".join(CODE_EDITING + OPEN_CHAT)
    ids = tokenizer(text)["input_ids"]
    while len(ids) < 1000:
        ids = ids + ids
    rows = []
    model = connect(swarm, [("H", 0, 15), ("T", 15, 30)])
    try:
        wait_online(model, ["H", "T", "U"], time.monotonic() + 600)
        for context in (100, 1000):
            prompt = torch.tensor([ids[:context]])
            model.generate(prompt, max_new_tokens=args.cost_tokens, spot_check_rate=0.0)  # verdict audits alone
            new = model.last_generation_stats
            model.verdict_audit_every = 0  # the old audit alone, at rate 1 to count its positions per audit
            model.generate(prompt, max_new_tokens=8, spot_check_rate=1.0)
            old = model.last_generation_stats
            model.verdict_audit_every = 16
            per_audit = old.spot_check_positions / max(1, sum(1 for e in old.spot_check_events if ": agree" in e))
            rows.append(
                {
                    "context": context,
                    "new_tokens": new.new_tokens,
                    "laps": new.laps,
                    "hops": len(new.route),
                    "verdict_audits": new.verdict_audits,
                    "verdict_audit_positions": new.verdict_audit_positions,
                    "verdict_positions_per_token": new.verdict_audit_positions / max(1, new.new_tokens),
                    "verdict_positions_per_token_after_prefill": (
                        new.verdict_audit_positions - (context - 1) * len(new.route)
                    )
                    / max(1, new.new_tokens),
                    "spot_check_positions_per_audit": per_audit,
                    "spot_check_events": old.spot_check_events,
                    "old_positions_per_lap_at_1_50": per_audit / 50,
                    "old_positions_per_token_at_1_50": per_audit / 50 * new.laps / max(1, new.new_tokens),
                }
            )
            print(f"  cost at {context} tokens of context: {rows[-1]}", flush=True)
    finally:
        model.shutdown()
    return rows


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for row in rows:
        runs = row["runs"]
        lied = [r for r in runs if r["lies"]]
        greedy = [r for r in runs if not r["sampled"]]
        summary[row["kind"]] = {
            "exact": f"{sum(r['exact'] for r in runs)} of {len(runs)}",
            "greedy_exact": f"{sum(r['exact'] for r in greedy)} of {len(greedy)}",
            "sampled_exact": f"{sum(r['exact'] for r in runs if r['sampled'])} of {sum(r['sampled'] for r in runs)}",
            "convicted_when_it_lied": f"{sum(r['convicted'] for r in lied)} of {len(lied)}",
            "convicted_when_honest": sum(r["convicted"] for r in runs if not r["lies"]),
            "disputed_when_it_lied": f"{sum(r['disputed'] for r in lied)} of {len(lied)}",
            "honest_convictions_all_runs": sum(len(r["honest_convicted"]) for r in runs),
            "honest_banned_after_all_runs": row.get("honest_banned_after_all_runs", []),
            "honest_reported_after_all_runs": row.get("honest_reported_after_all_runs", []),
            "tokens_unconfirmed": sum(r["tokens_unconfirmed"] for r in runs),
            "tokens_returned": sum(r["new_tokens"] for r in runs),
        }
        if "claim" in row:
            summary[row["kind"]].update(
                claim=row["claim"], measured=row["measured"], next_route_tail_is_liar=row["next_route_tail_is_liar"]
            )
    delays = [r["detection_tokens"] for row in rows for r in row["runs"] if r["detection_tokens"] is not None]
    if delays:
        summary["detection_tokens"] = {
            "n": len(delays),
            "median": statistics.median(delays),
            "max": max(delays),
            "all": sorted(delays),
        }
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="greedy and seeded-sampling generations per kind, each")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--kinds", nargs="*", help="only the kinds whose name contains one of these, in this order")
    p.add_argument("--greedy-only", action="store_true", help="no seeded-sampling generations")
    p.add_argument("--cost-tokens", type=int, default=64)
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--trusted", nargs="*", default=[], help="honest servers the client trusts, by name (T, U)")
    p.add_argument("--out", default="benchmarks/results/lying_tails.json")
    args = p.parse_args()

    from benchmarks.smol_reference import smollm2_references
    from swarm.local import LocalSwarm

    tokenizer, reference, prompt, references = smollm2_references(PROMPT, args.tokens)

    log_dir = Path(tempfile.mkdtemp(prefix="lying-tails-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {
        "commit": commit,
        "runs": args.runs,
        "tokens": args.tokens,
        "prompt_tokens": len(prompt),
        "kinds": [],
    }
    began = time.perf_counter()
    with LocalSwarm(
        "smollm2-135m", spans=list(SPANS.values()), names=list(SPANS), server_args=ARGS, log_dir=str(log_dir)
    ) as swarm:
        if not args.skip_cost:
            result["cost"] = cost(swarm, tokenizer, args)
        table = kinds(len(prompt))
        chosen = [n for k in args.kinds for n in table if k in n] if args.kinds else list(table)  # in --kinds order
        for index, name in enumerate(dict.fromkeys(chosen)):
            flags = table[name]
            result["kinds"].append(one_kind(swarm, log_dir, index, name, flags, prompt, references, args))
            result["summary"] = summarize(result["kinds"])
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    result["summary"] = summarize(result["kinds"])
    result["seconds"] = round(time.perf_counter() - began)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    if "cost" in result:
        print(json.dumps([{k: v for k, v in r.items() if k != "spot_check_events"} for r in result["cost"]], indent=1))


if __name__ == "__main__":
    main()
