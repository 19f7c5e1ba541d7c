"""Quantized weights (``--quant int8|nf4``): exact against a single-process model quantized the
same way with bitsandbytes, sizes that match what is resident, a clear error for a mode the
machine cannot run, and the defaults a GPU volunteer gets (device, dtype, initial peers).

The tiny Llama's quantized servers also serve a LoRA adapter (``--adapters``): with it, greedy output equals local
PEFT over the same quantization. Beside them a float32 server takes its adapter as a hub repo id, offline, from a
hub cache the test lays out (docs/fine_tuning.md, "LoRA adapters")."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV4ForCausalLM

from protocol.config import ENV_INITIAL_PEERS, resolve_initial_peers
from protocol.dht_records import fetch_servers
from protocol.messages import SamplingParams
from protocol.routing import MaxFlowRouter
from server.adapters import load_span
from server.adapters.deepseek_v4_quant import quantize_loaded_experts
from server.memory import model_bytes
from server.quantization import (
    Int8WeightLinear,
    Quant,
    as_served,
    bnb_config,
    check_runnable,
    default_quant,
    quantize_loaded,
    resident_bytes,
    resolve_quant,
)
from server.span_server import resolve_device, resolve_dtype
from server.weights import Checkpoint
from swarm import warm_start
from swarm.local import LocalSwarm
from tests.kit.checkpoints import build_tiny_deepseek_v4
from tests.kit.deepseek_quant import quantize_like_deepseek
from tests.kit.last_use import last_use
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.routes import PinnedRoute
from tests.kit.swarms import SERVER_ARGS
from tests.training.test_lora import ADAPTER, make_adapter

QUANTS = [Quant.INT8, Quant.NF4]
SAMPLED = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
HUB_REPO = "owner/tiny-lora"  # the adapter as a hub repo, in a hub cache laid out by the test
HUB_SHA = "0123456789abcdef0123456789abcdef01234567"  # its snapshot's commit


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v4")


def quantized_llama_reference(path, quant: Quant):
    """transformers' own bitsandbytes loading: an independent path to the same quantized model."""
    config = bnb_config(quant, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config, device_map="cpu"
    )
    return as_served(model).eval()  # the same weights, computed as the servers compute them


def quantized_v4_reference(path, quant: Quant):
    """transformers leaves fused experts unquantized, so the reference quantizes its experts and
    linears with the servers' own recipe, from transformers' float model."""
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantize_loaded_experts(model.model.layers, quant, torch.float32)
    quantize_loaded(model.model.layers, quant, torch.float32)
    return model


# ---- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", list(Quant), ids=lambda q: q.value)
def test_estimated_block_bytes_equal_what_a_loaded_block_holds(tiny_llama_path, v4_path, quant):
    """The memory plan's per-block size (meta device, no weights) is what a span really keeps."""
    for path in (tiny_llama_path, v4_path):
        config = AutoConfig.from_pretrained(path)
        span = load_span(config, Checkpoint(str(path)), 1, 2, torch.float32, "cpu", quant)
        with torch.inference_mode():  # counted after a call: a layer that builds state on first use shows it
            span.forward(
                torch.zeros(1, 2, *span.hidden_shape),
                torch.zeros(1, 2, dtype=torch.long),
                0,
                span.new_cache(),
                range(1, 2),
            )
        estimated_max, _ = model_bytes(config, torch.float32, quant)
        assert resident_bytes(span.layers) <= estimated_max
        if path == tiny_llama_path:  # all blocks of the Llama are alike
            assert resident_bytes(span.layers) == estimated_max


def test_quantized_blocks_are_smaller(tiny_llama_path):
    config = AutoConfig.from_pretrained(tiny_llama_path)
    none, int8, nf4 = (model_bytes(config, torch.float32, q)[0] for q in (Quant.NONE, Quant.INT8, Quant.NF4))
    assert nf4 < int8 < none / 3


# ---- defaults and failures ----------------------------------------------------------------------


