"""Sybil tails beside an honest one, with the client's defaults (docs/reliability.md, "Sybil tails: figures").

    python -m benchmarks.sybils --runs 10      # make bench-sybils

SmolLM2-135M (30 blocks): an honest head H (0:15) and an honest tail T (15:30), and per scenario two
or three sybil tails S1.. (15:30) started through ``tests/kit/faulty_server.py``. Every generation is
made by a fresh client that keeps every default (verdict audits, spot-checks, looped runs); the
exclusion list (who is banned or avoided) is one object kept across every run of a scenario, so an
honest server convicted once stays counted.

Addresses: each server listens on its own loopback address (``--host``): H on 127.0.2.1, T on
127.0.0.1, the sybils on 127.0.1.1 (scenario 1: one address, one /24) or each on 127.0.1x.1 (scenario
2: one /24 each). The client counts every loopback server as the user's own machine, one group per
peer id (client/_witnesses.py); this benchmark patches ``machine_group`` in its own process so that
loopback addresses are grouped by /24 as public ones are: the group each server was seen in, from
the client's own connections, is written to the results.

1. Two and three sybils on one address: framing in audits (``--frame``), lying in live laps
   (``--lie-in-verdicts 1 --lie-after P --lie-when-live``), both, and confirming each other (the same
   lie in every verdict past P). Runs alternate the preferred live tail: T on even runs (the sybils
   audit it), S1 on odd runs (T and the other sybils audit it). Lying in live laps is run a second time
   with the head H in ``trusted_peers``: a tail refuted by evidence behind trusted hops is convicted.
2. The same lying sybils (confirming each other) on one /24 each: each generation exact, or its
   wrong tokens among the flagged (unconfirmed) ones, and ``audit="required"`` raising; then with T
   named in ``trusted_peers``.
3. ``verification="rejection"`` with a local draft model (the reference model itself) on an honest
   swarm with three tails (T, V1, V2): convictions, disputes, reports.
4. Many identities on one machine group (``--colluders``, 7 by default, on 127.0.12.1, 127.0.12.2 ..., one
   /24) beside a liar S1 on a /24 of its own, all telling the same lie; S1 is the preferred live tail, so
   its witnesses are the colluders and T. ``--identity-order`` chooses and draws witnesses by identity, as
   the client did before 2026-12-06, where the colluders could crowd T out of the pool and the last audit.
   Run before scenario 3.
5. The same lying identities spread over machine groups (``--spread-colluders N``, off by default: the
   live liar S1 on 127.0.11.1, N colluders on 127.0.21.1, 127.0.22.1 ..., a /24 each), beside T: with more
   than ``LAST_AUDIT_WITNESSES`` (6) candidate groups the last audit may leave T's out, and nobody is
   trusted; what gets through is counted as wrong tokens not flagged.

Counted per run: output equal to local transformers, who was convicted / banned / reported, disputed
peers, tokens confirmed by a trusted server / an untrusted one / unconfirmed (= flagged with a
warning), wrong tokens that were *not* flagged. Writes ``benchmarks/results/sybils.json``.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.lying_tails import wait_online

ARGS = ["--torch-threads", "1", "--log-level", "WARNING", "--update-period", "5"]
PROMPT = "The history of the printing press begins in"
LIE_AFTER = 32  # the lying sybils lie in every verdict from this position on
HOSTS = {"H": "127.0.2.1", "T": "127.0.0.1"}


def modes(after: int = LIE_AFTER, before: int = 0) -> dict[str, list[str]]:
    """Each kind of sybil: its tests/kit/faulty_server.py options (lies from ``after`` on; ``before``: and below it)."""
    lie = ["--lie-in-verdicts", "1", "--lie-after", str(after), *(["--lie-before", str(before)] if before else [])]
    return {
        "framing in audits": ["--frame"],
        "lying in live laps": [*lie, "--lie-when-live"],
        "both": ["--frame", *lie, "--lie-when-live"],
        "confirming each other": lie,
    }


def loopback_by_prefix(original):
    """``machine_group`` with loopback addresses grouped by /24, as public IPv4 addresses are."""

    def machine_group(addr: str, peer_id: str):
        group = original(addr, peer_id)
        if group is not None and group.startswith("local:"):
            from client._witnesses import _host

            host = _host(addr)
            return f"net:{ipaddress.ip_network(f'{host}/24', strict=False)}"
        return group

    return machine_group


def connect(swarm, excluded: set, routes, names):
    """A fresh client over ``routes`` (by public name), banning the servers convicted in earlier
    runs (``excluded``: peer ids); a failed ping's short exclusion is the client's own, as in use."""
    from swarm import AutoDistributedModelForCausalLM
    from tests.kit.routes import PreferredRoutes

    model = AutoDistributedModelForCausalLM.from_pretrained(
        "smollm2-135m", initial_peers=swarm.initial_peers, request_timeout=60.0
    )
    records = wait_online(model, names, time.monotonic() + 600)
    model.swarm.router = PreferredRoutes(*routes)
    forget(model, excluded)
    return model, {n: records[n].peer_id for n in names}


def forget(model, excluded: set) -> None:
    """What a fresh client would know of the swarm (``--reuse-client``): no exclusion, suspect,
    report or throughput measurement, but the bans of ``excluded`` (convictions in earlier runs)."""
    from client._swarm import ExclusionList, ThroughputMeter

    swarm = model.swarm
    swarm.excluded, swarm.suspects = ExclusionList(), ExclusionList(base_seconds=swarm.suspects.base_seconds)
    swarm.meter, swarm.reports = ThroughputMeter(), type(swarm.reports)()
    for peer_id in excluded:  # a server convicted in an earlier run stays banned
        swarm.excluded.ban(peer_id)


def trust_counts(model, stats, name_of: dict) -> dict:
    """What one generation did to trust, by server name: convictions, bans and reports so far,
    disputes, and its tokens by how they were confirmed."""
    return {
        "convicted": sorted(name_of.get(p, p) for p in stats.liars_excluded),
        "banned_so_far": sorted(name_of.get(p, p) for p in model.swarm.excluded.banned),
        "reported": sorted(name_of.get(p, p) for p in model.swarm.reports),
        "disputed": sorted({name_of.get(p, p) for p in stats.disputed_peers}),
        "tokens_confirmed_trusted": stats.tokens_confirmed_trusted,
        "tokens_confirmed_untrusted": stats.tokens_confirmed_untrusted,
        "tokens_unconfirmed": stats.tokens_unconfirmed,
        "new_tokens": stats.new_tokens,
        "verdict_audits": stats.verdict_audits,
    }


def one_run(model, peers, prompt, expected, sampled, seed, generate_kwargs) -> dict:
    """One generation: what it returned and how the client judged every server."""
    import torch

    from client import _loop
    from client.errors import UnconfirmedTokensError, UnconfirmedTokensWarning

    name_of = {p: n for n, p in peers.items()}
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=seed) if sampled else {}
    began = time.perf_counter()
    raised = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(expected), **sampling, **generate_kwargs)
            tokens = out[0, len(prompt) :].tolist()
        except UnconfirmedTokensError as e:
            raised, tokens = str(e)[:300], None
    stats = model.last_generation_stats
    _loop.run(model.swarm.flush_reports())
    flagged = any(issubclass(w.category, UnconfirmedTokensWarning) for w in caught)
    wrong_unflagged = None
    if tokens is not None:
        confirmed = len(tokens) - stats.tokens_unconfirmed
        wrong_unflagged = sum(a != b for a, b in zip(tokens[:confirmed], expected[:confirmed]))
    return {
        "sampled": sampled,
        "exact": tokens == expected if tokens is not None else None,
        "raised": raised,
        "flag_warning": flagged,
        **trust_counts(model, stats, name_of),
        "wrong_tokens_not_flagged": wrong_unflagged,
        "verdict_audits_skipped": stats.verdict_audits_skipped,
        "verdict_audits_undecided": stats.verdict_audits_undecided,
        "verdict_audits_by_evidence": stats.verdict_audits_by_evidence,  # client/_evidence.py
        "spot_checks_by_evidence": getattr(stats, "spot_checks_by_evidence", 0),  # a tail spot-check settled
        "spot_checks_undecided": stats.spot_checks_undecided,
        "route_tail": name_of.get(stats.route[-1][0]) if stats.route else None,
        "excluded_after": sorted(name_of.get(p, p) for p in model.swarm.excluded.current()),
        "failovers": stats.failovers,
        "events": stats.spot_check_events[-6:],
        "seconds": round(time.perf_counter() - began, 2),
    }


def scenario(swarm, title, sybils, flags, prompt, references, args, *, routes_for, generate_kwargs=None) -> dict:
    """Start ``sybils`` (name -> host) with ``flags``, run ``--runs`` greedy and seeded generations
    by fresh clients, stop the sybils."""
    from tests.kit.faulty_server import faulty
    from tests.kit.routes import PreferredRoutes

    processes = [
        swarm.start_server(15, 30, name=name, launcher=faulty(*flags) if flags else None, extra=["--host", host])
        for name, host in sybils.items()
    ]
    names = ["H", "T", *sybils]
    excluded: set = set()  # convictions, kept across every run of the scenario
    row: dict = {"scenario": title, "flags": flags, "hosts": {**HOSTS, **sybils}, "runs": []}
    shared = connect(swarm, excluded, routes_for(0), names) if args.reuse_client else None
    try:
        for run in range(args.first_run, args.runs):
            for sampled in (False,) if args.greedy_only else (False, True):
                seed = 1000 + run
                if shared is None:
                    model, peers = connect(swarm, excluded, routes_for(run), names)
                else:  # --reuse-client: one client per scenario, forgetting all but the bans between runs
                    model, peers = shared
                    model.swarm.router = PreferredRoutes(*routes_for(run))
                    forget(model, excluded)
                try:
                    kwargs = dict(generate_kwargs(peers) if generate_kwargs else {})
                    if args.audit_witnesses:
                        kwargs["audit_witnesses"] = args.audit_witnesses
                    result = one_run(model, peers, prompt, references(seed if sampled else None), sampled, seed, kwargs)
                    result["groups"] = groups(model, peers)
                    excluded |= model.swarm.excluded.banned
                finally:
                    if shared is None:
                        model.shutdown()
                row["runs"].append(result)
                short = {k: v for k, v in result.items() if k not in ("events", "groups")}
                print(f"  {title} run {run} {'sampled' if sampled else 'greedy'}: {short}", flush=True)
    finally:
        end_scenario(swarm, shared, processes)
    return row


def end_scenario(swarm, shared, processes) -> None:
    """Stop a scenario's shared client (``--reuse-client``) and the servers it started."""
    from swarm.local import kill_group

    if shared is not None:
        shared[0].shutdown()
    for process in processes:
        kill_group(process)
        swarm.servers.remove(process)


