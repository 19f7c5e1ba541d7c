"""Churn with real servers (issue 28): the command line of ``tests.kit.churn.run``, whose
docstring says what runs and what is measured.

    python -m benchmarks.churn --servers 24 --minutes 10 --period 20 --clients 4   # the issue's size
    make bench-churn CHURN_SERVERS=12 CHURN_MINUTES=5                                          # what this machine holds
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from tests.kit import churn
from tests.kit.churn import ChurnConfig, run


def _commit() -> str:
    from benchmarks.wan import _commit as commit

    return commit()


def main() -> None:
    p = argparse.ArgumentParser(description=churn.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", type=int, default=24)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--period", type=float, default=20.0, help="seconds between one server leaving and one joining")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=8, help="the first N prompts of benchmarks.load")
    p.add_argument("--seed", type=int, default=28)
    p.add_argument("--balance-period", type=float, default=60.0)
    p.add_argument("--update-period", type=float, default=15.0, help="the servers' (their default: 15 s)")
    p.add_argument(
        "--check-every",
        type=float,
        default=2.0,
        help="seconds between coverage checks (the resolution of the time without full coverage)",
    )
    p.add_argument(
        "--wave", type=int, default=2, help="initial servers started at once (each wave once the last is online)"
    )
    p.add_argument("--log-dir", default="test-artifacts/bench-churn")
    p.add_argument("--out", default="benchmarks/results/churn.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from benchmarks.load import PROMPTS
    from protocol.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model).source)
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for text in PROMPTS[: args.prompts]
    ]
    config = ChurnConfig(
        model=args.model,
        servers=args.servers,
        duration_s=60 * args.minutes,
        period_s=args.period,
        clients=args.clients,
        tokens=args.tokens,
        seed=args.seed,
        balance_period=args.balance_period,
        wave=args.wave,
        log_dir=args.log_dir,
        update_period=args.update_period,
        check_every=args.check_every,
    )
    figures = run(config, rows, commit=_commit())
    for key, value in figures.items():
        print(f"  {key}: {value}")
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