def test_default_keeps_the_checkpoints_own_precision(tiny_llama_path, v4_path, tmp_path):
    assert default_quant(AutoConfig.from_pretrained(tiny_llama_path)).quant == Quant.NONE  # float32 weights
    quantize_like_deepseek(v4_path, tmp_path / "hub-layout")  # FP8 linears, FP4 routed experts
    choice = default_quant(AutoConfig.from_pretrained(tmp_path / "hub-layout"))
    assert choice.quant == Quant.NF4 and "FP4" in choice.reason
    fp8 = AutoConfig.from_pretrained(tiny_llama_path)
    fp8.quantization_config = {"quant_method": "fp8"}
    assert default_quant(fp8).quant == Quant.INT8


def test_a_mode_the_machine_cannot_run_is_named_with_its_reason(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"--quant nf4 cannot run on cuda .*CUDA is not available"):
        check_runnable(Quant.NF4, "cuda", torch.bfloat16)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(Int8WeightLinear, "forward", broken)
    with pytest.raises(ValueError, match=r"--quant int8 cannot run on cpu with float32 here: no kernel"):
        check_runnable(Quant.INT8, "cpu", torch.float32)


def test_auto_falls_back_when_the_default_cannot_run(tiny_llama_path, monkeypatch):
    config = AutoConfig.from_pretrained(tiny_llama_path)
    config.quantization_config = {"quant_method": "fp8"}  # default would be int8
    monkeypatch.setattr(Int8WeightLinear, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    assert resolve_quant("auto", config, "cpu", torch.float32).quant == Quant.NONE
    with pytest.raises(ValueError, match="cannot run"):
        resolve_quant("int8", config, "cpu", torch.float32)


def test_server_refuses_a_quantization_it_cannot_run_at_start(tiny_llama_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    began = time.monotonic()
    result = warm_start.run(
        "swarm.server",
        ["--model", str(tiny_llama_path), "--new-swarm", "--quant", "nf4", "--device", "cuda", "--host", "127.0.0.1"],
        timeout=120,
    )
    assert result.returncode != 0
    assert "CUDA is not available" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert time.monotonic() - began < 60


def test_device_and_dtype_auto_on_this_machine():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected
    assert resolve_dtype("auto", expected) == (torch.bfloat16 if expected == "cuda" else torch.float32)
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="--dtype must be one of"):
        resolve_dtype("int3", "cpu")


PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


def test_initial_peers_come_from_the_flag_then_the_environment_then_the_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv(ENV_INITIAL_PEERS, raising=False)
    assert resolve_initial_peers([]).peers == []
    (tmp_path / "specswarm").mkdir()
    (tmp_path / "specswarm" / "config.toml").write_text(f'initial_peers = ["{PEER}"]\n')
    assert resolve_initial_peers([]).peers == [PEER] and "config.toml" in resolve_initial_peers([]).source
    other = PEER.replace("31337", "4001")
    monkeypatch.setenv(ENV_INITIAL_PEERS, f"{other}, {PEER}")
    assert resolve_initial_peers([]).peers == [other, PEER]
    assert resolve_initial_peers([PEER]).peers == [PEER]
    monkeypatch.setenv(ENV_INITIAL_PEERS, "not-an-address")
    with pytest.raises(ValueError, match=f"{ENV_INITIAL_PEERS}: 'not-an-address' is not a multiaddr"):
        resolve_initial_peers([])


def test_server_without_peers_names_all_three_ways(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != ENV_INITIAL_PEERS}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "swarm.server", "--model", "smollm2-135m"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    for way in ("--initial-peers", ENV_INITIAL_PEERS, str(tmp_path / "specswarm" / "config.toml"), "--new-swarm"):
        assert way in result.stderr, result.stderr


# ---- over real servers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_dir(tiny_llama_path, tmp_path_factory):
    """The LoRA adapter of tests/training/test_lora.py (random pairs on q/v/o, gate and down), in PEFT's layout."""
    folder = tmp_path_factory.mktemp("qlora") / ADAPTER
    make_adapter(tiny_llama_path, folder, seed=7)
    return folder


def lay_out_hub_cache(cache, repo_id: str, folder) -> None:
    """``repo_id`` as huggingface_hub's cache holds a downloaded repo: its files in a snapshot named by its commit,
    which refs/main names."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / HUB_SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_SHA)


@pytest.fixture(scope="module")
def llama_quant_swarm(request, tiny_llama_path, artifacts_dir, lora_dir, tmp_path_factory):
    """The quantized servers serve the LoRA adapter too (``--adapters``; a run asks for it by name or not at all),
    beside one float32 server of all blocks, hub-lora, whose ``--adapters`` is a hub repo id it resolves offline
    (``HF_HUB_OFFLINE=1``) from a hub cache laid out in a temporary folder."""
    cache = tmp_path_factory.mktemp("hub-cache")
    lay_out_hub_cache(cache, HUB_REPO, lora_dir)

    def hub_server(swarm) -> None:
        with pytest.MonkeyPatch.context() as env:  # that server's process alone: offline, with this cache
            env.setenv("HF_HUB_OFFLINE", "1")
            env.setenv("HF_HUB_CACHE", str(cache))
            swarm.start_server(0, 6, name="hub-lora", extra=["--adapters", HUB_REPO])

    log_dir, extra = artifacts_dir / "quant-llama-swarm", ["--adapters", str(lora_dir)]
    yield from _swarm(request, tiny_llama_path, log_dir, [(0, 2), (2, 6)], extra, hub_server)


@pytest.fixture(scope="module")
def v4_quant_swarm(request, v4_path, artifacts_dir):
    yield from _swarm(request, v4_path, artifacts_dir / "quant-v4-swarm", [(0, 3), (3, 6)])


def _swarm(request, path, log_dir, spans, extra: Sequence[str] = (), more: Optional[Callable] = None):
    """Servers of ``spans`` once per quantization in one DHT, named e.g. ``int8-0``; the tests pin
    routes by name so an int8 run never crosses an nf4 server. ``extra``: more arguments for each; ``more``
    starts one more server (given the swarm)."""
    from swarm import AutoDistributedModelForCausalLM

    # spans=[]: the bootstrap alone, then every server at once (one start-up wait, not one per mode)
    with LocalSwarm(str(path), spans=[], server_args=SERVER_ARGS, log_dir=str(log_dir)) as swarm:
        for quant in QUANTS:
            for i, (start, end) in enumerate(spans):
                swarm.start_server(start, end, name=f"{quant.value}-{i}", extra=["--quant", quant.value, *extra])
        if more is not None:
            more(swarm)
        swarm.wait_ready(expected=len(spans) * len(QUANTS) + (more is not None))
        model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)

        def stop() -> None:
            model.shutdown()
            swarm.stop()

        with last_use.until_last_use(request, stop):
            yield model, spans


def _pin(model, quant: Quant, spans):
    model.swarm.router = PinnedRoute(model, [(f"{quant.value}-{i}", a, b) for i, (a, b) in enumerate(spans)])


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value)
def test_quantized_llama_over_servers_equals_transformers_bitsandbytes(llama_quant_swarm, tiny_llama_path, quant):
    model, spans = llama_quant_swarm
    _pin(model, quant, spans)
    reference = quantized_llama_reference(tiny_llama_path, quant)
    expected = reference.generate(torch.tensor(PROMPT), max_new_tokens=20, do_sample=False)
    assert model.generate(torch.tensor(PROMPT), max_new_tokens=20, speculation=None).tolist() == expected.tolist()
    assert model.generate(torch.tensor(PROMPT), max_new_tokens=20).tolist() == expected.tolist()  # default speculation
    sampled = model.generate(torch.tensor(PROMPT), max_new_tokens=16, **SAMPLED)[0, len(PROMPT[0]) :].tolist()
    assert sampled == reference_sample(reference, PROMPT[0], 16, SamplingParams(**SAMPLED))
    infos = fetch_servers(model.swarm.dht, model.swarm.model, 6)
    assert {i.quantization for i in infos if i.public_name.startswith(quant.value)} == {quant.value}


def peft_greedy(base, adapter_dir, new_tokens: int) -> list[list[int]]:
    from peft import PeftModel

    reference = PeftModel.from_pretrained(base, adapter_dir).eval()
    return reference.generate(torch.tensor(PROMPT), max_new_tokens=new_tokens, do_sample=False).tolist()


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value)
def test_quantized_spans_with_a_lora_adapter_equal_local_peft_over_the_same_quantization(
    llama_quant_swarm, tiny_llama_path, lora_dir, quant
):
    """The adapter's pairs wrap the int8/NF4 linears of each span (server/lora.py) as they wrap float ones."""
    model, spans = llama_quant_swarm
    _pin(model, quant, spans)
    infos = fetch_servers(model.swarm.dht, model.swarm.model, 6)
    assert {tuple(i.adapters) for i in infos if i.public_name.startswith(quant.value)} == {(ADAPTER,)}
    base = quantized_llama_reference(tiny_llama_path, quant)
    plain = base.generate(torch.tensor(PROMPT), max_new_tokens=12, do_sample=False).tolist()
    expected = peft_greedy(base, lora_dir, 12)
    assert expected != plain  # the adapter changes the output: a server ignoring it would fail
    output = model.generate(torch.tensor(PROMPT), max_new_tokens=12, speculation=None, active_adapter=ADAPTER)
    assert output.tolist() == expected


def test_an_adapter_from_the_hub_cache_is_named_by_its_repo_id_and_equals_local_peft(
    llama_quant_swarm, tiny_llama_path, lora_dir, tiny_reference
):
    """``--adapters owner/tiny-lora`` with the hub unreachable (HF_HUB_OFFLINE=1) reads huggingface_hub's cache."""
    from transformers import AutoModelForCausalLM

    model, _ = llama_quant_swarm
    model.swarm.router = MaxFlowRouter()  # unpinned: only hub-lora announces the adapter
    hub = next(i for i in fetch_servers(model.swarm.dht, model.swarm.model, 6) if i.public_name == "hub-lora")
    assert hub.adapters == [HUB_REPO]
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    expected = peft_greedy(base, lora_dir, 12)
    assert expected != tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=12, do_sample=False).tolist()
    output = model.generate(torch.tensor(PROMPT), max_new_tokens=12, speculation=None, active_adapter=HUB_REPO)
    assert output.tolist() == expected
    assert [hop[0] for hop in model.last_generation_stats.route] == [hub.peer_id]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value)
