"""Load: 32 concurrent sessions on a 3-server SmolLM2-135M swarm (issue #15, figure "Load"), and
with ``--batching`` the servers' continuous batching on and off side by side (issue #25).

    python -m benchmarks.load --sessions 32 --tokens 32
    python -m benchmarks.load --batching --delays 0 25 --counts 1 4 16 32 --tokens 16 --gather-window-ms 0 2 5

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
import contextlib
import json
import re
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
    "the moon",
    "rivers",
    "bread",
    "bicycles",
    "volcanoes",
    "honeybees",
    "libraries",
    "winter",
    "trains",
    "coffee",
    "the ocean",
    "owls",
    "clocks",
    "deserts",
    "music",
    "bridges",
    "apples",
    "thunderstorms",
    "chess",
    "lighthouses",
    "forests",
    "paper",
    "glaciers",
    "cats",
    "windmills",
    "salt",
    "maps",
    "rain",
    "mountains",
    "candles",
    "gardens",
    "the alphabet",
]
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


def _tree_sum(pid: int, measure) -> float:
    """``measure`` summed over a process and every live process it started (DHT process, p2pd);
    processes that exit meanwhile count 0."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += measure(p)
    return total


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and every process it started."""
    return int(_tree_sum(pid, lambda p: p.memory_info().rss))


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and every live process it started."""
    return float(_tree_sum(pid, lambda p: sum(p.cpu_times()[:2])))


