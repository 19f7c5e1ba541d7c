"""``python -m swarm.local --model smollm2-135m --servers 3``: a whole swarm on 127.0.0.1.

Starts a bootstrap node and N servers splitting the blocks evenly (as separate processes, each
running the same ``__main__`` a volunteer's ``python -m`` runs, forked from one that has imported
torch, transformers and hivemind once: ``swarm/warm_start.py``) and a health dashboard, prints
the initial peers and the dashboard's URL, and stops everything on Ctrl-C or SIGTERM; if the
launcher is killed outright (SIGKILL), everything it started exits on its own within seconds
(``swarm/lifeline.py``). With ``--prompt`` it also generates from the prompt with speculation and
prints the text, tokens/s and laps, then exits. With ``--hop-delay-ms D`` every server sits behind
a TCP delay proxy (WAN emulation), so one lap crosses servers + 1 delayed links.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from swarm import lifeline, warm_start
from swarm.cli_utils import setup_logging
from swarm.warm_start import Started, kill_group  # kill_group is also imported from here by tests and benchmarks

logger = logging.getLogger("swarm.local")


def even_spans(num_blocks: int, num_servers: int) -> list[tuple[int, int]]:
    """Split blocks into contiguous spans whose sizes differ by at most one."""
    if not 1 <= num_servers <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks over {num_servers} servers")
    bounds = [round(i * num_blocks / num_servers) for i in range(num_servers + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSwarm:
    """A bootstrap node plus servers on 127.0.0.1, each its own process; a context manager.

    ``spans`` gives each server's blocks explicitly (overlaps allowed); by default the blocks are
    split evenly over ``num_servers``. Every process it starts (and the DHT processes this process
    forks) exits by itself when this process is gone, even after a SIGKILL (``swarm.lifeline``).
    """

    def __init__(
        self,
        model: str,
        num_servers: int = 3,
        *,
        spans: Optional[Sequence[tuple[int, int]]] = None,
        hop_delay_ms: float = 0.0,
        server_args: Sequence[str] = (),
        ready_timeout: float = 300.0,
        log_dir: Optional[str] = None,
        names: Optional[Sequence[str]] = None,
        dashboard_port: Optional[int] = None,
        api_port: Optional[int] = None,
        launcher: Sequence[str] = ("swarm.server",),
    ):
        """``launcher``: the module (and its options) each server runs as, ``python -m`` style
        (tests start faulty servers with tests/kit/faulty_server.py)."""
        self.launcher = list(launcher)
        self.model, self.num_servers, self.spans = model, num_servers, list(spans) if spans is not None else None
        self.hop_delay_ms, self.server_args = hop_delay_ms, list(server_args)
        self.ready_timeout = ready_timeout
        self.log_dir = log_dir
        self.names = list(names) if names else None
        self.dashboard_port = dashboard_port  # None: no dashboard; 0: any free port
        self.dashboard: Optional[Started] = None
        self.dashboard_url = ""
        self.api_port = api_port  # None: no OpenAI-compatible gateway; 0: any free port
        self.api: Optional[Started] = None
        self.api_url = ""
        self.bootstrap: Optional[Started] = None
        self.servers: list[Started] = []
        self.proxies: list = []
        self.initial_peers: list[str] = []
        self.dht_name = ""
        self.num_blocks = 0
        lifeline.install_fork_hook()

    def __enter__(self) -> "LocalSwarm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from transformers import AutoConfig

        from protocol.models import resolve_model

        resolved = resolve_model(self.model)  # converts the embedded model once, before the servers start
        self.dht_name = resolved.dht_name
        self.num_blocks = AutoConfig.from_pretrained(resolved.source).num_hidden_layers
        if self.spans is None:  # spans=[]: the bootstrap alone; servers come with start_server
            self.spans = even_spans(self.num_blocks, self.num_servers)
        self._start_bootstrap()
        for index, (start, end) in enumerate(self.spans):
            self.start_server(start, end, name=self.names[index] if self.names else f"local-{index}")
        self.wait_ready()
        if self.dashboard_port is not None:
            self.start_dashboard(self.dashboard_port)
        if self.api_port is not None:
            self.start_api(self.api_port)

    def _popen(self, args: list[str], name: str, stdout=None) -> Started:
        """``python -m args...`` in its own session (forked from a process that has imported torch,
        transformers and hivemind already: swarm/warm_start.py); stderr to ``log_dir/name.log``."""
        stderr = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            stderr = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        try:  # each child exits when this process is gone, even after a SIGKILL
            return warm_start.start(args[0], args[1:], env=lifeline.child_env(), stdout=stdout, stderr=stderr)
        finally:
            if stderr is not None:
                stderr.close()  # the child has its own copy

    def _start_bootstrap(self) -> None:
        args = ["swarm.bootstrap", "--host", "127.0.0.1", "--port", "0", *self._log_level_args()]
        self.bootstrap = self._popen(args, "bootstrap", subprocess.PIPE)
        line = self.bootstrap.stdout.readline().decode().strip()
        if not line:
            raise RuntimeError("the bootstrap node exited before printing its address")
        self.initial_peers = [line]

    def _log_level_args(self) -> list[str]:
        if "--log-level" in self.server_args:
            return ["--log-level", self.server_args[self.server_args.index("--log-level") + 1]]
        return []

    def start_server(
        self,
        start: Optional[int],
        end: Optional[int],
        name: str = "server",
        extra: Sequence[str] = (),
        launcher: Optional[Sequence[str]] = None,
    ) -> Started:
        """Start one server of blocks start:end; with start=None and end=N it serves N blocks
        wherever the swarm needs them most (``--num-blocks``). ``launcher``: the module (and its
        options) run with ``python -m`` (default: the swarm's)."""
        port = free_port()
        blocks = ["--blocks", f"{start}:{end}"] if start is not None else ["--num-blocks", str(end)]
        args = [
            *(self.launcher if launcher is None else launcher),
            "--model",
            self.model,
            "--initial-peers",
            *self.initial_peers,
            *blocks,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            # every peer is on loopback: nothing to probe (docs/nat.md); server_args may override
            "--public-name",
            name,
            "--reachability",
            "public",
            *self.server_args,
            *extra,
        ]
        if self.hop_delay_ms > 0:
            from swarm.delay_proxy import ThreadedDelayProxy

            proxy = ThreadedDelayProxy("127.0.0.1", port, self.hop_delay_ms)
            proxy.start()
            self.proxies.append(proxy)
            args += ["--announce-maddrs", f"/ip4/127.0.0.1/tcp/{proxy.listen_port}"]
        process = self._popen(args, name)
        self.servers.append(process)
        return process

    def start_dashboard(self, port: int = 0, extra: Sequence[str] = ()) -> str:
        """Start ``python -m swarm.dashboard`` on 127.0.0.1 and return its URL (it prints it when serving)."""
        args = [
            "swarm.dashboard",
            "--initial-peers",
            *self.initial_peers,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            self.model,
            *extra,
        ]
        self.dashboard = self._popen(args, "dashboard", subprocess.PIPE)
        line = self.dashboard.stdout.readline().decode().strip()
        if not line.startswith("Dashboard: "):
            raise RuntimeError(f"the dashboard exited with code {self.dashboard.poll()} before printing its URL")
        self.dashboard_url = line.removeprefix("Dashboard: ")
        return self.dashboard_url

    def start_api(self, port: int = 0, extra: Sequence[str] = ()) -> str:
        """Start the OpenAI-compatible gateway (``python -m swarm.api``) on 127.0.0.1 for this swarm's
        model; returns its base URL (``http://127.0.0.1:PORT/v1``, printed once it serves)."""
        args = [
            "swarm.api",
            "--initial-peers",
            *self.initial_peers,
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self._log_level_args(),
            *extra,
        ]
        self.api = self._popen(args, "api", subprocess.PIPE)
        line = self.api.stdout.readline().decode().strip()
        if not line.startswith("http"):
            raise RuntimeError(f"the API gateway exited with code {self.api.poll()} before printing its URL")
        self.api_url = line
        return line

    def stop_api(self) -> None:
        """Stop the gateway alone (SIGTERM, then SIGKILL); the swarm keeps running."""
        api, self.api, self.api_url = self.api, None, ""
        if api is None or api.poll() is not None:
            return
        api.terminate()
        try:
            api.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(api.pid, signal.SIGKILL)
            api.wait()

    def wait_ready(self, expected: Optional[int] = None) -> None:
        """Block until the DHT lists every server as online (or one of them died)."""
        from protocol.dht import make_dht
        from protocol.dht_records import wait_until_online

        def check_alive() -> None:
            dead = [p for p in self.servers if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a server exited with code {dead[0].returncode} during start-up")

        dht = make_dht(initial_peers=self.initial_peers, client_mode=True)
        try:
            wait_until_online(
                dht, self.dht_name, self.num_blocks, expected or len(self.servers), self.ready_timeout, check_alive
            )
        finally:
            dht.shutdown()

    def stop(self) -> None:
        """SIGTERM everything (servers leave cleanly), then SIGKILL what is left. Calling it again
        stops only what started since: a reaped process's id may belong to a stranger by then."""
        candidates = [self.api, self.dashboard] + self.servers + [self.bootstrap]
        processes = [p for p in candidates if p is not None and not getattr(p, "group_reaped", False)]
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_group(process)
        for proxy in self.proxies:
            proxy.stop()
        self.proxies.clear()


def run_demo(swarm: LocalSwarm, prompt: str, max_new_tokens: int, speculation: Optional[str]) -> None:
    """Generate without speculation, then with it (runs sent by the client; looped runs, the
    default, where the tail starts each next run at the head itself; asynchronous), and print the
    text once and what each mode did; the speculative modes must reproduce the same tokens."""
    import warnings

    from client.errors import UnconfirmedTokensWarning
    from swarm import AutoDistributedModelForCausalLM

    # one tail per block range here: no second server can confirm a token, which the summary says once
    warnings.simplefilter("ignore", UnconfirmedTokensWarning)
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.model, initial_peers=swarm.initial_peers)
    tokenizer = model.tokenizer
    messages = [{"role": "user", "content": prompt}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    modes = {"speculation=None, loop_runs=False": dict(speculation=None, loop_runs=False)}
    if speculation:
        modes[f"speculation={speculation}, loop_runs=False"] = dict(speculation=speculation, loop_runs=False)
        modes[f"speculation={speculation} (the default: looped runs)"] = dict(speculation=speculation)
        modes[f"speculation={speculation}, async_speculation=True"] = dict(
            speculation=speculation, async_speculation=True
        )
    first = None
    for label, kwargs in modes.items():
        model.reset_draft_store()  # no mode may draft from an earlier mode's answer
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)
        stats = model.last_generation_stats
        new = output[0, input_ids.shape[1] :].tolist()
        print(f"\n=== {label} ===")
        if first is None or new != first:
            print(tokenizer.decode(new, skip_special_tokens=True))
            if first is not None:
                print("!!! these tokens differ from the run without speculation: a bug, please report it")
        else:
            print(f"(the same {len(new)} tokens as without speculation)")
        if first is None:
            first = new
        cancelled = ""
        if stats.looped_runs:
            cancelled = f", {stats.looped_runs} runs started at the head"
        if stats.runs_cancelled:
            cancelled += f", {stats.runs_cancelled} runs cancelled ({stats.positions_wasted} positions)"
        print(
            f"--- {stats.new_tokens} tokens in {stats.wall_time:.2f} s ({stats.tokens_per_second:.1f} tokens/s), "
            f"{stats.laps} laps, {stats.accepted_per_lap:.2f} tokens/lap, drafted {stats.drafted}, "
            f"accepted {stats.accepted}{cancelled}, {stats.bytes_up / max(stats.laps, 1):.0f} B up/lap, "
            f"route {' -> '.join(f'{p[:8]}[{a}:{b})' for p, a, b in stats.route)}",
            flush=True,
        )
    if stats.tokens_unconfirmed:
        print(
            f"\n(tokens unconfirmed by a second tail: {stats.tokens_unconfirmed} of {stats.new_tokens} in the last "
            'mode; this swarm has one server per block range. docs/reliability.md, "Disputes and witnesses")'
        )
    model.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarm.local", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--hop-delay-ms", type=float, default=0.0, help="one-way delay in front of every server")
    p.add_argument("--prompt", help="generate from this prompt, print the result and exit")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--speculation", default="suffix", help="suffix, ngram or none (compared against none)")
    p.add_argument("--log-dir", help="write each process's log to a file here")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument(
        "--dashboard-port",
        type=int,
        default=0,
        help="port of the health dashboard (0: any free port, -1: none); not started with --prompt",
    )
    p.add_argument(
        "--api-port",
        type=int,
        default=-1,
        help="port of an OpenAI-compatible gateway (python -m swarm.api): 0 any free port, -1 none",
    )
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    lifeline.install()
    speculation = None if args.speculation.lower() == "none" else args.speculation
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    server_args = ["--log-level", args.log_level, "--torch-threads", "1"]
    dashboard_port = None if args.dashboard_port < 0 or args.prompt else args.dashboard_port
    with LocalSwarm(
        args.model,
        args.servers,
        hop_delay_ms=args.hop_delay_ms,
        server_args=server_args,
        log_dir=args.log_dir,
        dashboard_port=dashboard_port,
        api_port=None if args.api_port < 0 else args.api_port,
    ) as swarm:
        print(f"Local swarm of {args.model}: {len(swarm.servers)} servers, blocks {swarm.spans}", flush=True)
        print("Initial peers:", *swarm.initial_peers, flush=True)
        if swarm.dashboard_url:
            print("Dashboard:", swarm.dashboard_url, flush=True)
        if swarm.api_url:
            print("OpenAI-compatible API:", swarm.api_url, flush=True)
        if args.prompt:
            run_demo(swarm, args.prompt, args.max_new_tokens, speculation)
            return 0
        print("Press Ctrl-C to stop.", flush=True)
        try:
            while not stop["now"]:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
