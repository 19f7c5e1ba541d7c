"""``python -m tests.kit.faulty_server <fault options> -- <swarm.server args>``: a volunteer server with
one test fault (tests/kit/faults.py, tests/kit/hop_faults.py) patched into its own process, then the ordinary CLI.

The production CLI has no fault flags; tests that need a lying, slow or hostile server start it
through this launcher (``LocalSwarm.start_server(..., launcher=faulty(...))``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from protocol.errors import ErrorCode
from tests.kit import block_faults, faults, field_rewrites, hop_faults


def faulty(*options: str) -> list[str]:
    """The ``launcher`` for ``LocalSwarm.start_server``: this module with ``options``."""
    return ["tests.kit.faulty_server", *options, "--"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.kit.faulty_server")
    p.add_argument("--corrupt", choices=faults.CORRUPTIONS, help="the span's activations are wrong")
    p.add_argument("--block-delay-ms", type=float, default=0.0, help="sleep before each block")
    p.add_argument("--train-delay-ms", type=float, default=0.0, help="sleep before each training backward")
    p.add_argument("--train-marker", default="", metavar="PATH", help="touch PATH when a training backward starts")
    p.add_argument("--rewrite-steps", type=int, default=0, metavar="N", help="rewrite one forwarded Step in N")
    p.add_argument("--rewrite-field-file", default="", metavar="PATH", help="rewrite the Step field PATH names")
    p.add_argument("--accuse", type=int, default=0, metavar="N", help="drop one Step in N, blaming the tail")
    p.add_argument("--accuse-code", default=ErrorCode.DOWNSTREAM_FAILED.value, choices=[c.value for c in ErrorCode])
    p.add_argument("--replace-secret-hash", action="store_true", help="forward OpenSession with another secret_hash")
    p.add_argument("--black-hole", action="store_true", help="open sessions, answer pings, drop every Step")
    p.add_argument("--shield", action="store_true", help="drop the Steps of sessions that repeat an open one's ids")
    p.add_argument("--shield-evidence", action="store_true", help="--shield, only once they ask for hidden states")
    p.add_argument(
        "--lie-unless-repeated",
        choices=faults.CORRUPTIONS,
        help="corrupt the activations of every session but those that repeat an open one's ids (--shield's)",
    )
    p.add_argument("--lie-in-verdicts", type=float, default=0.0, metavar="RATE", help="lie in this share of verdicts")
    p.add_argument("--lie", default="second", choices=faults.VERDICT_LIES, help="the lie: second choice or random id")
    p.add_argument("--lie-after", type=int, default=0, metavar="POS", help="lie only from this position on")
    p.add_argument("--lie-before", type=int, default=0, metavar="POS", help="lie only before this position")
    p.add_argument("--lie-short", type=int, default=0, metavar="N", help="lie only on Steps of at most N positions")
    p.add_argument(
        "--frame", action="store_true", help="honest in live laps, name a wrong token in audit-looking Steps"
    )
    p.add_argument(
        "--frame-by-acceptance", action="store_true", help="--frame on sessions whose drafts it fully accepted so far"
    )
    p.add_argument("--lie-when-live", action="store_true", help="lie only on Steps that do not look like audits")
    p.add_argument("--lie-in-rejection", action="store_true", help="lie in rejection-exchange verdicts too")
    p.add_argument("--lie-in-outputs", type=float, default=0.0, metavar="SHIFT", help="shift returned logits")
    p.add_argument("--made-up-hidden", type=float, default=0.0, metavar="X", help="add X to returned hidden states")
    p.add_argument("--lie-unless-hidden", action="store_true", help="honest in outputs that carry hidden states")
    p.add_argument(
        "--corrupt-block", type=int, default=-1, metavar="K", help="block K's output is off (--block-offset)"
    )
    p.add_argument("--block-offset", type=float, default=5.0, metavar="X", help="what --corrupt-block adds")
    p.add_argument("--made-up-final", type=float, default=0.0, metavar="X", help="add X to final hidden states only")
    p.add_argument("--lie-in-logprobs", type=float, default=0.0, metavar="SHIFT", help="shift verdicts' log-probs")
    p.add_argument("--record-steps", default="", metavar="PATH", help="append what the tail sees of each Step")
    p.add_argument("--claim-factor", type=float, default=0.0, metavar="X", help="announce X x the measured throughput")
    return p


def patch(args: argparse.Namespace) -> None:
    """Wrap the span server's construction so the faults apply to what it builds."""
    from server import moves, span_server

    load_span, handler_class = span_server.load_span, span_server.SessionHandler

    def faulty_load_span(*a, **kw):
        span = load_span(*a, **kw)
        if args.corrupt:
            faults.corrupt_outputs(span, args.corrupt)
        if args.block_delay_ms:
            faults.slow_blocks(span, args.block_delay_ms / 1000)
        if args.corrupt_block >= 0:
            block_faults.corrupt_block(span, args.corrupt_block, args.block_offset)
        if args.train_delay_ms or args.train_marker:
            faults.slow_training(span, args.train_delay_ms / 1000, args.train_marker)
        return span

    class FaultyHandler(handler_class):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if args.rewrite_steps:
                hop_faults.rewrite_steps(self, args.rewrite_steps)
            if args.rewrite_field_file:
                field_rewrites.rewrite_field(self, args.rewrite_field_file)
            if args.accuse:
                hop_faults.accuse(self, args.accuse, ErrorCode(args.accuse_code))
            if args.replace_secret_hash:
                hop_faults.replace_secret_hash(self)
            if args.black_hole:
                hop_faults.black_hole(self)
            if args.shield or args.shield_evidence:
                hop_faults.shield(self, evidence_only=args.shield_evidence)
            if args.lie_unless_repeated:
                hop_faults.lie_unless_repeated(self, args.lie_unless_repeated)

    span_server.load_span, span_server.SessionHandler = faulty_load_span, FaultyHandler
    moves.load_span = faulty_load_span  # a span loaded by a move is as faulty as the first
    if args.lie_in_verdicts:
        faults.lie_in_verdicts(
            args.lie_in_verdicts,
            args.lie,
            after=args.lie_after,
            short=args.lie_short,
            before=args.lie_before,
            live_only=args.lie_when_live,
            rejection=args.lie_in_rejection,
        )
    if args.record_steps:
        faults.record_verdicts(args.record_steps)
    if args.lie_in_outputs:
        faults.lie_in_outputs(args.lie_in_outputs, args.made_up_hidden, args.lie_unless_hidden)
    if args.lie_in_logprobs:
        faults.lie_in_logprobs(args.lie_in_logprobs)
    if args.made_up_final:
        block_faults.made_up_final_hidden(args.made_up_final)
    if args.frame or args.frame_by_acceptance:
        faults.frame(by_acceptance=args.frame_by_acceptance)
    if args.claim_factor:
        faults.inflate_claims(args.claim_factor)


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m tests.kit.faulty_server <fault options> -- <swarm.server args>")
    split = argv.index("--")
    patch(build_parser().parse_args(argv[:split]))
    from swarm.server import main as server_main

    return server_main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
