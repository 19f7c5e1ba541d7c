"""Load: 32 concurrent sessions on a 3-server SmolLM2-135M swarm (issue #15, figure "Load").

    python -m benchmarks.load --sessions 32 --tokens 32

Every session is its own ``agenerate_stream`` (greedy, no speculation, so one streamed chunk is one
lap) on one client, all started at once. Each must end token-identical to local transformers
(float32, computed in-process before the swarm starts; cached in test-artifacts/) or fail with a
clear busy error (a ``ServerError`` with ``ErrorCode.BUSY`` in its cause chain, or the router's
``RoutingError`` naming servers out of cache room, after the client's bounded retries); anything
else is a failure. The servers get a small ``--cache-tokens`` budget on purpose, so that
not every session fits at once and the busy path is exercised.

Recorded per server: resident memory of its process tree (the server, its DHT process and its
libp2p daemon; psutil) before, at peak during and after the load, and the lowest
``free_cache_tokens`` its DHT record announced during the load (a record never below 0 means the
server never reserved more KV cache than its budget). Lap time: the time between two consecutive
chunks of one session (the first chunk, which carries the prefill, is left out); median and p95
over all laps of all sessions. Writes benchmarks/results/load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Optional

import psutil
import torch

from swarm.local import LocalSwarm

# 32 distinct prompts, each one chat turn (SmolLM2-135M-Instruct's template)
TOPICS = [
    "the moon", "rivers", "bread", "bicycles", "volcanoes", "honeybees", "libraries", "winter", "trains",
    "coffee", "the ocean", "owls", "clocks", "deserts", "music", "bridges", "apples", "thunderstorms",
    "chess", "lighthouses", "forests", "paper", "glaciers", "cats", "windmills", "salt", "maps", "rain",
    "mountains", "candles", "gardens", "the alphabet",
]  # fmt: skip
PROMPTS = [f"Write two sentences about {topic}." for topic in TOPICS]
SERVER_ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "2"]


REFERENCE_CACHE = Path("test-artifacts/bench-references.json")


def references(source: str, rows: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations by local transformers in float32: what every session must produce.
    Kept in test-artifacts/ by (checkpoint, prompt ids, tokens): on a loaded 2-core machine 32 of
    them take minutes, and load and chaos share prompts."""
    from transformers import AutoModelForCausalLM

    cache = json.loads(REFERENCE_CACHE.read_text()) if REFERENCE_CACHE.exists() else {}
    keys = [json.dumps([source, row, tokens]) for row in rows]
    missing = [(k, row) for k, row in zip(keys, rows) if k not in cache]
    if missing:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        with torch.inference_mode():
            for key, row in missing:
                ids = torch.tensor([row])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
                cache[key] = out[0, len(row) :].tolist()
        REFERENCE_CACHE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE_CACHE.write_text(json.dumps(cache))
    return [cache[k] for k in keys]


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and every process it started (DHT process, p2pd)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Sampler(threading.Thread):
    """Samples every server's tree RSS and its record's free_cache_tokens while the load runs."""

    def __init__(self, swarm: LocalSwarm, dht, names: list[str], period: float = 0.5):
        super().__init__(daemon=True)
        self.swarm, self.dht, self.names, self.period = swarm, dht, names, period
        self.peak_rss = {n: 0 for n in names}
        self.min_free: dict[str, Optional[int]] = {n: None for n in names}
        self.budget: dict[str, int] = {}
        self.records = 0
        self._halt = threading.Event()

    def run(self) -> None:
        """Reads records through the client's own DHT (a second DHT's daemon may not start in time
        on a loaded machine)."""
        from protocol.dht_records import fetch_servers

        last_fetch = 0.0
        while not self._halt.is_set():
            for name, process in zip(self.names, self.swarm.servers):
                self.peak_rss[name] = max(self.peak_rss[name], tree_rss(process.pid))
            if time.monotonic() - last_fetch > 1.0:
                last_fetch = time.monotonic()
                for info in fetch_servers(self.dht, self.swarm.dht_name, self.swarm.num_blocks):
                    name = info.public_name
                    if name in self.min_free:
                        self.records += 1
                        self.budget[name] = info.cache_tokens
                        seen = self.min_free[name]
                        self.min_free[name] = info.free_cache_tokens if seen is None else min(seen, info.free_cache_tokens)
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def busy_error(error: BaseException) -> bool:
    """True if ``error`` is (or was caused by) a server's BUSY refusal, or is the router's "no
    route: servers out of cache room" (what the client raises once the records show every server
    of some blocks full, without asking them again)."""
    from client.errors import RoutingError, ServerError
    from protocol.errors import ErrorCode

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ServerError) and error.code == ErrorCode.BUSY:
            return True
        if isinstance(error, RoutingError) and "out of cache room" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


