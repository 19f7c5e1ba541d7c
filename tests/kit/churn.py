"""Churn with real servers (issue 28): servers die and join while clients generate.

    python -m benchmarks.churn --servers 24 --minutes 10 --period 20 --clients 4   # the issue's size
    make bench-churn CHURN_SERVERS=12 CHURN_MINUTES=5                                          # what this machine holds

A loopback swarm (``swarm.local.LocalSwarm``): a bootstrap DHT peer, ``--servers`` server processes
of ``--model`` (SmolLM2-135M by default), each started with ``--num-blocks`` 3 to 5 (drawn) so that
every server places itself where the swarm needs it most (and moves when another span helps more,
``--balance-period``), and the health dashboard. The first servers start a few at a time, each wave
once the last one is online, so that placement sees the swarm it joins.

Then for ``--minutes``, every ``--period`` seconds one random server gets SIGKILL or SIGTERM (drawn)
and a new one joins (a new identity, its own drawn ``--num-blocks``), while ``--clients`` clients
(one ``AutoDistributedModelForCausalLM`` each, own DHT node) generate ``--tokens`` tokens in a loop,
cycling through greedy and seeded sampling, each with and without speculation. Every output is
compared with local transformers in float32 through the exact rule's reference sampler
(transformers' logits over the whole context, one token at a time; ``protocol.sampling.choose_token``:
the argmax for greedy, a draw keyed by (seed, position) for seeded sampling), computed before the
swarm starts.

Figures (the last line of output is one JSON object with all of them):

- generations started, completed, token-identical (goal: all), and failed (with the errors);
- failovers per generation, and p50/p95 of the extra seconds per failover: from the failure to the
  next committed token (``GenerationStats.failover_time``, split per failover);
- seconds without full coverage: time during which some block had no ONLINE record of a server
  that was still alive (the ground truth the launcher knows, read through the DHT every second);
  and whether coverage came back after the churn;
- how long a joining server took to be ONLINE (p50/p95);
- the dashboard's poll (``swarm.dashboard.poller.SwarmReader.poll``, the code the dashboard runs,
  from a node of its own) and a GET of the dashboard's ``/api/v1/state``, p50/p95;
- resident memory (RSS and PSS, the server with its DHT process and libp2p daemon) and CPU of an
  idle server, measured before the clients start;
- processes left behind: members of a SIGKILLed server's session still alive 10 s after the kill
  (before the launcher reaps them: what ``swarm/lifeline.py`` guarantees), and members of every
  session started here still alive after the swarm stopped.

``run(ChurnConfig(...), rows)`` is the whole benchmark as a function, kept here in the test kit:
``benchmarks/churn.py`` is its command line, and ``tests/network/test_churn.py`` runs a small version of
it with a tiny checkpoint and asserts its behaviour figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import psutil
import torch

from swarm.local import LocalSwarm
from tests.kit.churn_fleet import Fleet, Monitor, session_members

MODES = {
    "greedy": dict(speculation=None),
    "greedy+speculation": dict(),  # the default retrieval (suffix) speculation
    "sampled": dict(speculation=None, do_sample=True, temperature=0.8, top_p=0.9),
    "sampled+speculation": dict(do_sample=True, temperature=0.8, top_p=0.9),
}
REFERENCE_CACHE = Path("test-artifacts/bench-churn-references.json")


@dataclass
class ChurnConfig:
    model: str = "smollm2-135m"
    servers: int = 24
    duration_s: float = 600.0
    period_s: float = 20.0
    clients: int = 4
    tokens: int = 24
    seed: int = 28
    num_blocks: tuple[int, int] = (3, 5)  # each server's --num-blocks, drawn from this range
    initial_spans: Optional[Sequence[tuple[int, int]]] = None  # start with these --blocks instead (a fast test start)
    wave: int = 2  # initial servers started at once
    update_period: float = 5.0  # the CI test's (faster figures); the command line's default is the server's 15 s
    check_every: float = 1.0  # seconds between the monitor's coverage checks (each reads every block's key)
    balance_period: float = 60.0
    drain_seconds: float = 2.0
    request_timeout: float = 20.0
    route_attempts: int = 7  # the client's tries for a route: 1+2+...+32 s = ~63 s of waiting for coverage
    dashboard: bool = True
    # only kill a server whose blocks another alive, ONLINE server also holds (CI: generations must
    # complete, whatever the draw); the benchmark draws from every server, as real churn does
    keep_coverage: bool = False
    cache_references: bool = True  # in test-artifacts/ (the test's tiny checkpoint is new each run: off)
    idle_sample_s: float = 20.0
    log_dir: Optional[str] = "test-artifacts/bench-churn"
    extra_server_args: Sequence[str] = ()


def references(
    source: str, rows: list[list[int]], tokens: int, seeds: Sequence[int], cache_references: bool = False
) -> dict[tuple[str, int], list[int]]:
    """(kind, prompt index) -> what the swarm must produce, by local transformers in float32 and the
    exact rule's reference sampler: the logits of the whole context, one token at a time (no cache,
    no drafts), the token chosen by ``protocol.sampling.choose_token``: the argmax for greedy, for
    seeded sampling a draw keyed by (``seeds[k]``, position); it stops after an end-of-sequence id
    as the client does. With ``cache_references``, kept in REFERENCE_CACHE by (checkpoint, prompts,
    tokens, seeds): SmolLM2's take minutes on a loaded 2-core machine."""
    from transformers import AutoModelForCausalLM

    key = json.dumps([source, rows, tokens, list(seeds), MODES["sampled"]])
    cache = json.loads(REFERENCE_CACHE.read_text()) if cache_references and REFERENCE_CACHE.exists() else {}
    if key in cache:
        return {(kind, int(k)): ids for kind, k, ids in cache[key]}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core machine: more threads only contend
    try:
        out = _references(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(), rows, tokens, seeds)
    finally:
        torch.set_num_threads(threads)
    if cache_references:
        cache[key] = [(kind, k, ids) for (kind, k), ids in out.items()]
        REFERENCE_CACHE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE_CACHE.write_text(json.dumps(cache))
    return out