def groups(model, peers) -> dict:
    """The machine group each server is in as the client sees it (client/_witnesses.py), read from
    the client's own connections after the generation (None: no connection, no group)."""
    from client import _loop, _witnesses

    witnesses = _witnesses.Witnesses()
    _loop.run(witnesses.refresh(model.swarm.p2p))
    return {n: witnesses.groups.get(p) for n, p in peers.items()}


def summarize(row: dict) -> dict:
    runs = row["runs"]
    sybils = [n for n in row["hosts"] if n.startswith("S")]
    honest = ["H", "T"]

    def count(key, names):
        return sum(any(n in r[key] for n in names) for r in runs)

    done = [r for r in runs if r["raised"] is None]
    if row["scenario"].startswith("3."):
        return {
            "completed": f"{sum(r['completed'] for r in runs)} of {len(runs)}",
            "runs_anyone_convicted": sum(bool(r["convicted"]) for r in runs),
            "runs_anyone_reported": sum(bool(r["reported"]) for r in runs),
            "runs_anyone_disputed": sum(bool(r["disputed"]) for r in runs),
            "banned_at_end": runs[-1]["banned_so_far"] if runs else [],
            "verdict_audits": sum(r["verdict_audits"] for r in runs),
            "tokens_returned": sum(r["new_tokens"] for r in runs),
            "tokens_unconfirmed_flagged": sum(r["tokens_unconfirmed"] for r in runs),
            "runs_flagged": sum(r["flag_warning"] for r in runs),
        }
    return {
        "exact": f"{sum(bool(r['exact']) for r in done)} of {len(runs)}",
        "greedy_exact": f"{sum(bool(r['exact']) for r in done if not r['sampled'])} of "
        f"{sum(not r['sampled'] for r in runs)}",
        "sampled_exact": f"{sum(bool(r['exact']) for r in done if r['sampled'])} of {sum(r['sampled'] for r in runs)}",
        "raised": sum(r["raised"] is not None for r in runs),
        "runs_honest_convicted": count("convicted", honest),
        "runs_honest_reported": count("reported", honest),
        "runs_honest_disputed": count("disputed", honest),
        "honest_banned_at_end": sorted(set(runs[-1]["banned_so_far"]) & set(honest)) if runs else [],
        "runs_sybil_convicted": count("convicted", sybils),
        "runs_sybil_disputed": count("disputed", sybils),
        "runs_settled_by_evidence": sum(
            bool(r.get("verdict_audits_by_evidence") or r.get("spot_checks_by_evidence")) for r in runs
        ),
        "runs_undecided": sum(bool(r.get("verdict_audits_undecided") or r.get("spot_checks_undecided")) for r in runs),
        "runs_route_ended_on_T": sum(r.get("route_tail") == "T" for r in runs),
        "tokens_returned": sum(r["new_tokens"] for r in done),
        "tokens_confirmed_trusted": sum(r["tokens_confirmed_trusted"] for r in done),
        "tokens_confirmed_untrusted": sum(r["tokens_confirmed_untrusted"] for r in done),
        "tokens_unconfirmed_flagged": sum(r["tokens_unconfirmed"] for r in done),
        "runs_flagged": sum(r["flag_warning"] for r in runs),
        "wrong_tokens_not_flagged": sum(r["wrong_tokens_not_flagged"] or 0 for r in done),
        "groups": {n: sorted({r["groups"][n] for r in runs if r.get("groups", {}).get(n)}) for n in row["hosts"]},
    }


