"""What spot-checks cost and how fast they catch a liar, at a given rate (default: the client's, 1/50).

    python -m benchmarks.spot_checks --generations 30 --trials 8

On the tiny 6-block Llama of the tests (tests/kit/checkpoints.py), a swarm of five servers: N lies
(``tests.kit.faulty_server --corrupt noise``, blocks 0:3), O lies (``--corrupt offset``, 3:6), A (0:3), B (3:6)
and F (0:6) are honest. Greedy, no speculation (one lap per token: the most audits per token).

- cost: ``--generations`` generations on the honest route A -> B (the liars kept out of the
  client's view); the audits' extra server positions (``spot_check_positions``) per generated
  token, against the positions the generation itself made the servers compute;
- catch: ``--trials`` fresh clients whose route goes through N (head), each generating until N is
  excluded; the laps from the first verdict to the audit that convicted N, and to the lap at which
  the generation left N's route.
Writes ``benchmarks/results/spot_checks.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from client._spot_checks import DEFAULT_SPOT_CHECK_RATE
from swarm.local import LocalSwarm
from tests.kit.faulty_server import faulty
from tests.kit.routes import PreferredRoutes

SERVERS = {"N": (0, 3, "noise"), "O": (3, 6, "offset"), "A": (0, 3, None), "B": (3, 6, None), "F": (0, 6, None)}
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]


def connect(path, swarm, *routes):
    from protocol.dht_records import fetch_servers
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
    model.swarm.router = PreferredRoutes(*routes)
    peers = {s.public_name: s.peer_id for s in fetch_servers(model.swarm.dht, model.swarm.model, 6)}
    return model, peers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=DEFAULT_SPOT_CHECK_RATE)
    p.add_argument("--generations", type=int, default=30)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/spot_checks.json")
    args = p.parse_args()
    import torch

    from client._swarm import ExclusionList
    from tests.kit.checkpoints import build_tiny_llama

    path = build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama")
    ids = torch.tensor([PROMPT])
    honest = [("A", 0, 3), ("B", 3, 6)]
    with LocalSwarm(str(path), spans=[], server_args=ARGS) as swarm:
        for name, (a, b, corrupt) in SERVERS.items():
            swarm.start_server(a, b, name=name, launcher=faulty("--corrupt", corrupt) if corrupt else ["swarm.server"])
        swarm.wait_ready(len(SERVERS))

        model, peers = connect(path, swarm, honest)
        model.swarm.excluded = ExclusionList(base_seconds=10**6)
        for liar in ("N", "O"):
            model.swarm.excluded.add(peers[liar])
        totals = dict(tokens=0, laps=0, audits=0, audit_positions=0, own_positions=0, undecided=0, failed=0, excluded=0)
        began = time.monotonic()
        for _ in range(args.generations):
            model.generate(ids, max_new_tokens=args.tokens, speculation=None, spot_check_rate=args.rate)
            s = model.last_generation_stats
            totals["tokens"] += s.new_tokens
            totals["laps"] += s.laps
            totals["audits"] += s.spot_checks
            totals["audit_positions"] += s.spot_check_positions
            totals["own_positions"] += 2 * (len(PROMPT) + s.laps + s.drafted + s.positions_wasted)  # 2 hops
            totals["undecided"] += s.spot_checks_undecided
            totals["failed"] += s.spot_checks_failed
            totals["excluded"] += len(s.liars_excluded)
        totals["seconds"] = time.monotonic() - began
        model.shutdown()
        cost = dict(
            totals,
            audit_positions_per_token=totals["audit_positions"] / totals["tokens"],
            own_positions_per_token=totals["own_positions"] / totals["tokens"],
        )
        print(f"cost at rate {args.rate:g}: {json.dumps(cost)}", flush=True)

        catches = []
        for trial in range(args.trials):
            model, peers = connect(path, swarm, [("N", 0, 3), ("B", 3, 6)], honest)
            model.swarm.excluded = ExclusionList(base_seconds=10**6)
            model.swarm.excluded.add(peers["O"])  # O is B's other substitute: keep the figure about N
            laps_before, found = 0, None
            for _ in range(50):
                model.generate(ids, max_new_tokens=args.tokens, speculation=None, spot_check_rate=args.rate)
                s = model.last_generation_stats
                if peers["N"] in s.liars_excluded:
                    audit = next(
                        int(m.group(1))
                        for e in s.spot_check_events
                        if (m := re.match(r"lap (\d+): hop .*: convicted", e))
                    )
                    left = next(
                        int(m.group(1)) for e in s.spot_check_events if (m := re.match(r"lap (\d+): re-verifying", e))
                    )
                    found = dict(
                        audit_lap=laps_before + audit,
                        left_route_lap=laps_before + left,
                        audits=s.spot_checks,
                        retracted=s.tokens_retracted,
                    )
                    break
                laps_before += s.laps
            model.shutdown()
            print(f"trial {trial}: {found}", flush=True)
            catches.append(found)
    caught = [c for c in catches if c]
    summary = dict(
        rate=args.rate,
        cost=cost,
        catches=catches,
        audit_lap_median=statistics.median(c["audit_lap"] for c in caught) if caught else None,
        left_route_lap_median=statistics.median(c["left_route_lap"] for c in caught) if caught else None,
        left_route_lap_max=max(c["left_route_lap"] for c in caught) if caught else None,
    )
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
