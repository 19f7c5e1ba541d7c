"""``python -m swarm.api --initial-peers MADDR ... [--model NAME ...]``: the OpenAI-compatible gateway.

Joins the swarm as a client (one client-library model per ``--model``), listens on --host/--port,
and prints its base URL (``http://HOST:PORT/v1``) alone on stdout once it serves; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import sys
from typing import Optional

from swarm import lifeline
from swarm.cli_utils import setup_logging, stop_event_on_signals

logger = logging.getLogger("swarm.api")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.api", description=__doc__)
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="multiaddrs of peers in the swarm (default: $SPECSWARM_INITIAL_PEERS, then the config file)",
    )
    p.add_argument(
        "--model",
        nargs="+",
        default=["smollm2-135m"],
        metavar="NAME",
        help="models to serve (alias, hub repo id or local folder); the API's model ids",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", nargs="+", default=[], metavar="KEY", help="accept only these bearer keys")
    keys.add_argument("--api-key-file", help="accept only the keys in this file, one per line (# comments)")
    p.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=0,
        metavar="N",
        help="requests in flight per API key (0: unlimited; without keys, for all requests together)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take in all")
    p.add_argument("--swarm-timeout", type=float, default=60.0, help="seconds to wait for any one server's answer")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        metavar="N",  # engine.DEFAULT_MAX_TOKENS
        help="tokens at most for a request that gives no max_tokens (each hop reserves cache for them)",
    )
    p.add_argument(
        "--max-choices-per-request",
        type=int,
        default=32,
        metavar="N",  # app.MAX_CHOICES_PER_REQUEST
        help="choices one request may ask for: prompts in a batch times n (each is a session on every hop)",
    )
    p.add_argument(
        "--trusted-peers",
        nargs="+",
        default=[],
        metavar="PEER_ID",
        help="servers you trust to settle disputes and confirm tokens (docs/reliability.md, 'Witnesses')",
    )
    p.add_argument(
        "--output-audit-rate",
        type=float,
        default=0.1,  # client._output_audits.DEFAULT_OUTPUT_AUDIT_RATE
        metavar="R",
        help="share of forward passes (echo log-probs) re-computed on an independent route (docs/reliability.md)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def read_keys(args: argparse.Namespace) -> frozenset[str]:
    if not args.api_key_file:
        return frozenset(k for k in args.api_key if k)
    with open(args.api_key_file) as f:
        keys = frozenset(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"--api-key-file {args.api_key_file} holds no keys")
    return keys


async def serve(args: argparse.Namespace, models: dict) -> None:
    from swarm.api import Gateway, GatewayConfig, start_server

    config = GatewayConfig(
        read_keys(args),
        args.max_concurrent_per_key,
        args.request_timeout,
        args.default_max_tokens,
        args.max_choices_per_request,
    )
    if not config.api_keys and not _is_loopback(args.host):
        logger.warning(f"Serving on {args.host} without API keys: anyone who can reach it can use the swarm")
    stop = stop_event_on_signals()
    runner, url = await start_server(Gateway(models, config), args.host, args.port)
    print(url, flush=True)
    logger.info(f"Serving {', '.join(models)} at {url}")
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    lifeline.install()
    if args.max_concurrent_per_key < 0:
        logger.error("--max-concurrent-per-key must be >= 0")
        return 2
    if args.max_choices_per_request < 1:
        logger.error("--max-choices-per-request must be >= 1")
        return 2
    from client import AutoDistributedModelForCausalLM

    models = {}
    try:
        read_keys(args)
        for name in args.model:
            models[name] = AutoDistributedModelForCausalLM.from_pretrained(
                name,
                initial_peers=args.initial_peers or None,
                request_timeout=args.swarm_timeout,
                trusted_peers=args.trusted_peers,
                output_audit_rate=args.output_audit_rate,
            )
        asyncio.run(serve(args, models))
    except (ValueError, OSError, RuntimeError) as e:
        logger.error(str(e))
        return 2
    finally:
        for model in models.values():
            model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
