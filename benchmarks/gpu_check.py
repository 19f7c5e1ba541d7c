"""GPU readiness of every served family (issue #37; the training backward of #36): one prepared run
that a lent GPU can afford (minutes), and that runs the same on CPU (``--device cpu``) so it is
developed and kept working without one. Nothing depends on it.

For each family, a tiny random checkpoint is written (tests/kit/checkpoints.py, with a small
vocabulary and no tokenizer, so no embedded model is needed), then loaded twice on the device: as a
server loads its span (``server.adapters.load_span``: the same adapter classes, weight mapping and
quantization a server runs, head to tail in one span) and as transformers' own model. Both are run
greedily from the same prompt through their caches; the table gives the largest logit difference
over the prompt and every generated position, whether the greedy tokens are equal, the peak device
memory and the seconds. nf4/int8 rows compare against transformers' model quantized by the servers'
own recipe (tests/kit/families.py ``quantized_reference``), where bitsandbytes imports. ``train``
rows recompute one row's backward through the span (as server/training.py does) and compare the
input gradient with transformers' on the same device, and the backward's peak memory with
server/memory.py ``backward_bytes``. ``batch`` rows run one batched pass of four sessions (decode steps and
chains over cached contexts; server/adapters/llama_batch.py: experts over all members at once, attention
packed or member by member) against each session alone, and give the largest activation difference.

Run: ``python -m benchmarks.gpu_check`` (CUDA if available) or ``--device cpu``; ``make gpu-check``.
Table of a real run: docs/benchmarks.md, "GPU check".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from server.adapters import GENERIC_FAMILIES

MiB = 1 << 20
VOCAB = 512  # small vocabulary: no tokenizer is needed, and the LM head stays tiny


@dataclasses.dataclass
class Row:
    family: str
    mode: str  # dtype / quantization, or "train"
    diff: str = "-"  # max |logit diff| (train: max |input grad diff|)
    equal: str = "-"  # greedy tokens equal
    ours_fp32: str = "-"  # max |logit diff| of the span against transformers in float32 (the noise floor's yardstick)
    theirs_fp32: str = "-"  # the same for transformers' own model in the checked dtype
    peak: str = "-"
    seconds: str = "-"
    note: str = ""


def build(folder: Path, family: str) -> Path:
    """The tiny checkpoint of ``family`` under ``folder`` (built once)."""
    from tests.kit.checkpoints import build_tiny_deepseek_v4, build_tiny_llama, build_tiny_moe
    from tests.kit.mxfp4 import mxfp4_like_the_hub

    path = folder / family
    if path.exists():
        return path
    if family == "llama":
        build_tiny_llama(path, vocab_size=VOCAB)
    elif family == "deepseek_v4":
        build_tiny_deepseek_v4(path, vocab_size=VOCAB)
    elif family == "gpt_oss_mxfp4":
        mxfp4_like_the_hub(build(folder, "gpt_oss"), path)
    else:
        build_tiny_moe(path, family, vocab_size=VOCAB)
    return path


def _reference(path: Path, attn: Optional[str], dtype: torch.dtype, device: str, quant: str):
    """transformers' model of ``path`` on ``device``; under ``quant``, its experts and linears
    quantized by the servers' recipe (as tests/kit/families.py ``quantized_reference``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from server.quantization import Quant

    # use_kernels=False: transformers 5.25 otherwise swaps in hub kernels (or, where the ``kernels``
    # package is missing, refuses to load on CUDA); the reference is its plain modeling code, as a span runs
    kwargs: dict = {"use_kernels": False, **({"attn_implementation": attn} if attn else {})}
    if (getattr(AutoConfig.from_pretrained(path), "quantization_config", None) or {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config  # its Triton kernels come from the hub: dequantize, as servers do

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    if quant != "none":
        from server.adapters.fused_experts import quantize_loaded_experts
        from server.quantization import quantize_loaded

        quantize_loaded_experts(model.model.layers, Quant(quant), dtype, device)
        quantize_loaded(model.model.layers, Quant(quant), dtype, device)
    return model.to(device)


def _span(path: Path, dtype: torch.dtype, device: str, quant: str):
    """The whole model as one server span (head and tail), loaded as a server loads it."""
    from transformers import AutoConfig

    from server.adapters import load_span
    from server.quantization import Quant
    from server.weights import Checkpoint

    config = AutoConfig.from_pretrained(path)
    return load_span(config, Checkpoint(str(path)), 0, config.num_hidden_layers, dtype, device, Quant(quant))


def _peak_start(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def _peak_mib(device: str, base: int = 0) -> str:
    if not device.startswith("cuda"):
        return "-"
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / MiB:.1f}"


@torch.inference_mode()
def generation_row(folder: Path, family: str, dtype: torch.dtype, device: str, quant: str, args) -> Row:
    """Greedy generation through the server's span against transformers', on ``device``."""
    path = build(folder, family)
    mode = str(dtype).replace("torch.", "") + ("" if quant == "none" else f"/{quant}")
    base = _peak_start(device)
    began = time.perf_counter()
    span = _span(path, dtype, device, quant)
    model = _reference(path, getattr(span.config, "_attn_implementation", None), dtype, device, quant)
    prompt = torch.randint(0, VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))

    cache = span.new_cache()
    logits = span.logits(span.forward(span.embed(prompt), prompt, 0, cache, range(span.start, span.end)))
    ours_logits, ours = [logits], [int(logits[-1].argmax())]
    for _ in range(args.new_tokens - 1):
        ids = torch.tensor([[ours[-1]]])
        start = span.cache_length(cache)
        logits = span.logits(span.forward(span.embed(ids), ids, start, cache, range(span.start, span.end)))
        ours_logits.append(logits)
        ours.append(int(logits[-1].argmax()))

    # transformers fed our tokens (so every position's logits compare), then its own greedy choice
    out = model(input_ids=prompt.to(device), use_cache=True)
    past, theirs_logits = out.past_key_values, [out.logits[0].float()]
    theirs = [int(out.logits[0, -1].argmax())]
    for token in ours[:-1]:
        out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        theirs_logits.append(out.logits[0].float())
        theirs.append(int(out.logits[0, -1].argmax()))
    ours_all, theirs_all = torch.cat(ours_logits).to(device), torch.cat(theirs_logits)
    diff = float((ours_all - theirs_all).abs().max())
    peak = _peak_mib(device, base)
    ours_fp32 = theirs_fp32 = "-"
    if quant == "none" and dtype != torch.float32:  # how far each is from float32: bf16's own noise
        exact = _reference(path, getattr(span.config, "_attn_implementation", None), torch.float32, device, quant)
        sequence = torch.cat([prompt, torch.tensor([ours[:-1]], dtype=torch.long)], dim=1).to(device)
        floor = exact(input_ids=sequence).logits[0].float()
        ours_fp32, theirs_fp32 = (f"{float((x - floor).abs().max()):.3g}" for x in (ours_all, theirs_all))
    note = ""
    if ours != theirs:
        note = f"greedy tokens first differ at token {next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"
    equal = "yes" if ours == theirs else "NO"
    return Row(
        family, mode, f"{diff:.3g}", equal, ours_fp32, theirs_fp32, peak, f"{time.perf_counter() - began:.1f}", note
    )


def train_row(folder: Path, family: str, dtype: torch.dtype, device: str, positions: int, args) -> Row:
    """One row's backward recompute through the span (server/training.py ``_backward``: the span's
    blocks and LM head with autograd, loss summed over the row) against transformers' on the same
    device: the input gradient (its largest difference relative to its largest value), and the
    backward's peak memory above what was allocated before it against ``backward_bytes``."""
    from server.memory import backward_bytes

    path = build(folder, family)
    began = time.perf_counter()
    span = _span(path, dtype, device, "none")
    model = _reference(path, span.config._attn_implementation, dtype, device, "none").requires_grad_(False)
    generator = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(1, positions, span.config.hidden_size, generator=generator).to(device, dtype)
    targets = torch.randint(0, VOCAB, (positions,), generator=generator).to(device)

    def grad(run: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, int]:
        leaf = hidden.detach().clone().requires_grad_(True)
        base = _peak_start(device)
        with torch.enable_grad():
            loss = torch.nn.functional.cross_entropy(run(leaf), targets, reduction="sum")
            loss.backward()
        peak = torch.cuda.max_memory_allocated() - base if device.startswith("cuda") else 0
        return leaf.grad.float(), peak

    blocks = range(span.start, span.end)
    grad(lambda leaf: span.train_logits(span.train_span(leaf, blocks)))  # warm-up: cuBLAS's workspace is not the row's
    ours, peak = grad(lambda leaf: span.train_logits(span.train_span(leaf, blocks)))
    theirs, their_peak = grad(lambda leaf: model(inputs_embeds=leaf).logits[0].float())
    diff = float((ours - theirs).abs().max()) / max(float(theirs.abs().max()), 1e-30)
    estimate = backward_bytes(span.config, dtype, positions, len(blocks), tail=True)
    note = f"{positions} positions; backward_bytes estimate {estimate / MiB:.1f} MiB"
    if peak:
        note += f", measured/estimate {peak / estimate:.2f}; transformers' own backward peak {their_peak / MiB:.1f} MiB"
    return Row(
        family,
        f"train {str(dtype).replace('torch.', '')}",
        f"{diff:.3g} (input grad, relative)",
        "-",
        "-",
        "-",
        f"{peak / MiB:.1f}" if peak else "-",
        f"{time.perf_counter() - began:.1f}",
        note,
    )


# every family a server runs (server/adapters GENERIC_FAMILIES), gpt-oss also as published (MXFP4), and DeepSeek-V4
FAMILIES = (*GENERIC_FAMILIES, "gpt_oss_mxfp4", "deepseek_v4")
QUANT_FAMILIES = ("llama", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
TRAIN_FAMILIES = ("llama", "mixtral", "qwen3_moe")
BATCH_FAMILIES = ("mixtral", "deepseek_v3", "gpt_oss")  # attention packed; latent attention; eager sinks


@torch.inference_mode()
def batch_row(folder: Path, family: str, dtype: torch.dtype, device: str, args) -> Row:
    """Four sessions through one batched pass of the server's span against each alone, on ``device``."""
    import copy

    from server.adapters.base import BatchMember

    path = build(folder, family)
    base = _peak_start(device)
    began = time.perf_counter()
    span = _span(path, dtype, device, "none")
    blocks, generator = range(span.start, span.end), torch.Generator().manual_seed(args.seed)
    alone, members = [], []
    for context, new in ((args.prompt, 1), (args.prompt // 2, 1), (args.prompt, 4), (3, 5)):
        cache = span.new_cache()
        ids = torch.randint(0, VOCAB, (1, context + new), generator=generator)
        span.forward(span.embed(ids[:, :context]), ids[:, :context], 0, cache, blocks)
        twin, hidden = copy.deepcopy(cache), span.embed(ids[:, context:])
        alone.append(span.forward(hidden, ids[:, context:], context, cache, blocks))
        members.append(BatchMember(hidden, ids[:, context:], context, twin))
    together = span.forward_batch(members, blocks)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(alone, together))
    mode = str(dtype).replace("torch.", "") + " batch"
    note = "attention packed" if span.packs_attention else "attention member by member"
    return Row(
        family,
        mode,
        f"{diff:.3g} (activations)",
        peak=_peak_mib(device, base),
        seconds=f"{time.perf_counter() - began:.1f}",
        note=note,
    )


def bitsandbytes_reason(device: str, dtype: torch.dtype) -> str:
    """Why nf4/int8 rows cannot run here ('' when they can): the servers' own start-up probe."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not run, with its reason
        return f"bitsandbytes does not import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    from server.quantization import Quant, check_runnable

    try:
        check_runnable(Quant.NF4, device, dtype)
    except ValueError as e:
        return str(e)
    return ""


def plan(args) -> list[tuple[str, Callable[[Path], Row]]]:
    dtype = getattr(torch, args.dtype)
    jobs: list[tuple[str, Callable[[Path], Row]]] = []
    for family in args.families:
        jobs.append(
            (f"{family} {args.dtype}", lambda f, fam=family: generation_row(f, fam, dtype, args.device, "none", args))
        )
    if not args.no_quant:
        reason = bitsandbytes_reason(args.device, dtype)
        for quant in ("nf4", "int8"):
            for family in [f for f in QUANT_FAMILIES if f in args.families]:
                if reason:
                    jobs.append(
                        (
                            f"{family} {quant}",
                            lambda f, fam=family, q=quant, r=reason: Row(fam, q, note=f"not run: {r}"),
                        )
                    )
                else:
                    jobs.append(
                        (
                            f"{family} {quant}",
                            lambda f, fam=family, q=quant: generation_row(f, fam, dtype, args.device, q, args),
                        )
                    )
    for family in [f for f in BATCH_FAMILIES if f in args.families]:
        jobs.append((f"{family} batch", lambda f, fam=family: batch_row(f, fam, dtype, args.device, args)))
    # float32 too: there the span's gradient should equal transformers' up to summation order
    for family in [f for f in TRAIN_FAMILIES if f in args.families]:
        for train_dtype in dict.fromkeys([dtype, torch.float32]):
            for positions in args.train_positions:
                jobs.append(
                    (
                        f"{family} train",
                        lambda f, fam=family, d=train_dtype, p=positions: train_row(f, fam, d, args.device, p, args),
                    )
                )
    return jobs


def table(rows: list[Row]) -> str:
    head = (
        "family",
        "dtype/quant",
        "max abs logit diff",
        "tokens equal",
        "ours vs fp32",
        "transformers vs fp32",
        "peak MiB",
        "s",
        "note",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (r.family, r.mode, r.diff, r.equal, r.ours_fp32, r.theirs_fp32, r.peak, r.seconds, r.note)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment(device: str) -> str:
    import transformers

    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}"
    return f"device {device} ({where}), {versions}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--prompt", type=int, default=24, help="prompt positions")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--train-positions", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-quant", action="store_true", help="skip the nf4/int8 rows")
    parser.add_argument("--out", type=Path, help="also write the table (and any tracebacks) here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # the loaders' progress bars would bury the table
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available here: pass --device cpu")

    rows: list[Row] = []
    failures: list[str] = []
    began = time.perf_counter()
    print(environment(args.device), flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name, job in plan(args):
            try:
                row = job(Path(tmp))
            except Exception as e:  # noqa: BLE001 - one family's failure is a row, the others still run
                failures.append(f"## {name}\n{traceback.format_exc()}")
                row = Row(
                    *name.rsplit(" ", 1),
                    note=f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200],
                )
            rows.append(row)
            print(f"{name}: {row}", flush=True)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    text = f"{environment(args.device)}; {time.perf_counter() - began:.0f} s in all\n\n{table(rows)}\n"
    print("\n" + text)
    if args.out:
        args.out.write_text(text + ("\n" + "\n".join(failures) if failures else ""))
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0  # a bf16 token flip is a finding for the table, not a failure


if __name__ == "__main__":
    sys.exit(main())
