"""Fine-tuning through the swarm: seconds and bytes per training step, against the same step locally.

    python -m benchmarks.fine_tuning                     # 0 and 25 ms per hop, 5 measured steps each
    python -m benchmarks.fine_tuning --delays 0 --steps 2   # a quick look

A 3-server SmolLM2-135M swarm (swarm/local.py, 10 blocks each, one torch thread per server) behind the
delay proxy (swarm/delay_proxy.py, ``--delays`` ms one way per hop, as benchmarks/wan.py), a prompt-tuned
client (``tuning_mode="ptune"``, ``pre_seq_len=8``) and one training step = ``model(ids, labels=ids)`` +
``loss.backward()`` + an Adam step, on a batch of 4 rows x 64 tokens (random ids, seeded). The same step
is run locally with transformers (inputs_embeds = cat(prompts, embed(ids)), the whole model in this
process, one torch thread) for the reference figure and the check that the losses agree.

Measured per step (medians over ``--steps`` steps after one warm-up step):

- **swarm s**: wall seconds of the step through the swarm (``model.last_training_stats.seconds`` is the
  lap part; the rest is the client's Adam step and bookkeeping, under a millisecond);
- **local s**: the same step locally (forward + backward of the whole model, one thread);
- **local no-grad forward s**: what a non-tail span adds before its backward (it computes its blocks
  once without autograd to send them on, then again with autograd when the gradient comes back);
- **bytes/step**: the training protocol's frames of the step, every hop both ways (client -> head ->
  middle -> tail and the gradients back), computed from the messages the step sends (protocol/streams.py
  frame: marker, length, protobuf envelope of the message and its float32 tensors); libp2p's and TCP's
  own framing not included. Activations forward and gradients back are listed apart.

"Where the time goes" (printed): the servers compute each row's span forward twice (no grad, then the
recompute) and its backward once, which is about local no-grad forward + local step of compute in all,
spread over three single-threaded servers that work on the 4 rows at once (each server computes one row
at a time); each row's lap crosses 6 delayed links (client -> head -> middle -> tail, and back), so
at 25 ms per hop the floor adds 6 x 25 ms = 150 ms per step (the rows go at once).

Writes benchmarks/results/fine_tuning.json (with commit and date) and prints a Markdown table. The
machine may be shared: run it under ``nice`` and say so with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.wan import _commit
from swarm.local import LocalSwarm

PRE_SEQ_LEN = 8
BATCH, LENGTH = 4, 64


def frame_bytes(message, tensors) -> int:
    """Bytes of one frame on a training stream, as MessageStream.send writes it."""
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    from protocol import compression
    from protocol.messages import encode

    envelope = runtime_pb2.ExpertRequest(
        metadata=encode(message), tensors=[compression.serialize(t, compression.LOSSLESS) for t in tensors]
    )
    return len(envelope.SerializeToString()) + 1 + P2P.HEADER_LEN


def step_bytes(route, ids: torch.Tensor, hidden: int) -> dict[str, int]:
    """The frames of one step (every row, every hop, both ways): forward (prompts, then activations) and
    backward (gradients, the prompts' last)."""
    from protocol.messages import TrainBackward, TrainForward

    forward = backward = 0
    for row in ids.tolist():
        positions = PRE_SEQ_LEN + len(row)
        for hop in range(len(route)):
            message = TrainForward(
                step_id="0123456789abcdef",
                route=list(route),
                hop_index=hop,
                num_prompts=PRE_SEQ_LEN,
                token_ids=row,
                targets=row[1:] + [-100],
            )
            sent = torch.zeros(PRE_SEQ_LEN if hop == 0 else positions, hidden)
            forward += frame_bytes(message, [sent])  # the client's to the head, then each hop's to the next
            reply = TrainBackward(step_id="0123456789abcdef", loss_sum=1.0, num_targets=len(row) - 1)
            backward += frame_bytes(reply, [torch.zeros_like(sent)])  # each hop's gradient to the one before
    return {"forward": forward, "backward": backward, "total": forward + backward}


def local_step_seconds(steps: int, ids: torch.Tensor) -> tuple[list[float], list[float], list[float]]:
    """The same step locally: seconds of forward + backward + Adam, of a no-grad forward, and the losses."""
    from transformers import AutoModelForCausalLM

    from protocol.models import ensure_smollm2_checkpoint

    model = AutoModelForCausalLM.from_pretrained(ensure_smollm2_checkpoint(), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    prompts = (torch.randn(PRE_SEQ_LEN, model.config.hidden_size) * model.config.initializer_range).requires_grad_()
    optimizer = torch.optim.Adam([prompts], lr=1e-3)
    embeds_of = model.get_input_embeddings()

    def loss() -> torch.Tensor:
        embeds = torch.cat([prompts.expand(BATCH, -1, -1), embeds_of(ids)], dim=1)
        logits = model(inputs_embeds=embeds).logits[:, PRE_SEQ_LEN:]
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    step_s, forward_s, losses = [], [], []
    for i in range(steps + 1):
        began = time.perf_counter()
        optimizer.zero_grad()
        value = loss()
        value.backward()
        optimizer.step()
        if i:
            step_s.append(time.perf_counter() - began)
            losses.append(value.item())
        began = time.perf_counter()
        with torch.no_grad():
            loss()
        if i:
            forward_s.append(time.perf_counter() - began)
    return step_s, forward_s, losses


def swarm_steps(delay_ms: float, steps: int, ids: torch.Tensor) -> dict:
    from swarm import AutoDistributedModelForCausalLM

    server_args = ["--torch-threads", "1", "--log-level", "WARNING"]
    with LocalSwarm("smollm2-135m", 3, hop_delay_ms=delay_ms, server_args=server_args) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            "smollm2-135m", initial_peers=swarm.initial_peers, tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN
        )
        try:
            torch.manual_seed(0)
            with torch.no_grad():
                model.prompt_embeddings.weight.copy_(
                    torch.randn(PRE_SEQ_LEN, model.config.hidden_size) * model.config.initializer_range
                )
            optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            seconds, laps, losses = [], [], []
            for i in range(steps + 1):
                began = time.perf_counter()
                optimizer.zero_grad()
                loss = model(ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                if i:  # the first step opens the connections
                    seconds.append(time.perf_counter() - began)
                    laps.append(model.last_training_stats.seconds)
                    losses.append(loss.item())
            route = model.last_training_stats.route
            return {
                "delay_ms": delay_ms,
                "seconds": seconds,
                "lap_seconds": laps,
                "losses": losses,
                "failovers": model.last_training_stats.failovers,
                "route": [(hop.start, hop.end) for hop in route],
                "bytes": step_bytes(route, ids, model.config.hidden_size),
            }
        finally:
            model.shutdown()


def markdown(local: dict, settings: list[dict]) -> str:
    lines = [
        "| where | s / step (median) | x local | bytes / step (fwd + bwd) | loss of the measured steps |",
        "|---|---|---|---|---|",
        f"| local (transformers, 1 thread) | {local['median']:.2f} | 1.0 | 0 | "
        + ", ".join(f"{x:.4f}" for x in local["losses"])
        + " |",
    ]
    for s in settings:
        median = statistics.median(s["seconds"])
        b = s["bytes"]
        lines.append(
            f"| swarm, {s['delay_ms']:.0f} ms per hop | {median:.2f} | {median / local['median']:.1f} | "
            f"{b['total'] / 1e6:.2f} MB ({b['forward'] / 1e6:.2f} + {b['backward'] / 1e6:.2f}) | "
            + ", ".join(f"{x:.4f}" for x in s["losses"])
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", type=float, nargs="+", default=[0, 25])
    p.add_argument("--steps", type=int, default=5, help="measured steps per setting (after one warm-up step)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fine_tuning.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    began = time.time()
    torch.manual_seed(1)
    ids = torch.randint(0, 49152, (BATCH, LENGTH))
    step_s, forward_s, losses = local_step_seconds(args.steps, ids)
    local = {"seconds": step_s, "median": statistics.median(step_s), "forward_seconds": forward_s, "losses": losses}
    local["forward_median"] = statistics.median(forward_s)
    print(f"local: {local['median']:.2f} s per step, {local['forward_median']:.2f} s per no-grad forward", flush=True)
    settings = []
    for delay in args.delays:
        print(f"== {delay:.0f} ms per hop ==", flush=True)
        settings.append(swarm_steps(delay, args.steps, ids))
        print(settings[-1]["seconds"], flush=True)
    print(markdown(local, settings))
    compute = local["median"] + local["forward_median"]
    print(f"compute the servers do per step, in local-equivalent seconds: about {compute:.2f} (no-grad forward + step)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "commit": _commit(),
                "local": local,
                "settings": settings,
                "wall_seconds": time.time() - began,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
