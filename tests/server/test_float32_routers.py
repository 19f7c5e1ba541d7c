"""Parameters transformers keeps in float32 whatever the dtype (``_keep_in_fp32_modules_strict``:
DeepSeek-V3's and GLM-4-MoE's router weight and score correction bias) stay float32 in a bfloat16
span, so its routing, and so its logits, equal transformers' bfloat16 model exactly.

Found by benchmarks/gpu_check.py on an H200 (docs/benchmarks.md, "GPU check"): rounded to bfloat16,
the router chose other experts for some positions (logits off by 2.5, greedy tokens different).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from server.adapters import load_span
from server.weights import Checkpoint

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_a_bfloat16_span_keeps_the_router_in_float32_and_equals_transformers(family_paths, model_type):
    path = family_paths(model_type)
    config = AutoConfig.from_pretrained(path)
    span = load_span(config, Checkpoint(str(path)), 0, config.num_hidden_layers, torch.bfloat16, "cpu")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for ours, theirs in zip(span.layers[1:], reference.model.layers[1:]):  # block 0 is dense
        assert ours.mlp.gate.weight.dtype == torch.float32
        assert ours.mlp.gate.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(ours.mlp.gate.weight, theirs.mlp.gate.weight)
        assert torch.equal(ours.mlp.gate.e_score_correction_bias, theirs.mlp.gate.e_score_correction_bias)
    assert span.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16  # the rest in the span's dtype
    ids = torch.randint(0, 2000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference(ids).logits[0].float()
        got = span.logits(span.forward(span.embed(ids), ids, 0, span.new_cache(), range(0, span.end)))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_the_memory_plan_prices_the_float32_routers_at_float32(family_paths, model_type):
    """The plan's bytes per block equal what a loaded bfloat16 span's largest block holds: a plan
    that priced the routers at bfloat16 would let a server take more blocks than fit."""
    from server.memory import model_sizes

    path = family_paths(model_type)
    config = AutoConfig.from_pretrained(path)
    span = load_span(config, Checkpoint(str(path)), 0, config.num_hidden_layers, torch.bfloat16, "cpu")
    held = max(
        sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()]) for layer in span.layers
    )
    assert model_sizes(config, torch.bfloat16).block_bytes == held


def test_a_bfloat16_mtp_drafter_keeps_its_router_in_float32_and_the_plan_prices_it(tmp_path):
    """DeepSeek-V3's MTP layer is one more of its decoder layers: its router stays float32 as the
    blocks' do, and ``mtp_bytes`` counts what the loaded drafter holds."""
    from server.adapters.deepseek_v3_mtp import build_mtp_drafter, mtp_bytes
    from server.quantization import Quant, resident_bytes
    from tests.kit.checkpoints import build_tiny_deepseek_v3_with_mtp

    path = build_tiny_deepseek_v3_with_mtp(tmp_path / "deepseek_v3_mtp")
    config = AutoConfig.from_pretrained(path)
    span = load_span(config, Checkpoint(str(path)), 0, config.num_hidden_layers, torch.bfloat16, "cpu")
    drafter = build_mtp_drafter(span, config, Checkpoint(str(path)), max_drafts=2)
    gate = drafter.net.layer.mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert drafter.net.layer.self_attn.o_proj.weight.dtype == torch.bfloat16
    key = f"model.layers.{config.num_hidden_layers}.mlp.gate.weight"
    saved = Checkpoint(str(path)).read([key], torch.float32, progress=False)[key]
    assert torch.equal(gate.weight, saved)
    held = resident_bytes(drafter.net) + drafter.embed_weight.nbytes
    assert held == mtp_bytes(config, torch.bfloat16, Quant.NONE)
