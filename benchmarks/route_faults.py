"""Hostile hops that are not a lying tail, with the client's defaults (docs/reliability.md, "Hops that shield,
renumber or opt out: figures"; issue 35).

    python -m benchmarks.route_faults --runs 10      # make bench-route-faults

SmolLM2-135M (30 blocks): honest H (0:15) on 127.0.2.1, T (15:30) on 127.0.0.1 and U (15:30) on 127.0.3.1,
always on; per scenario one or two hostile servers, each on an address of its own, started through
``tests/kit/faulty_server.py``. Every generation is made by a fresh client (``--request-timeout``, 15 s by
default: the stall a shielding head causes costs one timeout) that keeps every other default; routes prefer
the hostile servers. The client groups loopback addresses by /24 as it groups public ones (as
benchmarks/sybils.py does). Scenarios:

1. A shielding head SH (``--shield``: it drops every Step of a session that repeats the first ids of one
   open there, which to a hop is an audit) before the honest T; then before a lying tail L (the model's
   second choice in every verdict from position 32), the attack the shield is for. ``--no-detour`` runs
   them again with the client's detour (client/_shadow_detour.py) turned off in this process: what the
   client did before it.
2. A unique-precision liar: L announces bfloat16 where every other tail serves float32 and lies as above;
   nobody can audit it. Then under ``audit="required"``.
3. A hop that renumbers runs: RH (0:15) forwards every run N as N + 1 (``--rewrite-field-file`` naming
   ``run_id``); the client fails over to H.
4. A two-faced head TF (0:15, ``--lie-unless-repeated offset``): it adds 0.5 to its activations in every
   session but those that repeat an open one's first ids, so the live session is lied to and every audit
   (shadow, spot-check, evidence) sees an honest head. With the defaults; then with verdict audits off
   (``verdict_audit_every=0``: the spot-checks alone, whose replay is compared with the live lap).

Counted per run: output equal to local transformers, raised, tokens unconfirmed (flagged), wrong tokens
not flagged, failovers, failed audits and detours, and which honest server (H, T, U) was convicted,
excluded or disputed. Writes ``benchmarks/results/route-faults.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.lying_tails import wait_online
from benchmarks.sybils import ARGS, LIE_AFTER, PROMPT, end_scenario, forget, loopback_by_prefix, one_run

HONEST = {"H": ((0, 15), "127.0.2.1"), "T": ((15, 30), "127.0.0.1"), "U": ((15, 30), "127.0.3.1")}
LIE = ["--lie-in-verdicts", "1", "--lie-after", str(LIE_AFTER)]


def plan(control: Path) -> list[dict]:
    """Each scenario: title, hostile servers (name -> span, host, fault flags, server flags), routes, kwargs."""
    shield = {"SH": ((0, 15), "127.0.21.1", ["--shield"], [])}
    liar = {"L": ((15, 30), "127.0.22.1", LIE, [])}
    bf16_liar = {"L": ((15, 30), "127.0.23.1", LIE, ["--dtype", "bfloat16"])}
    renumber = {"RH": ((0, 15), "127.0.24.1", ["--rewrite-field-file", str(control)], [])}
    two_faced = {"TF": ((0, 15), "127.0.25.1", ["--lie-unless-repeated", "offset"], [])}
    return [
        dict(title="1. a shielding head before T", hostile=shield, routes=[["SH", "T"], ["H", "T"]]),
        dict(
            title="1. a shielding head before a lying tail",
            hostile={**shield, **liar},
            routes=[["SH", "L"], ["SH", "T"], ["H", "T"]],
        ),
        dict(title="2. a unique-precision liar", hostile=bf16_liar, routes=[["H", "L"], ["H", "T"]]),
        dict(
            title="2. a unique-precision liar, audit=required",
            hostile=bf16_liar,
            routes=[["H", "L"], ["H", "T"]],
            generate_kwargs={"audit": "required"},
        ),
        dict(title="3. a hop that renumbers runs", hostile=renumber, routes=[["RH", "T"], ["H", "T"]]),
        dict(title="4. a two-faced head", hostile=two_faced, routes=[["TF", "T"], ["H", "T"], ["H", "U"]]),
        dict(
            title="4. a two-faced head, spot-checks alone",
            hostile=two_faced,
            routes=[["TF", "T"], ["H", "T"], ["H", "U"]],
            client_kwargs={"verdict_audit_every": 0},
        ),
    ]


def connect(swarm, excluded: set, routes, spans: dict, request_timeout: float, client_kwargs=None):
    """A fresh client routed over ``routes`` (server names, first preferred; ``spans``: name -> blocks),
    banning ``excluded``."""
    from swarm import AutoDistributedModelForCausalLM
    from tests.kit.routes import PreferredRoutes

    model = AutoDistributedModelForCausalLM.from_pretrained(
        "smollm2-135m", initial_peers=swarm.initial_peers, request_timeout=request_timeout, **(client_kwargs or {})
    )
    records = wait_online(model, list(spans), time.monotonic() + 600)
    model.swarm.router = PreferredRoutes(*[[(n, *spans[n]) for n in route] for route in routes])
    forget(model, excluded)
    return model, {n: records[n].peer_id for n in spans}


def scenario(
    swarm, title, hostile, routes, prompt, references, args, suffix, generate_kwargs=None, client_kwargs=None
) -> dict:
    from tests.kit.faulty_server import faulty

    processes, renamed = [], {}
    spans = {name: span for name, (span, _) in HONEST.items()}
    for name, ((a, b), host, flags, extra) in hostile.items():
        renamed[name] = unique = f"{name}{suffix}"  # a stopped server's record outlives it in the DHT
        spans[unique] = (a, b)
        launcher = faulty(*flags)
        processes.append(swarm.start_server(a, b, name=unique, launcher=launcher, extra=["--host", host, *extra]))
    routes = [[renamed.get(n, n) for n in route] for route in routes]
    excluded: set = set()  # convictions, kept across every run of the scenario
    hosts = {renamed[n]: {"span": h[0], "host": h[1], "faults": h[2], "server_flags": h[3]} for n, h in hostile.items()}
    row: dict = {"scenario": title, "hostile": hosts, "client_kwargs": client_kwargs or {}, "runs": []}
    try:
        for run in range(args.runs):
            for sampled in (False, True):
                seed = 1000 + run
                model, peers = connect(swarm, excluded, routes, spans, args.request_timeout, client_kwargs)
                try:
                    kwargs = dict(generate_kwargs or {})
                    result = one_run(model, peers, prompt, references(seed if sampled else None), sampled, seed, kwargs)
                    stats = model.last_generation_stats
                    honest = {peers[n]: n for n in HONEST}
                    result.update(
                        verdict_audits_failed=stats.verdict_audits_failed,
                        verdict_audit_detours=stats.verdict_audit_detours,
                        spot_checks=stats.spot_checks,
                        spot_checks_diverged=stats.spot_checks_diverged,
                        failover_events=stats.failover_events[-3:],
                        honest_excluded=sorted(honest[p] for p in model.swarm.excluded.current() if p in honest),
                    )
                    excluded |= model.swarm.excluded.banned
                finally:
                    model.shutdown()
                row["runs"].append(result)
                short = {k: v for k, v in result.items() if k not in ("events", "groups", "failover_events")}
                print(f"  {title} run {run} {'sampled' if sampled else 'greedy'}: {short}", flush=True)
    finally:
        end_scenario(swarm, None, processes)
    return row


def summarize(row: dict) -> dict:
    runs = row["runs"]
    done = [r for r in runs if r["raised"] is None]
    honest = set(HONEST)
    return {
        "exact": f"{sum(bool(r['exact']) for r in done)} of {len(runs)}",
        "raised": sum(r["raised"] is not None for r in runs),
        "runs_flagged": sum(r["flag_warning"] for r in runs),
        "tokens_returned": sum(r["new_tokens"] for r in done),
        "tokens_unconfirmed_flagged": sum(r["tokens_unconfirmed"] for r in done),
        "wrong_tokens_not_flagged": sum(r["wrong_tokens_not_flagged"] or 0 for r in done),
        "runs_honest_convicted": sum(bool(set(r["convicted"]) & honest) for r in runs),
        "runs_honest_excluded": sum(bool(r["honest_excluded"]) for r in runs),
        "runs_honest_disputed": sum(bool(set(r["disputed"]) & honest) for r in runs),
        "runs_hostile_disputed_or_convicted": sum(bool(set(r["disputed"] + r["convicted"]) - honest) for r in runs),
        "runs_with_failover": sum(bool(r["failovers"]) for r in runs),
        "verdict_audits_failed": sum(r["verdict_audits_failed"] for r in runs),
        "runs_detoured": sum(bool(r["verdict_audit_detours"]) for r in runs),
        "spot_checks": sum(r.get("spot_checks", 0) for r in runs),
        "runs_spot_check_diverged": sum(bool(r.get("spot_checks_diverged")) for r in runs),
        "median_seconds": sorted(r["seconds"] for r in runs)[len(runs) // 2] if runs else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="greedy and seeded-sampling generations per scenario, each")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--request-timeout", type=float, default=15.0)
    p.add_argument("--only", nargs="*", help="only the scenarios whose title contains one of these")
    p.add_argument("--no-detour", action="store_true", help="scenario 1 also with the detour off (the old client)")
    p.add_argument("--out", default="benchmarks/results/route-faults.json")
    args = p.parse_args()

    from client import _shadow_turns, _witnesses
    from swarm.local import LocalSwarm

    _witnesses.machine_group = loopback_by_prefix(_witnesses.machine_group)
    from benchmarks.smol_reference import smollm2_references

    tokenizer, reference, prompt, references = smollm2_references(PROMPT, args.tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="route-faults-"))
    control = log_dir / "rewrite-field"
    control.write_text("run_id")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {"commit": commit, "runs": args.runs, "tokens": args.tokens, "prompt_tokens": len(prompt)}
    result.update(lie_after=LIE_AFTER, request_timeout=args.request_timeout, log_dir=str(log_dir))
    result.update(scenarios=[], summary={})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chosen = [c for c in plan(control) if not args.only or any(k in c["title"] for k in args.only)]
    if args.no_detour:
        chosen += [{**c, "title": f"{c['title']}, detour off"} for c in chosen if c["title"].startswith("1.")]
    take_detour = _shadow_turns.ShadowTurns._take_detour
    began = time.perf_counter()
    with LocalSwarm("smollm2-135m", spans=[], server_args=ARGS, log_dir=str(log_dir)) as swarm:
        for name, ((a, b), host) in HONEST.items():
            swarm.start_server(a, b, name=name, extra=["--host", host])
        for index, c in enumerate(chosen):
            title = c.pop("title")

            async def no_detour(self, stats, route=()) -> bool:
                return False

            _shadow_turns.ShadowTurns._take_detour = no_detour if title.endswith("detour off") else take_detour
            row = scenario(swarm, title, prompt=prompt, references=references, args=args, suffix=chr(97 + index), **c)
            result["scenarios"].append(row)
            result["summary"][title] = summarize(row)
            print(json.dumps({title: result["summary"][title]}), flush=True)
            out.write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.perf_counter() - began)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