def _references(model, rows: list[list[int]], tokens: int, seeds: Sequence[int]) -> dict[tuple[str, int], list[int]]:
    from protocol.messages import SamplingParams
    from tests.kit.reference import reference_sample

    eos = model.config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    sampling = {k: v for k, v in MODES["sampled"].items() if k != "speculation"}
    out = {}
    for k, row in enumerate(rows):
        for kind, params in (("greedy", SamplingParams()), ("sampled", SamplingParams(**sampling, seed=seeds[k]))):
            out[(kind, k)] = reference_sample(model, row, tokens, params, eos)
    return out


@dataclass
class Generation:
    client: int
    mode: str
    prompt: int
    completed: bool = False
    identical: bool = False
    failovers: int = 0
    failover_s: list[float] = field(default_factory=list)  # per failover: failure -> next committed token
    wall_s: float = 0.0
    error: Optional[str] = None


async def generate_one(
    model, row: list[int], tokens: int, kwargs: dict, record: Generation, expected: list[int]
) -> None:
    out, stats, counted, failover_time = [], None, 0, 0.0
    began = time.monotonic()
    try:
        async for chunk in model.agenerate_stream(row, max_new_tokens=tokens, **kwargs):
            out += chunk.token_ids
            stats = chunk.stats  # live: the decoder's own, read as each lap commits
            if stats.failover_time > failover_time:  # one or more failovers ended with this lap
                new = max(1, stats.failovers - counted)
                record.failover_s += [(stats.failover_time - failover_time) / new] * new
                counted, failover_time = stats.failovers, stats.failover_time
        record.completed = True
        record.identical = out == expected
        if not record.identical:
            record.error = f"differs: got {out}, expected {expected}"
    except Exception as e:  # noqa: BLE001 - a generation that does not complete is the finding
        record.error = f"{type(e).__name__}: {e}"
    record.failovers = stats.failovers if stats is not None else 0
    record.wall_s = time.monotonic() - began


async def client_loop(
    index: int, model, rows, refs, config: ChurnConfig, seeds, stop: asyncio.Event, results: list[Generation]
) -> None:
    j = 0
    while not stop.is_set():
        mode = list(MODES)[(index + j) % len(MODES)]
        prompt = (index * 3 + j) % len(rows)
        kwargs = dict(MODES[mode])
        if kwargs.get("do_sample"):
            kwargs["seed"] = seeds[prompt]
        record = Generation(index, mode, prompt)
        results.append(record)
        expected = refs[("sampled" if kwargs.get("do_sample") else "greedy", prompt)]
        await generate_one(model, rows[prompt], config.tokens, kwargs, record, expected)
        verdict = "identical" if record.identical else "DIFFERS" if record.completed else "FAILED"
        print(
            f"client {index} {mode:20s} prompt {prompt}: {verdict}, {record.failovers} failovers, "
            f"{record.wall_s:.1f} s" + (f" -- {record.error[:300]}" if record.error else ""),
            flush=True,
        )
        j += 1