async def one_session(model, row: list[int], tokens: int) -> dict:
    began = time.perf_counter()
    stamps, out = [], []
    try:
        async for chunk in model.agenerate_stream(row, max_new_tokens=tokens, speculation=None):
            stamps.append(time.perf_counter())
            out += chunk.token_ids
    except Exception as e:  # noqa: BLE001 - counted and reported below
        return dict(tokens=out, error=f"{type(e).__name__}: {e}", busy=busy_error(e), wall=time.perf_counter() - began)
    laps = [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(tokens=out, error=None, busy=False, laps=laps, first=stamps[0] - began if stamps else None,
                wall=time.perf_counter() - began)  # fmt: skip


async def load(model, rows: list[list[int]], tokens: int) -> list[dict]:
    return await asyncio.gather(*(one_session(model, row, tokens) for row in rows))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cache-tokens", type=int, default=1536, help="each server's KV budget (small on purpose)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="generous: the machine is shared")
    p.add_argument("--log-dir", default="test-artifacts/bench-load")
    p.add_argument("--out", default="benchmarks/results/load.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    from swarm import AutoDistributedModelForCausalLM
    from protocol.models import resolve_model
    from transformers import AutoTokenizer

    source = resolve_model(args.model).source
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.sessions)]
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for t in prompts]  # fmt: skip
    t0 = time.perf_counter()
    expected = references(source, rows, args.tokens)
    print(f"references: {len(rows)} prompts in {time.perf_counter() - t0:.1f} s", flush=True)

    names = ["load-0", "load-1", "load-2"]
    server_args = SERVER_ARGS + ["--cache-tokens", str(args.cache_tokens)]
    with LocalSwarm(args.model, 3, server_args=server_args, names=names, log_dir=args.log_dir) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(args.model, initial_peers=swarm.initial_peers,
                                                                request_timeout=args.request_timeout)  # fmt: skip
        model.generate(torch.tensor([rows[0]]), max_new_tokens=2, speculation=None)  # warm connections
        time.sleep(3)  # let the warm-up session's release reach the records
        before = {n: tree_rss(s.pid) for n, s in zip(names, swarm.servers)}
        sampler = Sampler(swarm, model.swarm.dht, names)
        sampler.start()
        t0 = time.perf_counter()
        results = asyncio.run(load(model, rows, args.tokens))
        wall = time.perf_counter() - t0
        time.sleep(3)  # sessions closed: the next records show the budget free again
        sampler.stop()
        after = {n: tree_rss(s.pid) for n, s in zip(names, swarm.servers)}
        model.shutdown()

    identical = sum(1 for r, e in zip(results, expected) if r["error"] is None and r["tokens"] == e)
    busy = sum(1 for r in results if r["error"] is not None and r["busy"])
    wrong = [i for i, (r, e) in enumerate(zip(results, expected)) if r["error"] is None and r["tokens"] != e]
    other = [(i, r["error"]) for i, r in enumerate(results) if r["error"] is not None and not r["busy"]]
    laps = [lap for r in results if r["error"] is None for lap in r["laps"]]
    servers = {}
    for n in names:
        budget, low = sampler.budget.get(n), sampler.min_free.get(n)
        servers[n] = dict(rss_before_mib=before[n] / 2**20, rss_peak_mib=sampler.peak_rss[n] / 2**20,
                          rss_after_mib=after[n] / 2**20, cache_tokens=budget, min_free_cache_tokens=low,
                          within_budget=low is not None and budget is not None and 0 <= low <= budget)  # fmt: skip
    report = dict(
        model=args.model, sessions=args.sessions, new_tokens=args.tokens, cache_tokens=args.cache_tokens,
        identical=identical, busy=busy, differing=wrong, other_errors=other, wall_s=wall,
        laps=len(laps), lap_median_s=statistics.median(laps) if laps else None,
        lap_p95_s=percentile(laps, 0.95) if laps else None, servers=servers,
        all_within_budget=all(s["within_budget"] for s in servers.values()),
        session_wall_s=[r["wall"] for r in results], errors=[r["error"] for r in results],
    )  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{args.sessions} sessions x {args.tokens} tokens in {wall:.1f} s: {identical} token-identical, {busy} busy, "
          f"{len(wrong)} differing, {len(other)} other errors")  # fmt: skip
    if laps:
        print(f"lap time: median {1000 * report['lap_median_s']:.0f} ms, p95 {1000 * report['lap_p95_s']:.0f} ms "
              f"({len(laps)} laps)")  # fmt: skip
    print("| server | RSS before | peak during | after | cache budget | lowest free | within budget |\n|---|---|---|---|---|---|---|")
    for n, s in servers.items():
        print(f"| {n} | {s['rss_before_mib']:.0f} MiB | {s['rss_peak_mib']:.0f} MiB | {s['rss_after_mib']:.0f} MiB "
              f"| {s['cache_tokens']} | {s['min_free_cache_tokens']} | {s['within_budget']} |")  # fmt: skip
    for i, e in other:
        print(f"session {i}: {e}")


if __name__ == "__main__":
    main()
