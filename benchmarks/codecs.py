"""Activation codecs: bytes on the wire, and what they do to SmolLM2's greedy answers.

    python -m benchmarks.codecs                              # every workload, 5 prompts, 64 tokens
    python -m benchmarks.codecs --prompts 2 --max-new-tokens 16   # a quick look

(a) Bytes per element of the serialized ``runtime_pb2.Tensor`` (what ``protocol/streams.py`` puts in
the envelope; every codec's size depends on the shape only) for SmolLM2-135M (576 per position)
and DeepSeek-V4-Pro (4 x 7168) at 1, 9 and 1000 positions, with the relative RMS error of one round
trip and its CPU time on random normal data, and the relative RMS error on real SmolLM2 activations
(the residual stream at the two boundaries of a 3-server split, which has a few dimensions far
larger than the rest).

(b) Top-1 agreement, in process and without a network: SmolLM2-135M-Instruct (float32) loaded as
the 3 spans a 3-server swarm would serve, the codec applied to the activations at the 2 span
boundaries, as the servers would. For each prompt of the WAN benchmark's workloads the
uncompressed greedy answer is generated first; then prompt + answer runs teacher-forced through
each codec, and "top-1" is the fraction of answer positions whose argmax equals the uncompressed
run's. "run" is, for free-running greedy generation with the codec (one position per lap, like the
swarm without speculation), the mean number of tokens equal to the uncompressed answer before the
first difference (the whole answer when none differs). Results go to stdout as Markdown tables and
to benchmarks/results/codecs.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks.wan import _commit
from protocol.compression import CODECS, deserialize, serialize
from tests.kit.prompts import CODE_EDITING, CODE_FOLLOW_UP, OPEN_CHAT

SHAPES = {"SmolLM2-135M": (576,), "DeepSeek-V4-Pro": (4, 7168)}
POSITIONS = (1, 9, 1000)
MAX_ELEMENTS = 1 << 40


def round_trip(x: torch.Tensor, codec: str) -> torch.Tensor:
    return deserialize(serialize(x, codec), MAX_ELEMENTS).to(x.dtype)


def relative_rms_error(x: torch.Tensor, codec: str) -> float:
    y = round_trip(x, codec).float()
    return float((y - x.float()).pow(2).mean().sqrt() / x.float().pow(2).mean().sqrt())


def wire_rows(real: dict[int, torch.Tensor]) -> list[dict]:
    rows = []
    for model, hidden in SHAPES.items():
        for positions in POSITIONS:
            x = torch.randn(1, positions, *hidden, generator=torch.Generator().manual_seed(positions))
            for codec in CODECS:
                encoded = serialize(x, codec)
                reps = 1 if x.numel() > 10**6 else 5
                times = []
                for _ in range(reps):
                    began = time.perf_counter()
                    deserialize(serialize(x, codec), MAX_ELEMENTS)
                    times.append(time.perf_counter() - began)
                row = dict(
                    model=model,
                    positions=positions,
                    codec=codec,
                    bytes_per_element=len(encoded.SerializeToString()) / x.numel(),
                    rms_error_random=relative_rms_error(x, codec),
                    round_trip_ms=1000 * statistics.median(times),
                )
                if model == "SmolLM2-135M":
                    row["rms_error_real"] = relative_rms_error(real[positions], codec)
                rows.append(row)
    return rows


class Pipeline:
    """SmolLM2 as the spans of a swarm, with a codec at every boundary between two of them."""

    def __init__(self, num_servers: int):
        from transformers import AutoConfig, AutoTokenizer

        from protocol.models import ensure_smollm2_checkpoint
        from server.adapters import load_span
        from server.weights import Checkpoint
        from swarm.local import even_spans

        path = ensure_smollm2_checkpoint()
        config = AutoConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.bounds = even_spans(config.num_hidden_layers, num_servers)
        checkpoint = Checkpoint(str(path))
        self.spans = [load_span(config, checkpoint, a, b, torch.float32, "cpu") for a, b in self.bounds]
        self.boundary_activations: list[torch.Tensor] = []  # [S, 576] per boundary crossing, when recording

    def forward(self, caches, ids: list[int], start_pos: int, codec: str, record: bool = False) -> torch.Tensor:
        """Logits [S, V] of positions start_pos.. given ``caches`` holding the ones before."""
        token_ids = torch.tensor([ids])
        hidden = self.spans[0].embed(token_ids)
        for index, (span, cache, bounds) in enumerate(zip(self.spans, caches, self.bounds)):
            if index > 0:
                if record:
                    self.boundary_activations.append(hidden[0].clone())
                hidden = round_trip(hidden, codec) if codec != "none" else hidden
            hidden = span.forward(hidden, token_ids, start_pos, cache, range(*bounds))
        return self.spans[-1].logits(hidden)

    def new_caches(self):
        return [span.new_cache() for span in self.spans]

    def greedy(
        self, prompt: list[int], max_new_tokens: int, codec: str, until_unlike: Optional[list[int]] = None
    ) -> list[int]:
        """Greedy tokens; with ``until_unlike`` it stops at the first token that differs from it
        (all the free-running comparison needs, and most of its cost after an early difference)."""
        caches, tokens, new = self.new_caches(), list(prompt), list(prompt)
        for index in range(max_new_tokens):
            token = int(self.forward(caches, new, len(tokens) - len(new), codec)[-1].argmax())
            tokens.append(token)
            new = [token]
            differs = until_unlike is not None and until_unlike[index : index + 1] != [token]
            if token == self.tokenizer.eos_token_id or differs:
                break
        return tokens[len(prompt) :]

    def teacher_forced_argmax(self, prompt: list[int], answer: list[int], codec: str, record=False) -> torch.Tensor:
        """The argmax at every position that predicts an answer token, in one prefill."""
        logits = self.forward(self.new_caches(), prompt + answer, 0, codec, record)
        return logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].argmax(-1)


def agreement_rows(pipe: Pipeline, prompts: int, max_new_tokens: int, codecs: list[str]) -> tuple[list, list]:
    per_prompt = []
    first_answers: list[str] = []
    workloads = [
        ("code editing", [[{"role": "user", "content": p}] for p in CODE_EDITING[:prompts]]),
        ("open chat", [[{"role": "user", "content": p}] for p in OPEN_CHAT[:prompts]]),
        ("code editing, turn 2", None),  # built from the first turn's uncompressed answers
    ]
    for workload, conversations in workloads:
        if conversations is None:
            conversations = [
                [
                    {"role": "user", "content": p},
                    {"role": "assistant", "content": a},
                    {"role": "user", "content": CODE_FOLLOW_UP},
                ]
                for p, a in zip(CODE_EDITING, first_answers)
            ]
        for index, messages in enumerate(conversations):
            encoded = pipe.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            prompt = encoded["input_ids"][0].tolist()
            answer = pipe.greedy(prompt, max_new_tokens, "none")
            if workload == "code editing":
                first_answers.append(pipe.tokenizer.decode(answer, skip_special_tokens=True))
            reference = pipe.teacher_forced_argmax(prompt, answer, "none", record=True)
            for codec in codecs:
                agree = (pipe.teacher_forced_argmax(prompt, answer, codec) == reference).tolist()
                free = pipe.greedy(prompt, max_new_tokens, codec, until_unlike=answer)
                same = next((i for i, (a, b) in enumerate(zip(free, answer)) if a != b), min(len(free), len(answer)))
                per_prompt.append(
                    dict(
                        workload=workload,
                        prompt=index,
                        codec=codec,
                        prompt_tokens=len(prompt),
                        answer_tokens=len(answer),
                        agree=sum(agree),
                        identical_run=same,
                        whole_answer=free == answer,
                    )
                )
                print(
                    f"  {workload:<21} #{index} {codec:<10} top-1 {sum(agree):>3}/{len(agree)}"
                    f"  run {same:>3}/{len(answer)}",
                    flush=True,
                )
    rows = []
    for workload in [w for w, _ in workloads] + ["overall"]:
        for codec in codecs:
            mine = [r for r in per_prompt if r["codec"] == codec and workload in (r["workload"], "overall")]
            rows.append(
                dict(
                    workload=workload,
                    codec=codec,
                    prompts=len(mine),
                    top1=sum(r["agree"] for r in mine) / sum(r["answer_tokens"] for r in mine),
                    mean_identical_run=statistics.mean(r["identical_run"] for r in mine),
                    mean_answer_tokens=statistics.mean(r["answer_tokens"] for r in mine),
                    whole_answers=sum(r["whole_answer"] for r in mine),
                )
            )
    return rows, per_prompt


def real_activations(pipe: Pipeline) -> dict[int, torch.Tensor]:
    """[1, S, 576] of real boundary activations for each S: the last positions of one prefill for
    small S; positions of every recorded prefill put together for S = 1000."""
    recorded = torch.cat(pipe.boundary_activations)
    out = {}
    for positions in POSITIONS:
        if positions <= pipe.boundary_activations[0].shape[0]:
            out[positions] = pipe.boundary_activations[0][-positions:].unsqueeze(0)
        else:
            out[positions] = recorded[:positions].unsqueeze(0)
    return out


def wire_markdown(rows: list[dict]) -> str:
    lines = [
        "| model | positions | codec | bytes/element | rel. RMS error, random | rel. RMS error, real "
        "SmolLM2 | round trip ms |",
        "|" + "---|" * 7,
    ]
    for r in rows:
        real = f"{r['rms_error_real']:.2e}" if "rms_error_real" in r else "—"
        lines.append(
            f"| {r['model']} | {r['positions']} | {r['codec']} | {r['bytes_per_element']:.3f} "
            f"| {r['rms_error_random']:.2e} | {real} | {r['round_trip_ms']:.2f} |"
        )
    return "\n".join(lines)


def agreement_markdown(rows: list[dict]) -> str:
    lines = [
        "| workload | codec | prompts | top-1 agreement (teacher-forced) | identical tokens before first "
        "difference (mean) | answers identical |",
        "|" + "---|" * 6,
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['codec']} | {r['prompts']} | {100 * r['top1']:.1f}% "
            f"| {r['mean_identical_run']:.1f} of {r['mean_answer_tokens']:.1f} | {r['whole_answers']}/{r['prompts']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=5, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--codecs", nargs="+", default=[c for c in CODECS if c != "none"], choices=CODECS)
    p.add_argument("--threads", type=int, default=1, help="torch threads (2 ran 5x slower on a busy 2-core machine)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "codecs.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    began = time.time()
    pipe = Pipeline(args.servers)
    print(f"SmolLM2-135M as spans {pipe.bounds}; codecs at the {args.servers - 1} boundaries", flush=True)
    agreement, per_prompt = agreement_rows(pipe, args.prompts, args.max_new_tokens, args.codecs)
    wire = wire_rows(real_activations(pipe))
    print(wire_markdown(wire))
    print()
    print(agreement_markdown(agreement))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "commit": _commit(),
                "spans": pipe.bounds,
                "wire": wire,
                "agreement": agreement,
                "per_prompt": per_prompt,
                "wall_seconds": time.time() - began,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