def plan(args) -> list[dict]:
    """The scenarios chosen, in order: title, sybils (name -> host), flags, routes, generate kwargs."""

    def routes(tails):
        return lambda run: [[("H", 0, 15), (t, 15, 30)] for t in tails(run)]

    chosen = []
    table = modes(args.lie_after, args.lie_before)
    for count in args.sybil_counts:
        names = [f"S{i + 1}" for i in range(count)]

        def alternate(run, names=names):  # T first on even runs, S1 on odd runs
            return ["T", *names] if run % 2 == 0 else [*names, "T"]

        for mode in args.modes or list(table):
            one_address = dict(
                title=f"1. {count} sybils on one address, {mode}",
                sybils={n: "127.0.1.1" for n in names},
                flags=table[mode],
                routes_for=routes(alternate),
            )
            chosen.append(one_address)
            if mode == "lying in live laps":  # the adaptive liar behind a trusted head: convicted, not refuted
                trusted_head = {"generate_kwargs": lambda peers: {"trusted_peers": [peers["H"]]}}
                chosen.append({**one_address, "title": f"{one_address['title']}, trusted_peers=[H]", **trusted_head})
    names = [f"S{i + 1}" for i in range(max(args.sybil_counts))]
    own = {n: f"127.0.{11 + i}.1" for i, n in enumerate(names)}
    lie = table["confirming each other"]
    chosen.append(
        dict(
            title=f"2. {len(names)} sybils on a /24 each, confirming each other",
            sybils=own,
            flags=lie,
            routes_for=routes(lambda run: [*names, "T"]),
        )
    )
    chosen.append(
        dict(
            title=f"2. {len(names)} sybils on a /24 each, confirming each other, audit=required",
            sybils=own,
            flags=lie,
            routes_for=routes(lambda run: [*names, "T"]),
            generate_kwargs=lambda peers: {"audit": "required"},
        )
    )
    chosen.append(
        dict(
            title=f"2. {len(names)} sybils on a /24 each, confirming each other, trusted_peers=[T]",
            sybils=own,
            flags=lie,
            routes_for=routes(lambda run: [*names, "T"]),
            generate_kwargs=lambda peers: {"trusted_peers": [peers["T"]], "audit": "required"},
        )
    )

    def beside_the_liar(title: str, colluders: dict) -> dict:  # S1 live on its own /24, the colluders its witnesses
        liar = names[0]
        sybils = {liar: own[liar], **colluders}
        return dict(title=title, sybils=sybils, flags=lie, routes_for=routes(lambda run: [liar, "T", *colluders]))

    if args.colluders:  # many identities on one machine group, beside a liar on another and the honest T
        colluders = {f"S{i + 2}": f"127.0.12.{i + 1}" for i in range(args.colluders)}
        title = f"4. a liar on its own /24 and {args.colluders} colluders on another, confirming each other"
        chosen.append(beside_the_liar(title, colluders))
    if args.spread_colluders:  # as many identities, each on a /24 of its own: more groups than the last audit's six
        spread = {f"S{i + 2}": f"127.0.{21 + i}.1" for i in range(args.spread_colluders)}
        title = f"5. a liar and {args.spread_colluders} colluders on a /24 each, confirming each other"
        chosen.append(beside_the_liar(title, spread))

    def picked(title: str, key: str) -> bool:  # "=title": that scenario alone (others contain its title)
        return title == key[1:] if key.startswith("=") else key in title

    chosen = [c for c in chosen if not args.only or any(picked(c["title"], k) for k in args.only)]
    for index, c in enumerate(chosen):  # names of their own: a stopped sybil's record outlives it in the DHT
        rename = {n: f"{n}{chr(ord('a') + index)}" for n in c["sybils"]}
        c["sybils"] = {rename[n]: host for n, host in c["sybils"].items()}
        c["routes_for"] = lambda run, f=c["routes_for"], r=rename: [
            [(r.get(n, n), a, b) for n, a, b in route] for route in f(run)
        ]
    return chosen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="greedy and seeded-sampling generations per scenario, each")
    p.add_argument("--first-run", type=int, default=0, help="start at this run (seed 1000 + run), to replay one")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--sybil-counts", type=int, nargs="+", default=[2, 3])
    p.add_argument("--modes", nargs="*", help="scenario 1's modes (default: all)")
    p.add_argument(
        "--only", nargs="*", help="only the scenarios whose title contains one of these (or, after '=', is it)"
    )
    p.add_argument("--greedy-only", action="store_true", help="no seeded-sampling generations")
    p.add_argument("--audit-witnesses", type=int, default=0, help="generate(audit_witnesses=N) (0: the default)")
    p.add_argument(
        "--last-audit-witnesses",
        type=int,
        default=0,
        help="candidates that verify the last audit (client/_shadow_turns.py LAST_AUDIT_WITNESSES; 0: the default, "
        "1: the pool alone, as before 2026-12-05)",
    )
    p.add_argument("--lie-after", type=int, default=LIE_AFTER, help="the lying sybils lie from this position on")
    p.add_argument(
        "--lie-before", type=int, default=0, help="the lying sybils lie only below this position too (0: to the end)"
    )
    p.add_argument(
        "--last-audit-window-only",
        action="store_true",
        help="which witness sees which token as in the client from 936b810 to dda9f00: the witnesses past the pool "
        "verify the last audit's window alone, and no last audit where an earlier one covered the end",
    )
    p.add_argument("--rejection-runs", type=int, default=20, help="scenario 3's generations (0: skip it)")
    p.add_argument(
        "--spread-colluders",
        type=int,
        default=0,
        help="scenario 5's colluders, each on a /24 of its own beside the live liar (0, the default: skip it)",
    )
    p.add_argument(
        "--colluders", type=int, default=7, help="scenario 4's identities on one /24 beside the live liar (0: skip it)"
    )
    p.add_argument(
        "--identity-order",
        action="store_true",
        help="witnesses chosen and drawn by identity, as before 2026-12-06 (ce770db, 64b9ebc): the candidates' "
        "shuffled order after the trusted ones, and the pool's draws one identity each, whatever group it is on",
    )
    p.add_argument(
        "--reuse-client",
        action="store_true",
        help="one client per scenario, its exclusions, suspects, reports and meter reset before each run "
        "(a fresh client's start costs ~1 min on a loaded 2-core machine)",
    )
    p.add_argument("--out", default="benchmarks/results/sybils.json")
    args = p.parse_args()

    from client import _shadow_turns, _witnesses
    from swarm.local import LocalSwarm

    if args.last_audit_witnesses:
        _shadow_turns.LAST_AUDIT_WITNESSES = args.last_audit_witnesses
    if args.last_audit_window_only:
        window_only(_shadow_turns.ShadowTurns)
    if args.identity_order:
        by_identity(_witnesses.Witnesses)

    _witnesses.machine_group = loopback_by_prefix(_witnesses.machine_group)
    from benchmarks.smol_reference import smollm2_references

    tokenizer, reference, prompt, references = smollm2_references(PROMPT, args.tokens)

    log_dir = Path(tempfile.mkdtemp(prefix="sybils-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {"commit": commit, "runs": args.runs, "first_run": args.first_run, "tokens": args.tokens}
    result["prompt_tokens"] = len(prompt)
    result["last_audit_witnesses"] = _shadow_turns.LAST_AUDIT_WITNESSES
    result["last_audit_window_only"] = args.last_audit_window_only
    result["identity_order"] = args.identity_order
    result.update(
        lie_after=args.lie_after,
        lie_before=args.lie_before,
        reuse_client=args.reuse_client,
        log_dir=str(log_dir),
        scenarios=[],
        summary={},
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with LocalSwarm("smollm2-135m", spans=[], server_args=ARGS, log_dir=str(log_dir)) as swarm:
        for name, host in HOSTS.items():
            swarm.start_server(*(0, 15) if name == "H" else (15, 30), name=name, extra=["--host", host])
        for chosen in plan(args):
            title = chosen.pop("title")
            row = scenario(swarm, title, prompt=prompt, references=references, args=args, **chosen)
            result["scenarios"].append(row)
            result["summary"][title] = summarize(row)
            print(json.dumps({title: result["summary"][title]}), flush=True)
            out.write_text(json.dumps(result, indent=1))
        if args.rejection_runs:
            rows = rejection(swarm, prompt, reference, args)
            result["scenarios"].append(rows)
            result["summary"][rows["scenario"]] = summarize(rows)
            print(json.dumps({rows["scenario"]: result["summary"][rows["scenario"]]}), flush=True)
    result["seconds"] = round(time.perf_counter() - began)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


def window_only(turns) -> None:
    """What the client verified before the witnesses past the pool verified every generated token (``936b810`` to
    ``dda9f00``), as far as which witness sees which token: those past the pool fill their caches up to the last
    audit's window and verify the window alone (here at once with the others, then in turn), the pool's verify
    what they have not; an earlier audit that covered the end leaves no last audit. Not its timing."""
    real_prefilled, real_verified = turns._prefilled, turns._verified_at_once

    async def window_alone(self, route, parked, ids, stats):
        if parked[3]:  # a witness of the pool: what it has not verified, as in its turn
            return await real_verified(self, route, parked, ids, stats)
        session, window = parked[0], len(ids)  # a fresh one past the pool: ids end at the window (below)
        return session, window - 1, await self._prefill(session, ids, window - 1, stats), window

    async def to_the_window(self, route, shadow_route, ids, window, stats):
        return await real_prefilled(self, route, shadow_route, ids[:window], window, stats)

    turns._verified_at_once, turns._prefilled = window_alone, to_the_window
    turns._past_the_pool = lambda self, route, length: False


def by_identity(witnesses) -> None:
    """Witnesses as the client chose and drew them before ``ce770db`` and ``64b9ebc``: trusted first, then
    the candidates' own (shuffled) order, however many share a machine group; each pool draw one identity."""

    def choose(self, candidates, of):
        found = [c for c in candidates if self.independent(c.peer_id, of)]
        return sorted(found, key=lambda c: c.peer_id not in self.trusted)

    witnesses.choose = choose
    witnesses.draw = lambda self, rng, candidates: rng.choice(candidates)


def rejection(swarm, prompt, reference, args) -> dict:
    """Scenario 3: three honest tails, a local draft model, ``verification="rejection"``."""
    import torch

    from tests.kit.routes import PreferredRoutes

    extra = {"V1": "127.0.21.1", "V2": "127.0.22.1"}
    processes = [swarm.start_server(15, 30, name=n, extra=["--host", h]) for n, h in extra.items()]
    names = ["H", "T", *extra]
    excluded: set = set()
    title = "3. rejection sampling, three honest tails"
    row: dict = {"scenario": title, "flags": [], "hosts": {**HOSTS, **extra}, "runs": []}
    tails = ["T", "V1", "V2"]
    shared = connect(swarm, excluded, [[("H", 0, 15), ("T", 15, 30)]], names) if args.reuse_client else None
    try:
        for run in range(args.rejection_runs):
            order = tails[run % 3 :] + tails[: run % 3]  # each honest tail live in turn
            routes = [[("H", 0, 15), (t, 15, 30)] for t in order]
            if shared is None:
                model, peers = connect(swarm, excluded, routes, names)
            else:
                model, peers = shared
                model.swarm.router = PreferredRoutes(*routes)
                forget(model, excluded)
            name_of = {p: n for n, p in peers.items()}
            try:
                began = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = model.generate(
                        torch.tensor([prompt]),
                        max_new_tokens=args.tokens,
                        do_sample=True,
                        temperature=0.8,
                        seed=2000 + run,
                        draft_model=reference,
                        verification="rejection",
                    )
                stats = model.last_generation_stats
                excluded |= model.swarm.excluded.banned
                from client import _loop

                _loop.run(model.swarm.flush_reports())
                result = {
                    "sampled": True,
                    "exact": None,  # rejection sampling is exact in distribution, not token by token
                    "raised": None,
                    "completed": out.shape[1] > len(prompt),
                    "flag_warning": bool(caught),
                    **trust_counts(model, stats, name_of),
                    "wrong_tokens_not_flagged": None,
                    "route_tail": name_of.get(stats.route[-1][0]) if stats.route else None,
                    "seconds": round(time.perf_counter() - began, 2),
                }
            finally:
                if shared is None:
                    model.shutdown()
            row["runs"].append(result)
            print(f"  {title} run {run}: {result}", flush=True)
    finally:
        end_scenario(swarm, shared, processes)
    return row


if __name__ == "__main__":
    main()
