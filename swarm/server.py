"""``python -m swarm.server --model NAME_OR_PATH [--initial-peers MADDR ...]``: serve a span of blocks."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from protocol.compression import CODECS
from protocol.config import ENV_INITIAL_PEERS, config_path
from protocol.limits import (
    DEFAULT_GATHER_WINDOW,
    DEFAULT_MAX_POSITIONS_PER_STEP,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_SESSIONS_PER_PEER,
    DEFAULT_MAX_SHARE_PER_ADDRESS,
    DEFAULT_MAX_TRAIN_MIB,
    DEFAULT_MAX_UNREAD_MIB,
)
from protocol.version import PROTOCOL_VERSION
from server.compile_budget import PER_ADDRESS as COMPILE_PER_ADDRESS
from server.compile_budget import PER_PEER as COMPILE_PER_PEER
from server.compile_budget import TOTAL as COMPILE_TOTAL
from server.joining import JOIN_JITTER, JOIN_SETTLE
from swarm.cli_utils import parse_blocks, parse_size, setup_logging, stop_event_on_signals

logger = logging.getLogger("swarm.server")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (unset, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from protocol.models import ALIASES

    p = argparse.ArgumentParser(prog="python -m swarm.server", description=__doc__, formatter_class=_DefaultsFormatter)
    version = f"specswarm {_package_version()} (protocol {PROTOCOL_VERSION})"
    p.add_argument("--version", action="version", version=version)
    p.add_argument(
        "--model", required=True, help=f"alias ({', '.join(ALIASES)}), hub repo id (org/name) or local folder"
    )
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the memory plan (blocks that fit, cache budget, what is reserved) and exit, "
        "without loading or downloading weights",
    )
    p.add_argument(
        "--assume-free-memory",
        type=parse_size,
        metavar="SIZE",
        help="plan with this much free device memory (e.g. 22GiB) instead of measuring it",
    )
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help=f"multiaddrs of peers in the swarm (if not given: ${ENV_INITIAL_PEERS}, else initial_peers "
        f"in {config_path()})",
    )
    p.add_argument("--new-swarm", action="store_true", help="start a new swarm instead of joining one")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--blocks", type=parse_blocks, help="serve blocks START:END (end exclusive)")
    group.add_argument("--num-blocks", type=int, help="serve this many blocks, placed where the swarm needs them most")
    p.add_argument("--host", default="0.0.0.0", help="IPv4 or IPv6 address to listen on (:: for every IPv6 address)")
    p.add_argument("--port", type=int, default=0, help="TCP port to listen on (0: any free port)")
    p.add_argument(
        "--announce-maddrs", nargs="+", default=[], metavar="MADDR", help="addresses other peers should dial"
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    # the choices of server.quantization.QUANT_CHOICES, written out so that --help needs no torch import
    p.add_argument(
        "--quant",
        default="auto",
        choices=["auto", "none", "int8", "nf4"],
        help="weights of the blocks: none, int8 (LLM.int8) or nf4 (bitsandbytes); auto: the smallest that "
        "keeps the checkpoint's own precision (docs/quantization.md)",
    )
    p.add_argument("--public-name", help="a name shown on the health dashboard")
    p.add_argument(
        "--cache-tokens",
        type=int,
        help="KV cache budget in tokens (if not given: from free memory, by the memory plan)",
    )
    p.add_argument("--identity-path", help="private key file; keeps the peer id across restarts")
    p.add_argument("--dht-prefix", help="the model's name in the DHT (if not given: from --model)")
    p.add_argument(
        "--revision",
        help="a hub model's commit, branch or tag (if not given: the commit the swarm's "
        "servers announce, with the most served blocks, else the hub's main)",
    )
    p.add_argument(
        "--compression",
        default="none",
        choices=CODECS,
        help="codec of activations sent to the next server (none keeps outputs exact; docs/protocol.md)",
    )
    p.add_argument("--update-period", type=float, default=15.0, help="seconds between DHT announcements")
    p.add_argument("--session-timeout", type=float, default=600.0, help="free sessions idle this long (s)")
    p.add_argument("--torch-threads", type=int, help="torch CPU threads")
    p.add_argument("--drain-seconds", type=float, default=30.0, help="on shutdown, let open sessions finish this long")
    p.add_argument(
        "--balance-period",
        type=float,
        default=120.0,
        help="with --num-blocks: seconds between checks whether another span helps the swarm more",
    )
    p.add_argument(
        "--join-jitter",
        type=float,
        default=JOIN_JITTER,
        help="with --num-blocks: the most seconds of random wait before reading the swarm to choose blocks",
    )
    p.add_argument(
        "--join-settle",
        type=float,
        default=JOIN_SETTLE,
        help="with --num-blocks: seconds between announcing the chosen blocks and checking for a rival",
    )
    p.add_argument(
        "--max-positions-per-step",
        type=int,
        default=DEFAULT_MAX_POSITIONS_PER_STEP,
        help="most positions one Step may carry (frames are limited to what it needs)",
    )
    p.add_argument(
        "--max-batch-positions",
        type=int,
        help="most positions one batched pass through the span computes; sessions' runs beyond it wait "
        "in arrival order, long prefills are cut into chunks (default: what the memory plan's headroom "
        "holds, at most 1024)",
    )
    p.add_argument(
        "--gather-window-ms",
        type=float,
        default=1000 * DEFAULT_GATHER_WINDOW,
        help="the most a ready batch waits for runs of the server's other open sessions; it starts at once "
        "when each open session has a run waiting, so a session alone never waits (0: never waits)",
    )
    p.add_argument(
        "--no-batching",
        action="store_true",
        help="compute one session's run per pass through the span (for comparisons)",
    )
    p.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS, help="open sessions at most")
    p.add_argument(
        "--max-share-per-address",
        type=float,
        default=DEFAULT_MAX_SHARE_PER_ADDRESS,
        help="share of the session slots, cache, pending Subscribes and unread results one client source address "
        "group (/24, /48) may hold, whatever its peer ids",
    )
    p.add_argument("--cap-loopback", action="store_true", help="cap loopback clients per address too (default: exempt)")
    p.add_argument(
        "--max-sessions-per-peer",
        type=int,
        default=DEFAULT_MAX_SESSIONS_PER_PEER,
        help="open sessions per client at most (a previous server announced for the route's previous "
        "blocks carries many clients and is not capped as one)",
    )
    p.add_argument(
        "--max-session-tokens",
        type=int,
        help="the longest session (OpenSession max_length) this server takes, announced in its record "
        "(default: a quarter of the cache budget, at least 2048 tokens where the budget has them); one "
        "client may reserve at most half of the cache budget",
    )
    p.add_argument(
        "--max-unread-mib",
        type=int,
        default=DEFAULT_MAX_UNREAD_MIB,
        help="MiB of results a tail holds for clients that have not read them (default %(default)s); "
        "one session at most a quarter of it",
    )
    p.add_argument(
        "--max-train-mib",
        type=int,
        default=DEFAULT_MAX_TRAIN_MIB,
        help="MiB of span inputs kept for training steps whose backward has not come back (default "
        "%(default)s); a step that does not fit is refused busy (docs/fine_tuning.md)",
    )
    p.add_argument(
        "--max-backward-mib",
        type=int,
        default=0,
        help="MiB of activations one training row's backward may need here (counted in the memory plan); a "
        "larger row is refused busy. Default 0: what a row of --max-positions-per-step positions needs",
    )
    p.add_argument(
        "--drafter",
        default="auto",
        metavar="auto|none|PATH_OR_REPO",
        help="the tail's drafter: auto (the drafter shipped for this model, if any), none, a drafter "
        "file (.safetensors, from python -m server.drafter_train), or an EAGLE-3 head in its published "
        "layout (a folder or hub repo id; docs/speculation.md)",
    )
    p.add_argument("--drafter-tokens", type=int, default=1, help="ids the tail drafter drafts per run at most")
    p.add_argument(
        "--reachability",
        default="auto",
        choices=["auto", "public", "private"],
        help="auto: ask the initial peers to dial back and use them as relays if they cannot "
        "(docs/nat.md); public: skip the check; private: always serve through a relay",
    )
    p.add_argument(
        "--adapters",
        nargs="+",
        default=[],
        metavar="PATH_OR_REPO",
        help="PEFT LoRA adapters to serve (local folders or hub repos); clients pick one by its name, "
        "the folder's name or the repo id (docs/fine_tuning.md)",
    )
    p.add_argument(
        "--compile-budget-per-peer",
        type=int,
        default=COMPILE_PER_PEER,
        help="at a tail: new constraints (JSON schemas, regexes, grammars) one client may have compiled per "
        "minute; cached ones are free (docs/reliability.md)",
    )
    p.add_argument(
        "--compile-budget-per-address",
        type=int,
        default=COMPILE_PER_ADDRESS,
        help="at a tail: new constraints per minute for one client source address group, whatever its peer ids",
    )
    p.add_argument(
        "--compile-budget-total",
        type=int,
        default=COMPILE_TOTAL,
        help="at a tail: new constraints per minute, whoever asks",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


def server_config(args: argparse.Namespace):
    from server.span_server import ServerConfig

    return ServerConfig(
        model=args.model,
        initial_peers=args.initial_peers,
        new_swarm=args.new_swarm,
        blocks=args.blocks,
        num_blocks=args.num_blocks,
        host=args.host,
        port=args.port,
        announce_maddrs=args.announce_maddrs,
        device=args.device,
        dtype=args.dtype,
        quant=args.quant,
        public_name=args.public_name,
        cache_tokens=args.cache_tokens,
        identity_path=args.identity_path,
        update_period=args.update_period,
        session_timeout=args.session_timeout,
        compression=args.compression,
        torch_threads=args.torch_threads,
        dht_prefix=args.dht_prefix,
        drain_seconds=args.drain_seconds,
        balance_period=args.balance_period,
        join_jitter=args.join_jitter,
        join_settle=args.join_settle,
        assume_free_memory=args.assume_free_memory,
        max_positions_per_step=args.max_positions_per_step,
        max_sessions=args.max_sessions,
        max_sessions_per_peer=args.max_sessions_per_peer,
        max_share_per_address=args.max_share_per_address,
        cap_loopback=args.cap_loopback,
        max_session_tokens=args.max_session_tokens,
        max_unread_mib=args.max_unread_mib,
        max_train_mib=args.max_train_mib,
        max_backward_mib=args.max_backward_mib,
        max_batch_positions=args.max_batch_positions,
        gather_window=args.gather_window_ms / 1000,
        batching=not args.no_batching,
        reachability=args.reachability,
        drafter=args.drafter,
        drafter_tokens=args.drafter_tokens,
        revision=args.revision,
        adapters=tuple(args.adapters),
        compile_budget_per_peer=args.compile_budget_per_peer,
        compile_budget_per_address=args.compile_budget_per_address,
        compile_budget_total=args.compile_budget_total,
    )


async def serve(args: argparse.Namespace) -> None:
    from server.span_server import SpanServer

    config = server_config(args)
    stop = stop_event_on_signals()
    server = await SpanServer.create(config)
    for maddr in server.dht.get_visible_maddrs():
        logger.info(f"Listening on {maddr}")
    await stop.wait()
    logger.info("Shutting down")
    await server.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    from swarm import lifeline  # the DHT process and p2pd die with this one; this one with its launcher

    lifeline.install()
    try:
        if args.plan_only:
            from server.plan_only import plan_text

            print(plan_text(server_config(args)))
            return 0
        asyncio.run(serve(args))
    except (ValueError, RuntimeError, OSError) as e:
        logger.error(str(e))
        return 2
    return 0


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("specswarm")
    except Exception:
        return "0+unknown"


if __name__ == "__main__":
    sys.exit(main())
