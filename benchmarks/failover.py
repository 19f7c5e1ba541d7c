"""What a failover costs: SIGKILL the middle server in use mid-generation and compare with a run
without a failure, in the same local swarm of SmolLM2 (head, two middle servers, tail).

    python -m benchmarks.failover --delays 0 25

Reports the median normal lap, the time from the failure to the next committed token
(``GenerationStats.failover_time``: detection, exclusion, re-routing, opening the new session and
the replay lap), and the extra wall time against the run without a failure.
"""

from __future__ import annotations

import argparse
import signal

from swarm.local import LocalSwarm

SPANS = [(0, 10), (10, 20), (10, 20), (20, 30)]
NAMES = ["head", "mid-a", "mid-b", "tail"]


class KillMiddleAt:
    def __init__(self, swarm, model, at: int):
        self.swarm, self.model, self.at, self.seen, self.done = swarm, model, at, -1, False

    def put(self, tokens):
        self.seen += 1 if self.seen < 0 else len(tokens.view(-1))
        if not self.done and self.seen >= self.at:
            peer = self.model.last_generation_stats.route[1][0]
            from protocol.dht_records import fetch_servers

            names = {s.peer_id: s.public_name for s in fetch_servers(self.model.swarm.dht, self.model.swarm.model, 30)}
            self.swarm.servers[NAMES.index(names[peer])].send_signal(signal.SIGKILL)
            self.done = True

    def end(self):
        pass


def run(delay: float, tokens: int) -> dict:
    from swarm import AutoDistributedModelForCausalLM

    args = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]
    with LocalSwarm("smollm2-135m", spans=SPANS, names=NAMES, hop_delay_ms=delay, server_args=args) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
        ids = model.tokenizer("Once upon a time, in a small village by the sea,", return_tensors="pt")["input_ids"]
        model.generate(ids, max_new_tokens=4, speculation=None)  # warm connections
        base = model.generate(ids, max_new_tokens=tokens, speculation=None)
        normal = model.last_generation_stats
        out = model.generate(
            ids, max_new_tokens=tokens, speculation=None, streamer=KillMiddleAt(swarm, model, tokens // 3)
        )
        failed = model.last_generation_stats
        assert out.tolist() == base.tolist(), "failover changed the output"
        model.shutdown()
    lap = normal.wall_time / normal.laps
    return dict(
        delay_ms=delay,
        normal_lap_s=lap,
        failovers=failed.failovers,
        failover_s=failed.failover_time,
        failover_laps=failed.failover_time / lap,
        extra_wall_s=failed.wall_time - normal.wall_time,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=float, nargs="+", default=[0, 25])
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    rows = [run(d, args.tokens) for d in args.delays]
    print(
        "| delay/hop | normal lap | failovers | failure -> next token | in laps | extra wall time "
        "|\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['delay_ms']:.0f} ms | {1000 * r['normal_lap_s']:.0f} ms | {r['failovers']} | "
            f"{r['failover_s']:.2f} s "
            f"| {r['failover_laps']:.1f} | {r['extra_wall_s']:.2f} s |"
        )


if __name__ == "__main__":
    main()