def idle_server(fleet: Fleet, seconds: float) -> dict:
    """RSS and PSS of every alive server's process tree (server, DHT process, p2pd), median over
    servers; CPU of the trees over ``seconds`` while no client is connected."""
    trees = {}
    for name, process in fleet.alive.items():
        try:
            root = psutil.Process(process.pid)
            trees[name] = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass

    def cpu(procs) -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    before = {n: cpu(ps) for n, ps in trees.items()}
    time.sleep(seconds)
    cpu_pct = [100 * (cpu(ps) - before[n]) / seconds for n, ps in trees.items()]
    rss, pss = [], []
    for procs in trees.values():
        r = s = 0
        for p in procs:
            try:
                info = p.memory_full_info()
                r, s = r + info.rss, s + info.pss
            except psutil.Error:
                pass
        rss.append(r / 2**20)
        pss.append(s / 2**20)
    return dict(
        idle_server_rss_mib=round(statistics.median(rss)),
        idle_server_pss_mib=round(statistics.median(pss)),
        idle_server_cpu_percent=round(statistics.median(cpu_pct), 2),
    )


def percentiles(name: str, values: list[float], digits: int = 2) -> dict:
    if not values:
        return {f"{name}_p50": None, f"{name}_p95": None}
    ordered = sorted(values)
    return {
        f"{name}_p50": round(statistics.median(ordered), digits),
        f"{name}_p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], digits),
    }


def run(config: ChurnConfig, rows: list[list[int]], commit: str = "") -> dict:
    """The whole benchmark; returns its figures (see the module docstring). ``commit``: the
    checkout measured, for the figures."""
    from protocol.models import resolve_model
    from swarm import AutoDistributedModelForCausalLM

    rng = random.Random(config.seed)
    seeds = [1000 + k for k in range(len(rows))]
    t0 = time.monotonic()
    refs = references(resolve_model(config.model).source, rows, config.tokens, seeds, config.cache_references)
    print(f"references: {len(refs)} in {time.monotonic() - t0:.1f} s", flush=True)
    server_args = [
        "--torch-threads",
        "1",
        "--log-level",
        "WARNING",
        "--update-period",
        str(config.update_period),
        "--drain-seconds",
        str(config.drain_seconds),
        "--balance-period",
        str(config.balance_period),
        *config.extra_server_args,
    ]
    swarm = LocalSwarm(
        config.model,
        spans=[],
        server_args=server_args,
        log_dir=config.log_dir,
        dashboard_port=0 if config.dashboard else None,
    )
    figures: dict[str, Any] = dict(
        model=config.model,
        servers=config.servers,
        duration_s=config.duration_s,
        period_s=config.period_s,
        clients=config.clients,
        tokens=config.tokens,
    )
    results: list[Generation] = []
    models, monitor = [], None
    began = time.monotonic()
    with swarm:
        figures["blocks"] = swarm.num_blocks
        fleet = Fleet(swarm, config, rng)
        fleet.sessions.append(swarm.bootstrap.pid)
        if swarm.dashboard is not None:
            fleet.sessions.append(swarm.dashboard.pid)
        monitor = Monitor(swarm, fleet, poll_every=config.period_s, check_every=config.check_every)
        try:
            monitor.start()
            if config.initial_spans is not None:
                for span in config.initial_spans:
                    fleet.join(span)
            else:
                while fleet.count < config.servers:
                    for _ in range(min(config.wave, config.servers - fleet.count)):
                        fleet.join()
                    _until(lambda: not fleet.started_at, 300, fleet)
            _until(lambda: not fleet.started_at and monitor.covered, 300, fleet)
            figures["start_s"] = round(time.monotonic() - began, 1)
            print(
                f"{len(fleet.alive)} servers online and covering {swarm.num_blocks} blocks after "
                f"{figures['start_s']} s",
                flush=True,
            )
            figures.update(idle_server(fleet, config.idle_sample_s))
            fleet.online_after.clear()  # from here: servers joining a busy, churning swarm
            for _ in range(config.clients):
                model = AutoDistributedModelForCausalLM.from_pretrained(
                    config.model, initial_peers=swarm.initial_peers, request_timeout=config.request_timeout
                )
                model.swarm.max_route_attempts = config.route_attempts
                models.append(model)
            figures.update(asyncio.run(churn(config, fleet, monitor, models, rows, refs, seeds, results)))
            restored = monitor.wait_covered(120.0)
            figures["coverage_restored"] = restored is not None
            figures["coverage_restored_after_s"] = None if restored is None else round(restored, 1)
            figures["servers_alive_at_end"] = len(fleet.alive)
        finally:
            for model in models:
                model.shutdown()
            if monitor is not None:
                monitor.shutdown()
            fleet.finish_reaping()
    # the swarm has stopped: every session started here must be empty
    time.sleep(2)
    left = [p for sid in fleet.sessions for p in session_members(sid)]
    figures["processes_left_behind"] = len(left)
    figures["orphans_10s_after_sigkill"] = fleet.orphans_after_kill
    for p in left:  # never leave them, even when the figure says they were there
        try:
            p.kill()
        except psutil.Error:
            pass
    figures.update(summarize(results, fleet, monitor))
    figures["wall_s"] = round(time.monotonic() - began, 1)
    figures["load_average"] = round(os.getloadavg()[0], 1)
    figures["commit"] = commit
    return figures


