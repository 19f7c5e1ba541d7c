"""The honest spread of forward logits between two routes (docs/reliability.md, "Forward passes and log-probs").

``python -m benchmarks.forward_spread [--model PATH] [--dtype float32|bfloat16] [--length N]``: a local
swarm of one server of every block (route A) and three servers of a third of the blocks each (route B),
all honest and of one dtype. The same ids go through both routes as separate sessions: A prefills them
in one Step, B in Steps of 16 positions, and B's pass runs beside two other sessions of other lengths
(so its server batches them). Prints ``relative_difference`` (client/_spot_checks.py) of the two
routes' logits for every position, the largest of several prompts: the figure the output audits'
tolerance must stay above; and the largest absolute difference of the top-20 log-probs (log-softmax) of a
position, which verdicts return with ``num_logprobs``.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import torch

from client import _loop
from client._forward import prefill_outputs
from client._remote_session import RemoteSession
from client._spot_checks import relative_difference
from protocol.messages import Hop
from protocol.models import ensure_smollm2_checkpoint
from swarm import AutoDistributedModelForCausalLM
from swarm.local import LocalSwarm
from tests.kit.swarms import servers_by_name


async def _pass(model, route, ids, chunk):
    swarm = model.swarm
    session = RemoteSession(swarm.p2p, route, len(ids), timeout=swarm.request_timeout)
    try:
        await session.open()
        logits, _ = await prefill_outputs(session, ids, len(ids), chunk, model.config.vocab_size, 0)
        return logits
    finally:
        await session.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--length", type=int, default=96)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args()
    path = args.model or str(ensure_smollm2_checkpoint())
    from transformers import AutoConfig

    n = AutoConfig.from_pretrained(path).num_hidden_layers
    thirds = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    spans, names = [(0, n), *thirds], ["A", "B1", "B2", "B3"]
    server_args = ["--torch-threads", "1", "--update-period", "5", "--dtype", args.dtype]
    with LocalSwarm(path, spans=spans, names=names, server_args=server_args) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=swarm.initial_peers)
        try:
            by = servers_by_name(model, n)
            route_a = [Hop(by["A"].peer_id, 0, n)]
            route_b = [Hop(by[name].peer_id, s, e) for name, (s, e) in zip(names[1:], thirds)]
            rng, worst, worst_lp = random.Random(0), 0.0, 0.0
            vocab = model.config.vocab_size
            for k in range(args.prompts):
                ids = [rng.randrange(vocab) for _ in range(args.length)]
                others = [[rng.randrange(vocab) for _ in range(m)] for m in (40, 70)]

                async def both():
                    a = await _pass(model, route_a, ids, 512)
                    b, *_ = await asyncio.gather(
                        _pass(model, route_b, ids, 16), *(_pass(model, route_b, o, 32) for o in others)
                    )
                    return a, b

                a, b = _loop.run(both())
                rows = [relative_difference(a[i], b[i]) for i in range(len(ids))]
                worst = max(worst, max(rows))
                la, lb = torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1)
                top = la.topk(20, dim=-1).indices  # the log-probs a verdict returns (top-K, K <= 20)
                lp = float((la.gather(1, top) - lb.gather(1, top)).abs().max())
                worst_lp = max(worst_lp, lp)
                median = sorted(rows)[len(rows) // 2]
                print(
                    f"prompt {k}: max {max(rows):.3g}, median {median:.3g} over {len(ids)} positions; "
                    f"top-20 log-probs {lp:.3g}"
                )
            print(
                f"{args.dtype}: largest relative difference {worst:.3g}; of a top-20 log-prob {worst_lp:.3g} (absolute)"
            )
        finally:
            model.shutdown()


if __name__ == "__main__":
    main()
