"""How soon a tail that lies in forward logits is caught at the default audit rate (issue 35;
docs/reliability.md, "Forward passes and log-probs").

    python -m benchmarks.output_liars --trials 20      # make bench-output-liars

One pass in ten is audited by default (``output_audit_rate=0.1``), and the first pass through a server the
model has not audited yet is always audited (first use). Two liars, side by side in one run:

- ``from the start``: lies on every pass, so its first pass (first use) should catch it;
- ``after its first audit``: lies on every pass after an honest first audited one. Simulated in the client
  (the liar's and the head's peer ids are put in ``model.output_audits.met``, the state an honest first
  audited pass through H -> L leaves),
  so the rate alone decides: passes until the catch should be geometric with mean 1 / rate.

Everything else is at the client's defaults (the LM-head evidence on, nobody trusted). The tiny 6-block
Llama of the tests (tests/kit/checkpoints.py), a head H (0:3), honest tails T, U (3:6) and a tail L (3:6)
whose returned logits carry +3 on each row's second choice (``tests/kit/faulty_server.py --lie-in-outputs
3``; its verdicts stay honest: the gateway's ``echo`` log-probs come from the same logits). Per trial a fresh
client routed H -> L first sends forward passes (``model(ids).logits``, prompts of 24-72 tokens) until
``--after`` passes past the one that caught L, or ``--max-passes``. Per pass: its logits against local
transformers (max |difference| > 1e-4 is a wrong pass), whether an ``UnconfirmedOutputsWarning`` flagged it
and whether it was audited. Per trial: passes until L was caught (disputed or convicted by the model's
audits), wrong passes returned unflagged, honest servers disputed or convicted. Writes
``benchmarks/results/output-liars.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import warnings
from pathlib import Path

LIARS = ("from the start", "after its first audit")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--rate", type=float, default=0.1)
    p.add_argument("--max-passes", type=int, default=60)
    p.add_argument("--after", type=int, default=3, help="passes sent after the one that caught the liar")
    p.add_argument("--out", default="benchmarks/results/output-liars.json")
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from client.errors import UnconfirmedOutputsWarning
    from swarm.local import LocalSwarm
    from tests.kit.checkpoints import build_tiny_llama
    from tests.kit.faulty_server import faulty
    from tests.kit.routes import routed_client
    from tests.kit.swarms import SERVER_ARGS

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="output-liars-"))
    path = build_tiny_llama(work / "tiny-llama")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (1, n), generator=gen) for n in (24, 40, 56, 72)]
    with torch.no_grad():
        wanted = [reference(ids).logits[0] for ids in prompts]
    trials = []
    honest = ("H", "T", "U")
    spans = {"H": (0, 3), "T": (3, 6), "U": (3, 6)}
    with LocalSwarm(str(path), spans=list(spans.values()), names=list(spans), server_args=SERVER_ARGS) as swarm:
        swarm.start_server(3, 6, name="L", launcher=faulty("--lie-in-outputs", "3"))
        for trial in range(2 * args.trials):  # the two liars in turn
            kind = LIARS[trial % 2]
            routes = ([("H", 0, 3), ("L", 3, 6)], [("H", 0, 3), ("T", 3, 6)], [("H", 0, 3), ("U", 3, 6)])
            with routed_client(swarm, path, *routes, output_audit_rate=args.rate) as model:
                liar, caught_at, passes = model.peers["L"], None, []
                if kind == LIARS[1]:
                    model.output_audits.met.update((liar, model.peers["H"]))  # as an honest audited first pass left it
                for i in range(args.max_passes):
                    ids = prompts[i % len(prompts)]
                    audited_before = model.output_audits.stats.audited
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        with torch.no_grad():
                            logits = model(ids).logits[0]
                    wrong = float((logits - wanted[i % len(prompts)]).abs().max()) > 1e-4
                    flagged = any(issubclass(w.category, UnconfirmedOutputsWarning) for w in caught)
                    audited = model.output_audits.stats.audited > audited_before
                    passes.append({"wrong": wrong, "flagged": flagged, "audited": audited})
                    stats = model.output_audits.stats
                    if caught_at is None and (liar in stats.disputed_peers or liar in stats.convicted):
                        caught_at = i + 1
                    if caught_at is not None and i + 1 >= caught_at + args.after:
                        break
                stats = model.output_audits.stats
                names = {peer: name for name, peer in model.peers.items()}
                row = {
                    "liar": kind,
                    "caught_at_pass": caught_at,
                    "audited_passes": [i + 1 for i, p in enumerate(passes) if p["audited"]],
                    "passes": len(passes),
                    "wrong": sum(p["wrong"] for p in passes),
                    "wrong_unflagged": sum(p["wrong"] and not p["flagged"] for p in passes),
                    "wrong_after_catch": sum(p["wrong"] for p in passes[caught_at or len(passes) :]),
                    "audited": stats.audited,
                    "by_evidence": stats.by_evidence,
                    "disputed": [names.get(p, p) for p in stats.disputed_peers],
                    "convicted": [names.get(p, p) for p in stats.convicted],
                }
                row["honest_disputed_or_convicted"] = sorted(set(row["disputed"] + row["convicted"]) & set(honest))
                trials.append(row)
                print(f"trial {trial}: {row}", flush=True)
    summary = {kind: summarize([t for t in trials if t["liar"] == kind], args.rate) for kind in LIARS}
    summary["passes_audited_by_the_rate"] = audit_rate(trials)
    summary["audits"] = sum(len(t["audited_passes"]) for t in trials)
    result = {"commit": commit, "rate": args.rate, "summary": summary, "trials": trials}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"commit": commit, "rate": args.rate, "summary": summary}, indent=1))


def summarize(trials: list[dict], rate: float) -> dict:
    caught = [t["caught_at_pass"] for t in trials if t["caught_at_pass"] is not None]
    return {
        "trials": len(trials),
        "caught": f"{len(caught)} of {len(trials)}",
        "passes_to_catch_median": statistics.median(caught) if caught else None,
        "passes_to_catch_mean": round(statistics.mean(caught), 2) if caught else None,
        "passes_to_catch_range": [min(caught), max(caught)] if caught else None,
        "expected_mean_at_the_rate": round(1 / rate, 2),
        "wrong_passes_returned": sum(t["wrong"] for t in trials),
        "wrong_passes_unflagged": sum(t["wrong_unflagged"] for t in trials),
        "wrong_after_catch": sum(t["wrong_after_catch"] for t in trials),
        "trials_with_an_honest_server_disputed_or_convicted": sum(
            bool(t["honest_disputed_or_convicted"]) for t in trials
        ),
    }


def audit_rate(trials: list[dict]) -> dict:
    """Audits among the passes the rate alone decided: every pass but the first uses (a trial's first pass
    for the liar from the start, and the pass after the catch, which meets a new tail). The catch itself
    counts for the liar after its first audit: the passes up to it are the rate's geometric draws."""
    drawn = audited = 0
    for t in trials:
        first_use = {1} if t["liar"] == LIARS[0] else set()
        if t["caught_at_pass"] is not None:
            first_use.add(t["caught_at_pass"] + 1)  # the pass after the catch routes through T or U
        for i in range(1, t["passes"] + 1):
            if i not in first_use:
                drawn += 1
                audited += i in t["audited_passes"]
    return {"passes": drawn, "audited": audited, "rate": round(audited / drawn, 3) if drawn else None}


if __name__ == "__main__":
    main()