async def churn(config, fleet: Fleet, monitor: Monitor, models, rows, refs, seeds, results) -> dict:
    stop = asyncio.Event()
    clients = [
        asyncio.create_task(client_loop(i, m, rows, refs, config, seeds, stop, results)) for i, m in enumerate(models)
    ]
    monitor.counting = True
    began, events = time.monotonic(), []
    try:
        while time.monotonic() - began < config.duration_s:
            await asyncio.sleep(config.period_s)
            if any(c.done() for c in clients):
                break  # a client crashed: its exception surfaces below
            left = fleet.leave(dict(monitor.spans))
            name, how = left if left is not None else ("nobody (no server to spare)", "-")
            joined = fleet.join()
            events.append((round(time.monotonic() - began, 1), name, how, joined))
            print(f"t={events[-1][0]:.0f} s: {how} {name}, {joined} joins ({len(fleet.alive)} alive)", flush=True)
    finally:
        stop.set()
        await asyncio.gather(*clients)
        monitor.counting = False
    return dict(
        churn_s=round(time.monotonic() - began, 1),
        churn_events=len(events),
        churn_skipped=sum(how == "-" for _, _, how, _ in events),
    )


def summarize(results: list[Generation], fleet: Fleet, monitor: Monitor) -> dict:
    per_failover = [s for r in results for s in r.failover_s]
    by_mode = {
        mode: dict(
            started=sum(r.mode == mode for r in results), identical=sum(r.mode == mode and r.identical for r in results)
        )
        for mode in MODES
    }
    return dict(
        generations_started=len(results),
        generations_completed=sum(r.completed for r in results),
        generations_identical=sum(r.identical for r in results),
        generations_failed=sum(not r.completed for r in results),
        generations_by_mode=by_mode,
        errors=sorted({r.error[:200] for r in results if r.error}),
        failovers=sum(r.failovers for r in results),
        failovers_per_generation=round(sum(r.failovers for r in results) / max(1, len(results)), 3),
        **percentiles("failover_extra_s", per_failover),
        uncovered_s=round(monitor.uncovered_s, 1),
        kills=dict(fleet.kills),
        joins=fleet.count,
        **percentiles("join_online_s", fleet.online_after, 1),
        **percentiles("dashboard_poll_s", monitor.poll_s),
        **percentiles("dashboard_state_get_s", monitor.state_s, 3),
        dashboard_errors=monitor.poll_errors[:5],
        dashboard_poll_servers_p50=statistics.median(monitor.poll_servers) if monitor.poll_servers else None,
    )


def _until(condition, timeout: float, fleet: Fleet) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [n for n, p in fleet.alive.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"server {dead[0]} exited with code {fleet.alive[dead[0]].returncode} during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"servers {sorted(fleet.started_at)} not online (or blocks uncovered) within {timeout:.0f} s"
            )
        time.sleep(0.5)
