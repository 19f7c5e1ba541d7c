"""``python -m swarm.dashboard --initial-peers MADDR ... --host 127.0.0.1 --port 8080``.

Prints the page's URL on stdout once it is serving (scripts such as ``swarm.local`` read that
line); logs go to stderr. Stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from swarm import lifeline
from swarm.cli_utils import setup_logging, stop_event_on_signals

logger = logging.getLogger("swarm.dashboard")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.dashboard", description=__doc__)
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="multiaddrs of peers in the swarm (default: $SPECSWARM_INITIAL_PEERS, then the config file)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve the page on")
    p.add_argument("--port", type=int, default=8080, help="TCP port (0: any free port)")
    p.add_argument("--refresh-seconds", type=float, default=5.0, help="seconds between reads of the DHT")
    p.add_argument("--probe-seconds", type=float, default=30.0, help="seconds between pings of every server")
    p.add_argument("--probe-timeout", type=float, default=5.0, help="seconds to wait for a server's ping")
    p.add_argument(
        "--forget-after", type=float, default=300.0, help="seconds a vanished server stays listed as offline"
    )
    p.add_argument("--history-interval", type=float, default=60.0, help="seconds per point of the history charts")
    p.add_argument("--history-points", type=int, default=360, help="points kept per chart and uptime record")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME_OR_PATH",
        help="a model (alias, hub id or folder) whose config gives its number of blocks; "
        "records and registry entries that disagree are ignored (repeatable)",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad option."""
    for name in ("refresh_seconds", "probe_seconds", "probe_timeout", "history_interval"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.forget_after < 0:
        raise ValueError(f"--forget-after must not be negative, got {args.forget_after}")
    if args.history_points < 1:
        raise ValueError(f"--history-points must be at least 1, got {args.history_points}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    bad = [maddr for maddr in args.initial_peers if not maddr.startswith("/")]
    if bad:
        raise ValueError(f"--initial-peers takes multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm..., got {bad[0]!r}")
    if not args.initial_peers:  # as a server does: $SPECSWARM_INITIAL_PEERS, then the config file
        from protocol.config import no_initial_peers_message, resolve_initial_peers

        args.initial_peers = resolve_initial_peers().peers
        if not args.initial_peers:
            raise ValueError(no_initial_peers_message("watch a swarm"))


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from protocol.dht import make_dht
    from protocol.models import model_num_blocks
    from swarm.dashboard.app import Dashboard, DashboardConfig, create_app
    from swarm.dashboard.poller import SwarmReader
    from swarm.dashboard.state import Limits

    try:
        known_blocks = dict(model_num_blocks(name) for name in args.model)
    except Exception as e:
        raise ValueError(f"--model: could not read the model's config: {e}") from None
    stop = stop_event_on_signals()
    try:
        dht = make_dht(initial_peers=args.initial_peers, client_mode=True)
    except Exception as e:
        raise RuntimeError(f"could not join the swarm through {' '.join(args.initial_peers)}: {e}") from None
    limits = Limits(
        forget_after=args.forget_after, history_interval=args.history_interval, history_points=args.history_points
    )
    config = DashboardConfig(refresh_seconds=args.refresh_seconds, probe_seconds=args.probe_seconds, limits=limits)
    dashboard = Dashboard(SwarmReader(dht, probe_timeout=args.probe_timeout, known_blocks=known_blocks), config)
    runner = web.AppRunner(create_app(dashboard), access_log=None)
    await runner.setup()
    refresher = None
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        shown = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
        print(f"Dashboard: http://{shown}:{port}/", flush=True)
        refresher = asyncio.create_task(dashboard.run())
        await stop.wait()
    finally:
        if refresher is not None:
            refresher.cancel()
        await runner.cleanup()
        dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    lifeline.install()
    try:
        check_args(args)
        asyncio.run(serve(args))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"swarm.dashboard: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