def client_cpu(servers: list[int]) -> float:
    """CPU seconds of this process (the client and its sessions) and of the processes it started
    that are not servers (its DHT process and libp2p daemon), the forkserver's subtree excluded."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    server_side = set(servers)
    for child in me.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [child, *child.children(recursive=True)]
            if server_side.isdisjoint(p.pid for p in tree):
                total += tree_cpu(child.pid)
    return total


def cpu_snapshot(server_pids: list[int]) -> dict[str, float]:
    busy = psutil.cpu_times()
    return dict(
        servers=sum(tree_cpu(pid) for pid in server_pids),
        client=client_cpu(server_pids),
        machine_busy=busy.user + busy.system + busy.nice + getattr(busy, "irq", 0) + getattr(busy, "softirq", 0),
        at=time.perf_counter(),
    )


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
                        self.min_free[name] = (
                            info.free_cache_tokens if seen is None else min(seen, info.free_cache_tokens)
                        )
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


async def one_session(model, row: list[int], tokens: int, speculation: Optional[str] = None) -> dict:
    began = time.perf_counter()
    stamps, out = [], []
    try:
        async for chunk in model.agenerate_stream(row, max_new_tokens=tokens, speculation=speculation):
            stamps.append(time.perf_counter())
            out += chunk.token_ids
    except Exception as e:  # noqa: BLE001 - counted and reported below
        return dict(tokens=out, error=f"{type(e).__name__}: {e}", busy=busy_error(e), wall=time.perf_counter() - began)
    laps = [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(
        tokens=out,
        error=None,
        busy=False,
        laps=laps,
        first=stamps[0] - began if stamps else None,
        wall=time.perf_counter() - began,
    )


async def load(model, rows: list[list[int]], tokens: int, speculation: Optional[str] = None) -> list[dict]:
    return await asyncio.gather(*(one_session(model, row, tokens, speculation) for row in rows))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ---- --batching: the servers' continuous batching on and off (issue #25) ---------------------------

BATCHING_LINE = re.compile(r"Batching: (\d+) passes, (\d+) runs, (\d+) positions in all")


def batching_counters(log_dir: str, names: list[str]) -> dict[str, tuple[int, int, int]]:
    """Each server's latest cumulative (passes, runs, positions), from the line server/batching.py
    logs every REPORT_PERIOD seconds while it computes."""
    counters = {}
    for name in names:
        path = Path(log_dir) / f"{name}.log"
        found = BATCHING_LINE.findall(path.read_text(errors="replace")) if path.exists() else []
        counters[name] = tuple(map(int, found[-1])) if found else (0, 0, 0)
    return counters


def cpu_row(before: dict[str, float], after: dict[str, float], tokens: int) -> dict:
    """Where a cell's CPU went: seconds of the cell's three servers (with their DHT processes and
    libp2p daemons) and of the client, the machine's busy fraction over its cores, and the CPU
    milliseconds each generated token cost in all."""
    wall = after["at"] - before["at"]
    servers, client = after["servers"] - before["servers"], after["client"] - before["client"]
    return dict(
        cpu_servers_s=servers,
        cpu_client_s=client,
        machine_busy=(after["machine_busy"] - before["machine_busy"]) / (wall * psutil.cpu_count()),
        cpu_ms_per_token=1000 * (servers + client) / max(1, tokens),
    )


def phase_row(results: list[dict], expected: list[list[int]], wall: float, before: dict, after: dict) -> dict:
    """One (delay, batching, mode, sessions) cell: throughput, laps and what the servers batched."""
    ok = [r for r in results if r["error"] is None]
    laps = [lap for r in ok for lap in r["laps"]]
    tokens = sum(len(r["tokens"]) for r in ok)
    passes = sum(after[n][0] - before[n][0] for n in after)
    runs = sum(after[n][1] - before[n][1] for n in after)
    positions = sum(after[n][2] - before[n][2] for n in after)
    return dict(
        sessions=len(results),
        identical=sum(1 for r, e in zip(results, expected) if r["error"] is None and r["tokens"] == e),
        errors=[r["error"] for r in results if r["error"] is not None],
        wall_s=wall,
        tokens=tokens,
        aggregate_tps=tokens / wall,
        per_session_tps=statistics.median(len(r["tokens"]) / r["wall"] for r in ok) if ok else None,
        lap_p50_ms=1000 * statistics.median(laps) if laps else None,
        lap_p95_ms=1000 * percentile(laps, 0.95) if laps else None,
        passes=passes,
        runs_per_pass=runs / max(1, passes),
        positions_per_pass=positions / max(1, passes),
    )


def batching_main(args, rows: list[list[int]], expected: list[list[int]]) -> None:
    """For each delay, one swarm per arm at once: batching on with each gather window
    (``--gather-window-ms``), and off (``--no-batching``); every mode and session count runs on one
    arm, then at once on the next, so that the cells of a row see the same load on a shared machine;
    one table, side by side. The JSON is rewritten after every cell (a cut-short run keeps its cells)."""
    from server.batching import REPORT_PERIOD

    names = ["batch-0", "batch-1", "batch-2"]
    cells = []
    arms_wanted = [(True, window) for window in args.gather_window_ms] + ([] if args.no_off else [(False, 0.0)])
    for delay in args.delays:
        with contextlib.ExitStack() as stack:
            arms = []
            for batching, window in arms_wanted:
                arm = f"on-{window:g}ms" if batching else "off"
                log_dir = f"{args.log_dir}-batching-{arm}-{delay:g}ms"
                server_args = [
                    "--torch-threads",
                    "1",
                    "--log-level",
                    "INFO",
                    "--update-period",
                    "5",
                    "--cache-tokens",
                    str(args.cache_tokens),
                    "--gather-window-ms",
                    str(window),
                    *([] if batching else ["--no-batching"]),
                ]
                swarm = stack.enter_context(
                    LocalSwarm(args.model, 3, hop_delay_ms=delay, server_args=server_args, names=names, log_dir=log_dir)
                )
                model = batching_client(args, swarm, rows[0])
                stack.callback(model.shutdown)
                arms.append((batching, window, log_dir, model, [process.pid for process in swarm.servers]))
            time.sleep(REPORT_PERIOD + 1.5)  # the servers' counters before the first phase are logged
            counters = {log_dir: batching_counters(log_dir, names) for _, _, log_dir, _, _ in arms}
            for mode in args.modes:
                for count in args.counts:
                    for batching, window, log_dir, model, pids in arms:
                        row = batching_phase(
                            args, model, rows[:count], expected[:count], mode, log_dir, names, counters, pids
                        )
                        row.update(
                            delay_ms=delay,
                            batching=batching,
                            gather_window_ms=window if batching else None,
                            speculation=mode,
                        )
                        cells.append(row)
                        arm = f"on ({window:g} ms window)" if batching else "off"
                        print(
                            f"{delay:>3g} ms  batching {arm:<17} {mode:<6} {count:>2} sessions: "
                            f"{row['aggregate_tps']:6.1f} tok/s in all, {row['per_session_tps']:5.1f} per "
                            f"session, lap p50 "
                            f"{row['lap_p50_ms']:.0f} ms p95 {row['lap_p95_ms']:.0f} ms, "
                            f"{row['positions_per_pass']:.1f} "
                            f"positions/pass, {row['identical']}/{count} identical; CPU: servers "
                            f"{row['cpu_servers_s']:.1f} s, client {row['cpu_client_s']:.1f} s, machine "
                            f"{100 * row['machine_busy']:.0f}% busy, {row['cpu_ms_per_token']:.0f} ms/token",
                            flush=True,
                        )
                        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                        Path(args.out).write_text(
                            json.dumps(dict(model=args.model, new_tokens=args.tokens, cells=cells), indent=1)
                        )
    print(batching_table(cells))


def batching_client(args, swarm: LocalSwarm, warm_row: list[int]):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=swarm.initial_peers, request_timeout=args.request_timeout
    )
    model.generate(torch.tensor([warm_row]), max_new_tokens=2, speculation=None)  # warm connections
    return model


def batching_phase(
    args, model, rows, expected, mode: str, log_dir: str, names: list[str], counters: dict, server_pids: list[int]
) -> dict:
    """One cell: ``rows`` as concurrent sessions on one swarm; its servers' counters are diffed
    against the last ones logged (``counters``, updated), and the CPU its servers and the client
    used is measured over the cell."""
    from server.batching import REPORT_PERIOD

    cpu_before = cpu_snapshot(server_pids)
    t0 = time.perf_counter()
    results = asyncio.run(load(model, rows, args.tokens, None if mode == "none" else mode))
    wall = time.perf_counter() - t0
    cpu_after = cpu_snapshot(server_pids)
    time.sleep(REPORT_PERIOD + 1.5)  # this phase's last counters are logged
    before, counters[log_dir] = counters[log_dir], batching_counters(log_dir, names)
    row = phase_row(results, expected, wall, before, counters[log_dir])
    row.update(cpu_row(cpu_before, cpu_after, row["tokens"]))
    return row


def batching_table(cells: list[dict]) -> str:
    """Markdown: one line per (delay, mode, sessions), the arms side by side: batching off, then on
    with each gather window."""
    arms = sorted({(c["batching"], c.get("gather_window_ms")) for c in cells}, key=lambda a: (a[0], a[1] or 0.0))
    names = " / ".join("off" if not on else f"on {window:g} ms" for on, window in arms)
    lines = [
        f"| delay/hop | speculation | sessions | tok/s in all ({names}) | per session | vs 1 session (same arm) "
        f"| lap p50 ms | lap p95 ms | positions per pass | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {
        (c["delay_ms"], c["speculation"], c["sessions"], c["batching"], c.get("gather_window_ms")): c for c in cells
    }
    rows = sorted(
        {(c["delay_ms"], c["speculation"], c["sessions"]) for c in cells}, key=lambda r: (r[0], r[1] != "none", r[2])
    )

    def column(delay, mode, count, field: str, fmt: str) -> str:
        values = []
        for on, window in arms:
            cell = by_key.get((delay, mode, count, on, window))
            values.append(format(cell[field], fmt) if cell and cell[field] is not None else "-")
        return " / ".join(values)

    for delay, mode, count in rows:
        ratios = []
        for on, window in arms:
            cell, alone = by_key.get((delay, mode, count, on, window)), by_key.get((delay, mode, 1, on, window))
            ratios.append(f"{cell['aggregate_tps'] / alone['aggregate_tps']:.1f}x" if cell and alone else "-")
        found = [
            by_key[(delay, mode, count, on, window)]
            for on, window in arms
            if (delay, mode, count, on, window) in by_key
        ]
        lines.append(
            f"| {delay:g} ms | {mode} | {count} | {column(delay, mode, count, 'aggregate_tps', '.1f')} "
            f"| {column(delay, mode, count, 'per_session_tps', '.2f')} | {' / '.join(ratios)} "
            f"| {column(delay, mode, count, 'lap_p50_ms', '.0f')} | {column(delay, mode, count, 'lap_p95_ms', '.0f')} "
            f"| {column(delay, mode, count, 'positions_per_pass', '.1f')} "
            f"| {sum(c['identical'] for c in found)}/{sum(c['sessions'] for c in found)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cache-tokens", type=int, default=1536, help="each server's KV budget (small on purpose)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="generous: the machine is shared")
    p.add_argument("--log-dir", default="test-artifacts/bench-load")
    p.add_argument(
        "--out", default=None, help="default: benchmarks/results/load.json (load-batching.json with --batching)"
    )
    p.add_argument("--batching", action="store_true", help="servers' batching on and off side by side (issue #25)")
    p.add_argument("--delays", type=float, nargs="+", default=[0, 25], help="--batching: ms per hop")
    p.add_argument("--counts", type=int, nargs="+", default=[1, 4, 16, 32], help="--batching: concurrent sessions")
    p.add_argument("--modes", nargs="+", default=["none", "suffix"], help="--batching: speculation modes (none: off)")
    p.add_argument(
        "--gather-window-ms",
        type=float,
        nargs="+",
        default=[0.0, 2.0, 5.0],
        help="--batching: the servers' --gather-window-ms, one batching-on swarm per value",
    )
    p.add_argument("--no-off", action="store_true", help="--batching: skip the swarms with batching off")
    args = p.parse_args()
    args.out = args.out or f"benchmarks/results/load{'-batching' if args.batching else ''}.json"
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from protocol.models import resolve_model
    from swarm import AutoDistributedModelForCausalLM

    source = resolve_model(args.model).source
    tokenizer = AutoTokenizer.from_pretrained(source)
    if args.batching:  # enough cache that no session is refused
        args.sessions, args.cache_tokens = max(args.counts), max(args.cache_tokens, 65536)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.sessions)]
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for t in prompts
    ]
    t0 = time.perf_counter()
    expected = references(source, rows, args.tokens)
    print(f"references: {len(rows)} prompts in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.batching:
        return batching_main(args, rows, expected)

    names = ["load-0", "load-1", "load-2"]
    server_args = SERVER_ARGS + ["--cache-tokens", str(args.cache_tokens)]
    with LocalSwarm(args.model, 3, server_args=server_args, names=names, log_dir=args.log_dir) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=swarm.initial_peers, request_timeout=args.request_timeout
        )
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
        servers[n] = dict(
            rss_before_mib=before[n] / 2**20,
            rss_peak_mib=sampler.peak_rss[n] / 2**20,
            rss_after_mib=after[n] / 2**20,
            cache_tokens=budget,
            min_free_cache_tokens=low,
            within_budget=low is not None and budget is not None and 0 <= low <= budget,
        )
    report = dict(
        model=args.model,
        sessions=args.sessions,
        new_tokens=args.tokens,
        cache_tokens=args.cache_tokens,
        identical=identical,
        busy=busy,
        differing=wrong,
        other_errors=other,
        wall_s=wall,
        laps=len(laps),
        lap_median_s=statistics.median(laps) if laps else None,
        lap_p95_s=percentile(laps, 0.95) if laps else None,
        servers=servers,
        all_within_budget=all(s["within_budget"] for s in servers.values()),
        session_wall_s=[r["wall"] for r in results],
        errors=[r["error"] for r in results],
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(
        f"{args.sessions} sessions x {args.tokens} tokens in {wall:.1f} s: {identical} token-identical, {busy} busy, "
        f"{len(wrong)} differing, {len(other)} other errors"
    )
    if laps:
        print(
            f"lap time: median {1000 * report['lap_median_s']:.0f} ms, p95 {1000 * report['lap_p95_s']:.0f} ms "
            f"({len(laps)} laps)"
        )
    print(
        "| server | RSS before | peak during | after | cache budget | lowest free | within budget "
        "|\n|---|---|---|---|---|---|---|"
    )
    for n, s in servers.items():
        print(
            f"| {n} | {s['rss_before_mib']:.0f} MiB | {s['rss_peak_mib']:.0f} MiB | {s['rss_after_mib']:.0f} MiB "
            f"| {s['cache_tokens']} | {s['min_free_cache_tokens']} | {s['within_budget']} |"
        )
    for i, e in other:
        print(f"session {i}: {e}")


if __name__ == "__main__":
    main()
