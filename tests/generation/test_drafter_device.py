"""Where the drafter pipeline runs (server/drafter_device.py) and its wall-clock cap: the parts of
the GPU job (benchmarks/gpu_drafter.py) that a CPU-only machine can check."""

from __future__ import annotations

import pytest
import torch

import server.drafter_data as drafter_data
from server.drafter_data import generate, read_manifest
from server.drafter_device import pick_device
from server.tail_drafter import cache_kwarg


@pytest.fixture
def tf32_flags():
    """Leave the process's float32 settings as they were (pick_device("cuda") changes them)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def test_auto_picks_cuda_only_when_there_is_one_and_turns_tf32_off(monkeypatch, tf32_flags):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu") == pick_device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        pick_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        pick_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    assert pick_device("auto") == torch.device("cuda")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"


def test_max_seconds_finishes_the_shard_under_way_and_a_later_run_goes_on(tiny_llama_path, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    ticks = iter(range(0, 10_000, 10))  # each look at the clock: 10 s later
    monkeypatch.setattr(drafter_data, "_clock", lambda: next(ticks))
    kwargs = dict(model_name="tiny", target_tokens=10**9, batch=2, max_new_tokens=4, progress=False)
    stopped = generate(model, tokenizer, tmp_path, max_seconds=25, **kwargs)  # looks at 10 and 20: go; 30: stop
    assert len(stopped.shards) == 2 and read_manifest(tmp_path).shards == stopped.shards
    assert sorted(p.name for p in tmp_path.glob("shard-*.pt")) == ["shard-00000.pt", "shard-00001.pt"]
    resumed = generate(model, tokenizer, tmp_path, max_shards=1, **kwargs)
    assert len(resumed.shards) == 3 and resumed.shards[:2] == stopped.shards


def test_cache_kwarg_names_what_the_installed_transformers_reads():
    import inspect

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Older(torch.nn.Module):  # transformers 5.17's signature (the GPU image's)
        def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
            return hidden_states

    class Newer(torch.nn.Module):  # transformers 5.25's
        def forward(self, hidden_states, attention_mask=None, cache=None, use_cache=False, **kwargs):
            return hidden_states

    assert cache_kwarg(Older()) == "past_key_values" and cache_kwarg(Newer()) == "cache"
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    assert cache_kwarg(layer) in inspect.signature(LlamaDecoderLayer.forward).parameters


def test_training_on_rows_shorter_than_a_window_says_so(tiny_llama_path, tmp_path):
    """A shard whose rows are all shorter than --chunk has no window; a data folder of such shards
    used to crash on an empty reshape (and, past it, would loop for ever looking for a batch)."""
    from transformers import AutoModelForCausalLM

    from server.drafter_data import Manifest, _atomic_write, make_shard, write_manifest
    from server.drafter_fit import Fit, FitConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval().requires_grad_(False)
    shard = make_shard([0, 1], [[1, 2, 3], [4, 5]], [[6, 7], [8]], 0.0)
    _atomic_write(tmp_path / "shard-00000.pt", lambda f: torch.save(shard, f))
    entry = dict(file="shard-00000.pt", indices=[0, 1], prompts=["a", "b"], answer_tokens=3, temperature=0.0)
    write_manifest(tmp_path, Manifest("tiny", 0, 4, [entry]))
    fit = Fit(model, tmp_path, tmp_path / "ck.pt", FitConfig(chunk=16, max_steps=2), draft_vocab=torch.arange(8))
    with pytest.raises(ValueError, match="no row holds 16 positions"):
        fit.run(progress=False)
