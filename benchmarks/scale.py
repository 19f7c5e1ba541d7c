"""Routing, block selection and the dashboard's max-flow at swarm sizes nobody has run yet.

    python -m benchmarks.scale --servers 1000 --blocks 61     # one size; last line: one JSON object
    python -m benchmarks.scale --sweep                        # 10, 100, 300, 1000 servers (make bench-scale)

In one process, no network: the records of ``tests/kit/synthetic_swarm.py`` (spans of 1 to 12
blocks, log-normal throughputs, RTTs from positions on a map, 10% hostile records) are validated as
a client reads them (``fetch_servers``'s ``_parse``), then timed:

* **route**: what ``client/_swarm.py`` does per session: ``cap_throughput`` and
  ``MaxFlowRouter.plan(servers, 0, blocks, max_length=..., client_rtts=...)``, with ``--sessions``
  sessions opened one after another on one router (so the quotas of the later ones count);
  ``route_ms_p50/p95`` over all of them.
* **placement**: ``choose_best_span`` for a joining server of 8 blocks.
* **max-flow**: ``swarm_max_flow`` (the dashboard computes it every poll).

Peak memory is ``tracemalloc``'s peak over one call (a separate run from the timed ones, as
tracemalloc slows Python down). Wall times count whatever else the machine runs (the load
average is in the JSON), so the CPU time of the planning process (``route_cpu_ms_*``) is given
too. Quality: for swarms small enough (``--exhaustive-max``), the first
route's latency against the best route found by enumerating every route (``exhaustive_best``),
as a ratio (1.0 = the best).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import tracemalloc
from typing import Callable

from protocol.flow import swarm_max_flow
from protocol.placement import choose_best_span
from protocol.records import ServerState
from protocol.routing import MaxFlowRouter, cap_throughput
from tests.kit.route_yardstick import exhaustive_best, route_latency
from tests.kit.synthetic_swarm import make_swarm

SIZES = (10, 100, 300, 1000)
MAX_LENGTH = 2048  # cache tokens a session asks for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=61)
    parser.add_argument("--sessions", type=int, default=50, help="routes planned per size")
    parser.add_argument("--hostile", type=float, default=0.1, help="fraction of hostile records")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exhaustive-max", type=int, default=12, help="largest swarm searched exhaustively")
    parser.add_argument("--sweep", action="store_true", help=f"every size of {SIZES} (one JSON line each)")
    parser.add_argument("--out", help="also write the JSON objects to this file")
    args = parser.parse_args()
    sizes = SIZES if args.sweep else (args.servers,)
    results = []
    for n in sizes:
        result = measure(n, args.blocks, args.sessions, args.hostile, args.seed, args.exhaustive_max)
        print_table(result)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": _commit(), "results": results}, f, indent=1)


def measure(servers: int, blocks: int, sessions: int, hostile: float, seed: int, exhaustive_max: int) -> dict:
    swarm = make_swarm(servers, blocks, hostile, seed)
    records = swarm.parsed()
    rtts = swarm.client_rtts(records)
    router, routes, route_s, route_cpu = MaxFlowRouter(), [], [], []
    for _ in range(sessions):  # sessions opened one after another, as a busy client (or gateway) would
        began, cpu = time.perf_counter(), time.process_time()
        routes.append(router.plan(cap_throughput(records, {}), 0, blocks, max_length=MAX_LENGTH, client_rtts=rtts))
        route_s.append(time.perf_counter() - began)
        route_cpu.append(time.process_time() - cpu)
    place_s = _repeat(lambda: choose_best_span(records, blocks, 8, 20.0), 20)
    flow_s = _repeat(lambda: swarm_max_flow(records, blocks), 20)

    def one_route():
        return MaxFlowRouter().plan(cap_throughput(records, {}), 0, blocks, max_length=MAX_LENGTH, client_rtts=rtts)

    result = {
        "servers": servers,
        "blocks": blocks,
        "records_valid": len(records),
        "records_hostile": len(swarm.hostile),
        "hostile_used": sum(hop.peer_id in swarm.hostile for route in routes for hop in route),
        "route_ms_p50": _ms(statistics.median(route_s)),
        "route_ms_p95": _ms(_p95(route_s)),
        "route_cpu_ms_p50": _ms(statistics.median(route_cpu)),
        "route_cpu_ms_p95": _ms(_p95(route_cpu)),
        "route_peak_mib": _peak_mib(one_route),
        "route_hops_mean": round(statistics.mean(len(r) for r in routes), 2),
        "route_servers_used": len({hop.peer_id for r in routes for hop in r}),
        "place_ms_p50": _ms(statistics.median(place_s)),
        "place_peak_mib": _peak_mib(lambda: choose_best_span(records, blocks, 8, 20.0)),
        "max_flow_ms_p50": _ms(statistics.median(flow_s)),
        "max_flow_peak_mib": _peak_mib(lambda: swarm_max_flow(records, blocks)),
        "max_flow_tokens_s": round(swarm_max_flow(records, blocks), 2),
        "sessions": sessions,
        "seed": seed,
        "load_average": round(os.getloadavg()[0], 1),
        "commit": _commit(),
    }
    if servers <= exhaustive_max:
        routable = [s for s in records if s.state == ServerState.ONLINE]
        best = exhaustive_best(routable, blocks, rtts, MAX_LENGTH)
        result["route_latency_s"] = round(route_latency(routes[0], records, rtts), 6)
        result["exhaustive_latency_s"] = round(best[0], 6)
        result["quality"] = round(best[0] / route_latency(routes[0], records, rtts), 6)
    return result


def print_table(r: dict) -> None:
    print(
        f"{r['servers']} servers ({r['records_valid']} valid records, {r['records_hostile']} hostile), "
        f"{r['blocks']} blocks"
    )
    print(
        f"  route:     p50 {r['route_ms_p50']} ms, p95 {r['route_ms_p95']} ms (CPU p50 {r['route_cpu_ms_p50']} ms, "
        f"p95 {r['route_cpu_ms_p95']} ms), peak {r['route_peak_mib']} MiB, "
        f"{r['route_hops_mean']} hops, {r['route_servers_used']} servers used by {r['sessions']} sessions"
    )
    print(f"  placement: p50 {r['place_ms_p50']} ms, peak {r['place_peak_mib']} MiB")
    print(
        f"  max-flow:  p50 {r['max_flow_ms_p50']} ms, peak {r['max_flow_peak_mib']} MiB "
        f"({r['max_flow_tokens_s']} tokens/s)"
    )
    if "quality" in r:
        print(
            f"  quality:   {r['quality']} (route {r['route_latency_s']} s, exhaustive best "
            f"{r['exhaustive_latency_s']} s)"
        )


def _repeat(fn: Callable[[], object], count: int) -> list[float]:
    times = []
    for _ in range(count):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return times


def _peak_mib(fn: Callable[[], object]) -> float:
    tracemalloc.start()
    try:
        fn()
        return round(tracemalloc.get_traced_memory()[1] / 2**20, 3)
    finally:
        tracemalloc.stop()


def _p95(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.95 * len(values)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _commit() -> str:
    from benchmarks.wan import _commit as commit

    return commit()


if __name__ == "__main__":
    main()