def test_quantized_deepseek_v4_over_servers_equals_the_same_quantization_in_one_process(v4_quant_swarm, v4_path, quant):
    model, spans = v4_quant_swarm
    _pin(model, quant, spans)
    reference = quantized_v4_reference(v4_path, quant)
    expected = reference.generate(torch.tensor(PROMPT), max_new_tokens=16, do_sample=False)
    assert model.generate(torch.tensor(PROMPT), max_new_tokens=16, speculation=None).tolist() == expected.tolist()
    assert model.generate(torch.tensor(PROMPT), max_new_tokens=16).tolist() == expected.tolist()


@pytest.mark.slow
def test_smollm2_over_three_quantized_servers_speculation_never_changes_the_output(artifacts_dir):
    """The real model, where quantization's rounding meets real activations: records say nf4 or
    int8, and the default speculation (drafts in most laps on a code-editing prompt) gives the
    tokens of no speculation in both modes."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.local import even_spans
    from tests.kit.prompts import CODE_EDITING

    spans = {Quant.NF4: even_spans(30, 3), Quant.INT8: even_spans(30, 2)}  # 3 nf4 servers, as the issue asks
    with LocalSwarm(
        "smollm2-135m", spans=[], server_args=SERVER_ARGS, log_dir=str(artifacts_dir / "smol-quant-swarm")
    ) as swarm:
        for quant in QUANTS:  # all five start at once
            for i, (start, end) in enumerate(spans[quant]):
                swarm.start_server(start, end, name=f"{quant.value}-{i}", extra=["--quant", quant.value])
        swarm.wait_ready(expected=5)
        model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
        try:
            infos = fetch_servers(model.swarm.dht, model.swarm.model, 30)
            messages = [{"role": "user", "content": CODE_EDITING[0]}]
            prompt = model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            for quant in QUANTS:
                _pin(model, quant, spans[quant])
                plain = model.generate(prompt, max_new_tokens=20, speculation=None)
                # fixed lap costs: the cost model, fitting a loaded machine's lap times, may cut every draft
                speculative = model.generate(prompt, max_new_tokens=20, draft_lap_costs=(1.0, 0.0))
                assert model.last_generation_stats.accepted > 0, "the drafter never hit: the test would prove nothing"
                assert speculative.tolist() == plain.tolist(), quant
        finally:
            model.shutdown()
    assert {i.public_name.split("-")[0]: i.quantization for i in infos} == {"nf4": "nf4", "int8": "int8"}
