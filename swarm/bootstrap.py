"""``python -m swarm.bootstrap --host 127.0.0.1 --port 0``: a DHT-only node for others to join.

Prints its full multiaddrs on stdout, one per line, as soon as it is reachable (scripts read them);
logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from swarm import lifeline
from swarm.cli_utils import setup_logging, stop_event_on_signals

logger = logging.getLogger("swarm.bootstrap")


async def run(args: argparse.Namespace) -> None:
    from protocol.dht import make_dht
    from protocol.identity import load_or_create_identity
    from server.reachability import ProbeService

    identity = load_or_create_identity(args.identity_path)
    stop = stop_event_on_signals()
    # A bootstrap is public by definition (everyone dials it), so libp2p offers the relay service at
    # once, and it answers dial-back probes: servers behind NAT find out and reach the swarm through it.
    dht = make_dht(
        initial_peers=args.initial_peers,
        identity=identity,
        host=args.host,
        port=args.port,
        announce_maddrs=args.announce_maddrs,
        reachability="public",
        relay_service=args.relay,
    )
    await ProbeService(relays=args.relay).add_to(await dht.replicate_p2p())
    for maddr in dht.get_visible_maddrs():
        print(maddr, flush=True)
    logger.info(f"Bootstrap peer {dht.peer_id} is up")
    await stop.wait()
    dht.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.bootstrap", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR")
    p.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR")
    p.add_argument("--identity-path", help="private key file; keeps the peer id (and addresses) across restarts")
    p.add_argument(
        "--no-relay",
        dest="relay",
        action="store_false",
        help="offer no libp2p relay to servers behind NAT (they then refuse to start; docs/nat.md)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    lifeline.install()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
