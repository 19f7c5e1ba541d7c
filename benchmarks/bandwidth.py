"""Bandwidth benchmark: a 1,000-token prompt and decoding over 20 and 100 Mbit/s links, per codec.

    python -m benchmarks.bandwidth            # every codec the server offers of none, float16,
                                              # blockwise8, blockwise4; 20 and 100 Mbit/s (~20 min)
    python -m benchmarks.bandwidth --quick    # smoke run: codec none, 20 Mbit/s, one repeat
    python -m benchmarks.bandwidth --codecs none float16 --rates 20 0    # 0: unshaped link

Needs root: every peer is its own host in a network namespace (tests/kit/netns.py): a bootstrap
node, three servers of SmolLM2-135M (10 blocks each) and the client, all on one bridge, every
host's link shaped both ways with tc tbf to the rate. Delay comes from the delay proxy
(swarm/delay_proxy.py), which runs in each server's namespace in front of the server's announced
address (25 ms one way), so a lap crosses 4 delayed, shaped links: client -> head -> mid -> tail
-> client. Servers are restarted per codec (``--compression`` is a server flag); the links are
re-shaped in place between rates.

Measured, each a few times (medians reported):

- **prompt**: seconds from ``generate()`` to the first token of a 1,000-token prompt (the first
  1,000 tokens of a Python standard-library source file), ``max_new_tokens=1``,
  ``speculation=None``: one lap that carries 1,000 positions of activations across each server
  link, plus opening the session;
- **decode**: tokens/s over ``--max-new-tokens`` new tokens after a code-editing prompt (its
  prefill done in the same inference session beforehand, so only decoding is timed), with
  speculation=None and with the default (suffix) speculation;
- **bytes each host sent** on its link during the measurement (bridge-port counters: what really
  crossed the wire, TCP/IP headers included), minus the host's idle traffic (DHT upkeep, measured
  for ``--idle-seconds`` before the measurements) over the measurement's duration; "wire s" is
  that for the head and the middle server divided by the link rate, and "busy" the time their
  links were measured sending at over a quarter of the rate (counters sampled every 5 ms during
  the prompt): the seconds of the prompt spent on the wire.

Rates alternate within each repeat (and the order flips every other repeat), so a slow spell of
the machine falls on every rate alike; "measured" differences between rates are medians of the
differences between back-to-back prompts.

Prints a Markdown table and writes ``benchmarks/results/bandwidth.json`` (with commit and date).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from tests.kit import netns, netns_links

MODEL = "smollm2-135m"
INTERNAL_ARGS = ("initial_peers", "testbed", "client", "proxy", "target", "servers", "delay_ms")
CODECS = ["none", "float16", "blockwise8", "blockwise4"]
RATES = [20.0, 100.0]
SERVERS = 3
BOOTSTRAP_PORT = 31337
SERVER_PORT = 31400  # every host has its own namespace, hence its own port space: fixed ports
PROXY_PORT = 31401
READY_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 1200.0
UNSHAPED_MBIT = 1000.0  # what "busy" means on an unshaped link: sending faster than a quarter of this
REPO = Path(__file__).resolve().parent.parent
ENV = dict(
    os.environ,
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
)


# ---- the prompt ------------------------------------------------------------------------------


def long_prompt(tokenizer, tokens: int) -> tuple[list[int], str]:
    """Exactly ``tokens`` token ids from a standard-library source file (available offline)."""
    import textwrap

    source = Path(textwrap.__file__)
    ids = tokenizer(source.read_text())["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"{source} has only {len(ids)} tokens")
    return ids[:tokens], f"{source.name} (Python {sys.version.split()[0]}), first {tokens} tokens"


# ---- the delay proxy in a server's namespace --------------------------------------------------


def proxy_main(listen: str, target: str, delay_ms: float) -> int:
    """Run a :class:`DelayProxy` from ``listen`` (the namespace's address) to ``target`` until SIGTERM.

    DelayProxy accepts only loopback addresses, its guard against sending traffic off the machine.
    Here the proxy must listen on the namespace's own address, which peers in the other namespaces
    dial; a testbed namespace has no route to anywhere but the testbed's bridge, so the guard is
    replaced by these checks: we run in a testbed's network namespace, and both addresses are
    private testbed addresses."""
    from swarm.delay_proxy import DelayProxy

    (listen_host, listen_port), (target_host, target_port) = _host_port(listen), _host_port(target)
    if netns.current_testbed_namespace() is None:
        raise SystemExit("--proxy runs only inside a testbed network namespace")
    subnet = ipaddress.ip_network(netns.DEFAULT_SUBNET)
    for host in (listen_host, target_host):
        if ipaddress.ip_address(host) not in subnet:
            raise SystemExit(f"--proxy: {host} is not a testbed address ({subnet})")

    async def serve() -> None:
        proxy = DelayProxy("127.0.0.1", target_port, delay_ms, "127.0.0.1", listen_port)
        proxy.listen_host, proxy.target_host = listen_host, target_host  # checked above
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await proxy.start()
        print("ready", proxy.listen_port, flush=True)
        await stop.wait()
        await proxy.stop()

    asyncio.run(serve())
    return 0


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


# ---- the client (inside the client's namespace) -----------------------------------------------


def wait_for_servers(initial_peers: list[str], expected: int, timeout: float) -> None:
    from transformers import AutoConfig

    from protocol.dht import make_dht
    from protocol.dht_records import wait_until_online
    from protocol.models import resolve_model

    resolved = resolve_model(MODEL)
    num_blocks = AutoConfig.from_pretrained(resolved.source).num_hidden_layers
    dht = make_dht(initial_peers=initial_peers, client_mode=True)
    try:
        wait_until_online(dht, resolved.dht_name, num_blocks, expected, timeout)
    finally:
        dht.shutdown()


def client_main(args: argparse.Namespace) -> int:
    import torch

    from swarm import AutoDistributedModelForCausalLM
    from tests.kit.prompts import CODE_EDITING

    torch.set_num_threads(1)
    began = time.perf_counter()
    wait_for_servers(args.initial_peers, args.servers, READY_TIMEOUT_S)
    ready_s = time.perf_counter() - began
    counters = lambda: netns_links.read_counters_spec(args.testbed)  # noqa: E731
    model = AutoDistributedModelForCausalLM.from_pretrained(MODEL, initial_peers=args.initial_peers)
    tokenizer = model.tokenizer
    prompt, prompt_source = long_prompt(tokenizer, args.prompt_tokens)
    prompt_ids = torch.tensor([prompt])
    chat = [{"role": "user", "content": CODE_EDITING[0]}]
    chat_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    model.generate(chat_ids, max_new_tokens=4, speculation=None)  # connections and code paths warm
    model.generate(prompt_ids, max_new_tokens=1, speculation=None)  # the first long prompt allocates more

    def sent(before: dict, after: dict) -> dict:
        return {h: after[h]["sent"] - before[h]["sent"] for h in after}

    # what the hosts send while nobody generates (DHT upkeep, pings), to tell it from activations
    before, t0 = counters(), time.perf_counter()
    time.sleep(args.idle_seconds)
    idle = {h: b / (time.perf_counter() - t0) for h, b in sent(before, counters()).items()}
    print(
        f"    idle traffic, bytes/s: {', '.join(f'{h} {b:.0f}' for h, b in idle.items())}", file=sys.stderr, flush=True
    )

    def prefill(rate: float) -> dict:
        before = counters()
        with netns_links.CounterSampler(args.testbed) as sampler:  # when each link was busy, every 5 ms
            t0 = time.perf_counter()
            model.generate(prompt_ids, max_new_tokens=1, speculation=None)
            seconds = time.perf_counter() - t0
        s = model.last_generation_stats
        busy = {h: sampler.busy_seconds(h, rate or UNSHAPED_MBIT) for h in sampler.hosts}
        print(
            f"    {_link(rate)}: prompt of {len(prompt)} tokens {seconds:.2f} s, links of head and mid busy "
            f"{busy['s0']:.2f} + {busy['s1']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        return dict(
            rate_mbit=rate,
            seconds=seconds,
            wall_time=s.wall_time,
            bytes_up=s.bytes_up,
            bytes_down=s.bytes_down,
            sent=sent(before, counters()),
            busy_s=busy,
        )

    def decode(rate: float, mode: Optional[str]) -> dict:
        model.reset_draft_store()  # no mode may draft from another's answer
        with model.inference_session():
            first = model.generate(chat_ids, max_new_tokens=1, speculation=None)  # the prompt's prefill, untimed
            before = counters()
            out = model.generate(first, max_new_tokens=args.max_new_tokens, speculation=mode)
            s = model.last_generation_stats
            print(
                f"    {_link(rate)}: decode, speculation={mode}: {s.tokens_per_second:.2f} tokens/s, "
                f"{s.accepted_per_lap:.2f} tokens/lap",
                file=sys.stderr,
                flush=True,
            )
            return dict(
                rate_mbit=rate,
                mode=str(mode),
                tokens=s.new_tokens,
                seconds=s.wall_time,
                laps=s.laps,
                drafted=s.drafted,
                accepted_per_lap=s.accepted_per_lap,
                bytes_up=s.bytes_up,
                bytes_down=s.bytes_down,
                sent=sent(before, counters()),
                output=out[0, chat_ids.shape[1] :].tolist(),
            )

    prefills, decodes = [], []
    for repeat in range(max(args.repeats, args.prompt_repeats)):
        for rate in args.rates if repeat % 2 == 0 else args.rates[::-1]:
            netns_links.shape_spec(args.testbed, rate)
            if repeat < args.prompt_repeats:
                prefills.append(prefill(rate))
            if repeat < args.repeats:
                decodes += [decode(rate, None), decode(rate, "suffix")]
    route = [(p, a, b) for p, a, b in model.last_generation_stats.route]
    model.shutdown()
    print(
        json.dumps(
            dict(
                ready_s=ready_s,
                prompt_source=prompt_source,
                prompt_tokens=len(prompt),
                idle_bytes_per_s=idle,
                prefills=prefills,
                decodes=decodes,
                route=route,
            )
        ),
        flush=True,
    )
    return 0


# ---- the orchestrator (in the machine's namespace) --------------------------------------------


def available_codecs() -> list[str]:
    """The choices of ``python -m swarm.server --compression``."""
    done = subprocess.run([sys.executable, "-m", "swarm.server", "--help"], capture_output=True, text=True, env=ENV)
    m = re.search(r"--compression\s+\{([^}]*)\}", done.stdout)
    return m.group(1).split(",") if m else ["none"]


class CodecSwarm:
    """Bootstrap, proxies and servers of one codec in the testbed's namespaces."""

    def __init__(self, bed: netns.Testbed, codec: str, spans, delay_ms: float, log_dir: str):
        self.bed, self.codec, self.spans, self.delay_ms, self.log_dir = bed, codec, spans, delay_ms, log_dir
        self.bootstrap: Optional[subprocess.Popen] = None
        self.proxies: list[subprocess.Popen] = []
        self.servers: list[subprocess.Popen] = []
        self.initial_peers: list[str] = []

    def _log(self, name: str):
        return open(os.path.join(self.log_dir, f"{self.codec}-{name}.log"), "w")

    def start(self) -> None:
        py = sys.executable
        ip = self.bed.ip("boot")
        self.bootstrap = self.bed.run(
            "boot",
            [py, "-m", "swarm.bootstrap", "--host", ip, "--port", str(BOOTSTRAP_PORT), "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            stderr=self._log("bootstrap"),
            env=ENV,
        )
        line = self.bootstrap.stdout.readline().decode().strip()
        if not line:
            raise RuntimeError(f"the bootstrap node exited before printing its address (logs in {self.log_dir})")
        self.initial_peers = [line]
        for index, (start, end) in enumerate(self.spans):
            host = f"s{index}"
            ip = self.bed.ip(host)
            proxy = self.bed.run(
                host,
                [
                    py,
                    "-m",
                    "benchmarks.bandwidth",
                    "--proxy",
                    f"{ip}:{PROXY_PORT}",
                    "--target",
                    f"{ip}:{SERVER_PORT}",
                    "--delay-ms",
                    str(self.delay_ms),
                ],
                stdout=subprocess.PIPE,
                stderr=self._log(f"proxy{index}"),
                env=ENV,
            )
            self.proxies.append(proxy)
            if not proxy.stdout.readline().decode().startswith("ready"):
                raise RuntimeError(f"the delay proxy of {host} did not start (logs in {self.log_dir})")
            args = [
                py,
                "-m",
                "swarm.server",
                "--model",
                MODEL,
                "--initial-peers",
                *self.initial_peers,
                "--blocks",
                f"{start}:{end}",
                "--host",
                ip,
                "--port",
                str(SERVER_PORT),
                "--announce-maddrs",
                f"/ip4/{ip}/tcp/{PROXY_PORT}",
                "--torch-threads",
                "1",
                "--compression",
                self.codec,
                "--public-name",
                f"bw-{host}",
                "--drain-seconds",
                "2",
                "--log-level",
                "WARNING",
            ]
            self.servers.append(self.bed.run(host, args, stderr=self._log(f"server{index}"), env=ENV))

    def check_alive(self) -> None:
        for process in [self.bootstrap, *self.proxies, *self.servers]:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"a peer exited with code {process.returncode} (logs in {self.log_dir})")

    def stop(self) -> None:
        for process in self.servers:  # servers leave the DHT cleanly, in parallel
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for process in self.servers:
            self.bed.kill(process, timeout=15)
        for process in [*self.proxies, self.bootstrap]:
            if process is not None:
                self.bed.kill(process, timeout=5)


def run_client(bed: netns.Testbed, swarm: CodecSwarm, args: argparse.Namespace) -> dict:
    argv = [
        sys.executable,
        "-m",
        "benchmarks.bandwidth",
        "--client",
        "--initial-peers",
        *swarm.initial_peers,
        "--servers",
        str(SERVERS),
        "--repeats",
        str(args.repeats),
        "--prompt-repeats",
        str(args.prompt_repeats),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--idle-seconds",
        str(args.idle_seconds),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--rates",
        *map(str, args.rates),
        "--testbed",
        bed.spec(),
    ]
    with tempfile.TemporaryFile() as out:
        client = bed.run("client", argv, stdout=out, env=ENV)
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        try:
            while client.poll() is None:
                swarm.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the client ran longer than {CLIENT_TIMEOUT_S:.0f} s")
                time.sleep(1.0)
        finally:
            bed.kill(client)
        out.seek(0)
        lines = [line for line in out.read().decode().splitlines() if line.startswith("{")]
    if client.returncode != 0 or not lines:
        raise RuntimeError(f"the client failed with code {client.returncode}")
    return json.loads(lines[-1])


def summarize(results: list[dict], rates: list[float]) -> list[dict]:
    """One row per (codec, rate): medians over the repeats."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    outputs = {}  # (codec, rate) -> the decoded tokens of every decode, in order
    rows = []
    for r in results:
        idle = r["idle_bytes_per_s"]
        net = lambda run, host: run["sent"][host] - idle[host] * run["seconds"]  # noqa: E731 - minus idle traffic
        for rate in rates:
            pre = [p for p in r["prefills"] if p["rate_mbit"] == rate]
            dec = [d for d in r["decodes"] if d["rate_mbit"] == rate]
            outputs[r["codec"], rate] = [d["output"] for d in dec]
            row = dict(
                codec=r["codec"],
                rate_mbit=rate,
                prompt_tokens=r["prompt_tokens"],
                prompt_s=med([p["seconds"] for p in pre]),
                prompt_s_min=min(p["seconds"] for p in pre),
                head_sent_mb=med([p["sent"]["s0"] for p in pre]) / 1e6,
                mid_sent_mb=med([p["sent"]["s1"] for p in pre]) / 1e6,
                head_net_mb=med([net(p, "s0") for p in pre]) / 1e6,
                mid_net_mb=med([net(p, "s1") for p in pre]) / 1e6,
                idle_kb_per_s={h: b / 1e3 for h, b in idle.items()},
                client_sent_kb=med([p["sent"]["client"] for p in pre]) / 1e3,
            )
            if rate:  # the time the activations occupy the two server links, at the shaped rate
                row["wire_s"] = (row["head_net_mb"] + row["mid_net_mb"]) * 8 / rate
            row["busy_s"] = med([p["busy_s"]["s0"] + p["busy_s"]["s1"] for p in pre])
            for mode in ("None", "suffix"):
                mine = [d for d in dec if d["mode"] == mode]
                tokens = sum(d["tokens"] for d in mine)
                row[f"decode_{mode}_tps"] = med([d["tokens"] / d["seconds"] for d in mine])
                row[f"decode_{mode}_tokens_per_lap"] = tokens / max(1, sum(d["laps"] for d in mine))
                # each lap sends its committed token and its drafts across every server link
                row[f"decode_{mode}_positions_per_token"] = sum(d["laps"] + d["drafted"] for d in mine) / max(1, tokens)
                # idle traffic (tens of KB/s) swamps a few seconds of decoding: kept in the JSON only
                row[f"decode_{mode}_head_kb_per_token"] = med([net(d, "s0") / max(1, d["tokens"]) for d in mine]) / 1e3
            rows.append(row)
    for row in rows:
        reference = outputs.get(("none", row["rate_mbit"]))
        if reference is not None:
            row["same_tokens_as_none"] = outputs[row["codec"], row["rate_mbit"]] == reference
    # against the same codec at the fastest shaped rate: the median of the differences between the
    # two rates' prompts of the same repeat (measured back to back, so they share the machine's load)
    fastest = max((r for r in rates if r), default=None)
    for r in results:
        for row in rows:
            if row["codec"] != r["codec"] or not row["rate_mbit"] or row["rate_mbit"] == fastest:
                continue
            base = next(b for b in rows if b["codec"] == r["codec"] and b["rate_mbit"] == fastest)
            mine = [p["seconds"] for p in r["prefills"] if p["rate_mbit"] == row["rate_mbit"]]
            theirs = [p["seconds"] for p in r["prefills"] if p["rate_mbit"] == fastest]
            row["prompt_s_over_fastest"] = med([a - b for a, b in zip(mine, theirs)])
            row["wire_s_over_fastest"] = row["wire_s"] - base["wire_s"]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| codec | link | 1,000-token prompt, s: median (min) | MB sent by head / mid per prompt, minus idle "
        "| wire s: bytes / rate, measured busy "
        "| prompt s minus the fastest link's: measured (median of pairs) / wire | decode tokens/s, no speculation "
        "| decode tokens/s, suffix | tokens/lap, suffix | positions sent per token, suffix "
        "| same tokens as codec none |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        wire = (f"{r['wire_s']:.2f}" if "wire_s" in r else "-") + f", {r['busy_s']:.2f}"
        over = "-"
        if "prompt_s_over_fastest" in r:
            over = f"{r['prompt_s_over_fastest']:+.2f} / {r['wire_s_over_fastest']:+.2f}"
        same = {True: "yes", False: "no"}.get(r.get("same_tokens_as_none"), "-")
        lines.append(
            f"| {r['codec']} | {_link(r['rate_mbit'])} | {r['prompt_s']:.2f} ({r['prompt_s_min']:.2f}) "
            f"| {r['head_net_mb']:.2f} / {r['mid_net_mb']:.2f} "
            f"| {wire} | {over} | {r['decode_None_tps']:.2f} | {r['decode_suffix_tps']:.2f} "
            f"| {r['decode_suffix_tokens_per_lap']:.2f} "
            f"| {r['decode_suffix_positions_per_token']:.2f} | {same} |"
        )
    return "\n".join(lines)


def _link(rate: float) -> str:
    return f"{rate:g} Mbit/s" if rate else "unshaped"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def _commit() -> str:
    """The checkout's commit, "+uncommitted" when tracked files differ from it ("" outside git)."""
    try:
        head, dirty = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return ""
    return f"{head}+uncommitted" if head and dirty else head


def orchestrate(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from protocol.models import resolve_model
    from swarm.local import even_spans

    offered = available_codecs()
    codecs = [c for c in args.codecs if c in offered]
    missing = [c for c in args.codecs if c not in offered]
    if missing:
        print(
            f"skipping codecs the server does not offer yet: {', '.join(missing)} (it offers {', '.join(offered)})",
            flush=True,
        )
    if not codecs:
        raise SystemExit("no codec to measure")
    resolved = resolve_model(MODEL)  # converts the embedded model once, before anything starts
    spans = even_spans(AutoConfig.from_pretrained(resolved.source).num_hidden_layers, SERVERS)
    log_dir = tempfile.mkdtemp(prefix="bench-bandwidth-")
    began = time.time()
    results = []
    print(
        f"{MODEL}: {SERVERS} servers {spans}, {args.hop_delay_ms:g} ms per hop, codecs {codecs}, "
        f"rates {[r or 'unshaped' for r in args.rates]} Mbit/s; peer logs in {log_dir} "
        "(removed after a successful run)",
        flush=True,
    )
    with netns.Testbed(["boot", *[f"s{i}" for i in range(SERVERS)], "client"]) as bed:
        for codec in codecs:
            print(f"== codec {codec} ==", flush=True)
            swarm = CodecSwarm(bed, codec, spans, args.hop_delay_ms, log_dir)
            try:
                swarm.start()
                result = run_client(bed, swarm, args)
            finally:
                swarm.stop()
            result.update(codec=codec)
            results.append(result)
            for rate in args.rates:
                pre = statistics.median(p["seconds"] for p in result["prefills"] if p["rate_mbit"] == rate)
                print(
                    f"   {_link(rate)}: prompt {pre:.2f} s (median); servers were ready after "
                    f"{result['ready_s']:.1f} s",
                    flush=True,
                )
    shutil.rmtree(log_dir, ignore_errors=True)  # kept only when something failed
    rows = summarize(results, args.rates)
    print(markdown(rows))
    wall = time.time() - began
    print(f"whole run {wall / 60:.1f} min", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        for r in results:  # the generated tokens are only for the comparison; keep the file small
            for d in r["decodes"]:
                d.pop("output", None)
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items() if k not in INTERNAL_ARGS},
                    "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "commit": _commit(),
                    "model": MODEL,
                    "spans": spans,
                    "codecs_offered": offered,
                    "rows": rows,
                    "runs": results,
                    "wall_seconds": wall,
                },
                indent=1,
            )
        )
        print(f"wrote {args.out}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bandwidth", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--codecs", nargs="+", help=f"default {' '.join(CODECS)} (those the server offers)")
    p.add_argument("--rates", type=float, nargs="+", help="Mbit/s per link, 0 for unshaped (default 20 100)")
    p.add_argument("--hop-delay-ms", type=float, default=25.0)
    p.add_argument("--repeats", type=int, help="decode measurements per mode, codec and rate (default 3)")
    p.add_argument("--prompt-repeats", type=int, help="prompt measurements per codec and rate (default 5)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--idle-seconds", type=float, help="measure the hosts' idle traffic this long (default 15)")
    p.add_argument("--max-new-tokens", type=int, help="decoded tokens per measurement (default 32)")
    p.add_argument("--quick", action="store_true", help="smoke run: codec none, 20 Mbit/s, 1 repeat, 8 tokens, no JSON")
    p.add_argument("--out", help="JSON results (default benchmarks/results/bandwidth.json; none with --quick)")
    # internal: the parts that run inside the namespaces
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", nargs="+", default=[], help=argparse.SUPPRESS)
    p.add_argument("--servers", type=int, default=SERVERS, help=argparse.SUPPRESS)
    p.add_argument("--testbed", help=argparse.SUPPRESS)  # Testbed.spec(): counters and shaping
    p.add_argument("--proxy", metavar="HOST:PORT", help=argparse.SUPPRESS)
    p.add_argument("--target", metavar="HOST:PORT", help=argparse.SUPPRESS)
    p.add_argument("--delay-ms", type=float, default=25.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.proxy:
        return proxy_main(args.proxy, args.target, args.delay_ms)
    quick = args.quick
    args.codecs = args.codecs or (["none"] if quick else CODECS)
    args.rates = args.rates or ([20.0] if quick else RATES)
    args.repeats = args.repeats or (1 if quick else 3)
    args.prompt_repeats = args.prompt_repeats or (1 if quick else 5)
    args.idle_seconds = args.idle_seconds if args.idle_seconds is not None else (5.0 if quick else 15.0)
    args.max_new_tokens = args.max_new_tokens or (8 if quick else 32)
    if args.client:
        return client_main(args)
    if args.out is None and not quick:
        args.out = str(Path(__file__).parent / "results" / "bandwidth.json")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks and atexit run: the testbed goes
    try:
        netns.check_available()
    except netns.TestbedUnavailable as e:
        raise SystemExit(f"cannot build the network-namespace testbed: {e}")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
