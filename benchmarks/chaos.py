"""Chaos: N generations, each with one random fault on a random server of its route (issue #15,
figure "Chaos").

    python -m benchmarks.chaos --runs 50

A SmolLM2-135M swarm of six servers, two for each third of the blocks, every server behind a
delay proxy (``--hop-delay-ms``, 5 ms by default) so that its link can be cut. Run i decodes in
mode ``MODES[i % 4]`` (greedy; seeded sampling; speculative, the default retrieval speculation;
asynchronous speculation) from one of 8 prompts (``--prompts``) drawn with a fixed RNG seed,
and once the generation has committed a random number of tokens, one server of its current route,
drawn at random, gets one fault, drawn at random:

- ``SIGKILL``: the server process dies (its DHT process and libp2p daemon follow it);
- ``SIGSTOP``: the server process freezes (its libp2p daemon keeps the connections open, so only
  the client's request timeout can tell); it gets SIGCONT after the run;
- ``link cut``: the server's delay proxy closes every connection and stops listening, so nobody
  reaches the server any more while it keeps announcing itself in the DHT; the proxy comes back
  on the same port after the run.

Each generation must complete, token-identical to an undisturbed run: local transformers (float32)
for the greedy modes, and the same swarm without a fault, same seed, for seeded sampling. Between
runs killed servers are replaced (same blocks, a new identity) and the client forgets its
exclusions (as a fresh client would), and the next run starts once every third of the blocks has
two online servers again. Writes benchmarks/results/chaos.json: per run, and per fault and mode the
completed and identical counts, failovers and the time to recover (from the fault to the next
committed token, as the caller sees it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.load import PROMPTS, references
from swarm.local import LocalSwarm, kill_group

SPANS = [(0, 10), (10, 20), (20, 30)]
MODES = {
    "greedy": dict(speculation=None),
    "sampled": dict(speculation=None, do_sample=True, temperature=0.8, top_p=0.9),
    "speculative": dict(),  # the default retrieval (suffix) speculation, greedy
    "async": dict(async_speculation=True),
}
FAULTS = ["SIGKILL", "SIGSTOP", "link cut"]
SERVER_ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "3", "--drain-seconds", "1"]


class Chaos:
    """The swarm, which process and proxy belong to which server, and how to break and mend them."""

    def __init__(self, swarm: LocalSwarm, model):
        self.swarm, self.model = swarm, model
        self.alive: dict[str, tuple[int, tuple[int, int]]] = {}  # name -> (index in swarm.servers, span)
        self.count = 0

    def start(self, span: tuple[int, int]) -> str:
        name = f"s{span[0]}-{self.count}"
        self.count += 1
        self.swarm.start_server(*span, name=name)
        self.alive[name] = (len(self.swarm.servers) - 1, span)
        return name

    def names_by_peer(self) -> dict[str, str]:
        from protocol.dht_records import fetch_servers

        infos = fetch_servers(self.model.swarm.dht, self.swarm.dht_name, self.swarm.num_blocks)
        return {i.peer_id: i.public_name for i in infos if i.public_name in self.alive}

    def wait_redundant(self, timeout: float = 300.0) -> None:
        """Until every span has two online servers that are alive (the replaced ones included)."""
        from protocol.dht_records import fetch_servers
        from protocol.records import ServerState

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, (index, _) in self.alive.items():
                if self.swarm.servers[index].poll() is not None:
                    raise RuntimeError(f"server {name} exited with code {self.swarm.servers[index].returncode}")
            infos = fetch_servers(self.model.swarm.dht, self.swarm.dht_name, self.swarm.num_blocks)
            online = {i.public_name for i in infos if i.state == ServerState.ONLINE}
            if all(sum(1 for n, (_, s) in self.alive.items() if s == span and n in online) >= 2 for span in SPANS):
                return
            time.sleep(0.5)
        raise TimeoutError("the swarm did not get back to two online servers per span")

    def inject(self, fault: str, name: str) -> None:
        index, _ = self.alive[name]
        process = self.swarm.servers[index]
        if fault == "SIGKILL":
            process.send_signal(signal.SIGKILL)
        elif fault == "SIGSTOP":
            process.send_signal(signal.SIGSTOP)
        else:
            self.swarm.proxies[index].stop()  # closes every connection and stops listening

    def mend(self, fault: str, name: str) -> None:
        from swarm.delay_proxy import ThreadedDelayProxy

        index, span = self.alive[name]
        if fault == "SIGKILL":
            kill_group(self.swarm.servers[index])  # its DHT process and p2pd, if still there
            del self.alive[name]
            self.start(span)
        elif fault == "SIGSTOP":
            os.kill(self.swarm.servers[index].pid, signal.SIGCONT)
        else:
            old = self.swarm.proxies[index]
            proxy = ThreadedDelayProxy("127.0.0.1", old.target_port, old.delay_ms, listen_port=old.listen_port)
            proxy.start()
            self.swarm.proxies[index] = proxy


async def disturbed(
    chaos: Chaos,
    row: list[int],
    tokens: int,
    kwargs: dict,
    fault: str,
    at: int,
    rng: random.Random,
    names: dict[str, str],
) -> dict:
    """One generation with ``fault`` injected into a random hop of its route after ``at`` tokens."""
    out, victim, fault_time, recover = [], None, None, None
    stats = None
    try:
        async for chunk in chaos.model.agenerate_stream(row, max_new_tokens=tokens, **kwargs):
            out += chunk.token_ids
            stats = chunk.stats
            now = time.perf_counter()
            if fault_time is not None and recover is None:
                recover = now - fault_time
            if victim is None and len(out) >= at and len(out) < tokens:
                hops = [names[peer] for peer, _, _ in chunk.stats.route if peer in names]
                if hops:  # else: a route over servers not yet in the name map (reported as not faulted)
                    victim = rng.choice(hops)
                    chaos.inject(fault, victim)
                    fault_time = time.perf_counter()
        error = None
    except Exception as e:  # noqa: BLE001 - recorded: a generation that does not complete is the finding
        error = f"{type(e).__name__}: {e}"
    return dict(
        tokens=out,
        victim=victim,
        error=error,
        recover_s=recover,
        failovers=stats.failovers if stats else None,
        failover_s=stats.failover_time if stats else None,
        failover_events=stats.failover_events if stats else [],
    )


async def undisturbed(model, row: list[int], tokens: int, kwargs: dict) -> list[int]:
    out = []
    async for chunk in model.agenerate_stream(row, max_new_tokens=tokens, **kwargs):
        out += chunk.token_ids
    return out


def summarize(rows: list[dict]) -> dict:
    table = defaultdict(lambda: dict(runs=0, faulted=0, completed=0, identical=0, failovers=0, recover_s=[]))
    for r in rows:
        for key in (f"{r['fault']} / {r['mode']}", f"{r['fault']} / all", f"all / {r['mode']}", "all / all"):
            t = table[key]
            t["runs"] += 1
            t["faulted"] += r["victim"] is not None
            t["completed"] += r["error"] is None
            t["identical"] += r["identical"]
            t["failovers"] += r["failovers"] or 0
            if r["recover_s"] is not None and r["victim"] is not None:
                t["recover_s"].append(r["recover_s"])
    for t in table.values():
        rec = t.pop("recover_s")
        t["recover_median_s"] = statistics.median(rec) if rec else None
        t["recover_max_s"] = max(rec) if rec else None
    return dict(sorted(table.items()))


def write(args, results: list[dict], elapsed: float) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            dict(
                runs=args.runs,
                done=len(results),
                tokens=args.tokens,
                seed=args.seed,
                request_timeout_s=args.request_timeout,
                hop_delay_ms=args.hop_delay_ms,
                elapsed_s=elapsed,
                summary=summarize(results),
                results=results,
            ),
            indent=1,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--prompts", type=int, default=8, help="draw from the first N prompts of benchmarks.load")
    p.add_argument("--hop-delay-ms", type=float, default=5.0)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=20.0,
        help="how long the client waits for a hop; a SIGSTOPped server is found only by this",
    )
    p.add_argument("--log-dir", default="test-artifacts/bench-chaos")
    p.add_argument("--out", default="benchmarks/results/chaos.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)

    from transformers import AutoTokenizer

    from protocol.models import resolve_model
    from swarm import AutoDistributedModelForCausalLM

    source = resolve_model(args.model).source
    tokenizer = AutoTokenizer.from_pretrained(source)
    plan = []
    for i in range(args.runs):
        mode = list(MODES)[i % len(MODES)]
        plan.append(
            dict(
                run=i,
                mode=mode,
                fault=rng.choice(FAULTS),
                prompt=rng.randrange(args.prompts),
                at=rng.randint(2, args.tokens // 2),
                seed=1000 + i,
            )
        )
    rows_by_prompt = {
        k: tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[k]}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for k in sorted({r["prompt"] for r in plan})
    }
    t0 = time.perf_counter()
    greedy = dict(zip(rows_by_prompt, references(source, list(rows_by_prompt.values()), args.tokens)))
    print(f"references: {len(greedy)} prompts in {time.perf_counter() - t0:.1f} s", flush=True)

    results = []
    swarm = LocalSwarm(
        args.model, spans=[], hop_delay_ms=args.hop_delay_ms, server_args=SERVER_ARGS, log_dir=args.log_dir
    )
    with swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=swarm.initial_peers, request_timeout=args.request_timeout
        )
        chaos = Chaos(swarm, model)
        for span in SPANS + SPANS:
            chaos.start(span)
        chaos.wait_redundant()
        model.generate(torch.tensor([rows_by_prompt[plan[0]["prompt"]]]), max_new_tokens=2, speculation=None)  # warm
        began = time.perf_counter()
        for r in plan:
            row = rows_by_prompt[r["prompt"]]
            kwargs = dict(MODES[r["mode"]])
            if kwargs.get("do_sample"):
                kwargs["seed"] = r["seed"]
                expected = asyncio.run(undisturbed(model, row, args.tokens, kwargs))
            else:
                expected = greedy[r["prompt"]]
            names = chaos.names_by_peer()
            t = time.perf_counter()
            got = asyncio.run(disturbed(chaos, row, args.tokens, kwargs, r["fault"], r["at"], rng, names))
            r.update(got, wall_s=time.perf_counter() - t, identical=got["error"] is None and got["tokens"] == expected)
            r["expected"] = expected
            if r["victim"] is not None:
                chaos.mend(r["fault"], r["victim"])
            model.swarm.excluded = type(model.swarm.excluded)()  # a fresh client would not know them
            print(
                f"run {r['run']:2d} {r['mode']:11s} {r['fault']:8s} at {r['at']:2d} on {r['victim']}: "
                f"{'identical' if r['identical'] else 'DIFFERS' if r['error'] is None else 'FAILED'}, "
                f"{r['failovers']} failovers, recovered in {r['recover_s'] or 0:.1f} s"
                + (f" -- {r['error']}" if r["error"] else ""),
                flush=True,
            )
            results.append(r)
            write(args, results, time.perf_counter() - began)  # after every run: a cut-short run keeps its figures
            chaos.wait_redundant()
        model.shutdown()

    summary = summarize(results)
    print("| fault / mode | runs | faulted | completed | identical | failovers | recover median | max |")
    print("|---|---|---|---|---|---|---|---|")
    for key, t in summary.items():
        med = f"{t['recover_median_s']:.1f} s" if t["recover_median_s"] is not None else "-"
        mx = f"{t['recover_max_s']:.1f} s" if t["recover_max_s"] is not None else "-"
        print(
            f"| {key} | {t['runs']} | {t['faulted']} | {t['completed']} | {t['identical']} | "
            f"{t['failovers']} | {med} | {mx} |"
        )


if __name__ == "__main__":
    main()
