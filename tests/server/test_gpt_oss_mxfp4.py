"""gpt-oss as OpenAI publishes it: routed experts in MXFP4 (``*_blocks`` / ``*_scales``), read
by spans that dequantize only their own layers' experts with transformers' own function
(server/adapters/mxfp4_experts.py). The tiny checkpoint is the gpt_oss of tests/kit/checkpoints.py
packed by tests/kit/mxfp4.py; the reference is transformers loading the same folder with
``Mxfp4Config(dequantize=True)`` (what it does on a machine without its Triton kernels).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from server.adapters import load_span
from server.memory import model_sizes
from server.quantization import Quant, resident_bytes
from server.weights import Checkpoint
from tests.kit.checkpoints import build_tiny_moe
from tests.kit.families import cli_swarm_model
from tests.kit.mxfp4 import mxfp4_like_the_hub, pack_mxfp4
from tests.kit.reference import PROMPT, reference_sample

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> tuple[Path, Path]:
    """(the float tiny gpt_oss, its MXFP4 copy)."""
    folder = tmp_path_factory.mktemp("mxfp4")
    float_path = build_tiny_moe(folder / "gpt_oss", "gpt_oss")
    return float_path, mxfp4_like_the_hub(float_path, folder / "gpt_oss_mxfp4")


@pytest.fixture(scope="module")
def reference(paths):
    return AutoModelForCausalLM.from_pretrained(
        paths[1], dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()


def test_the_kit_packing_round_trips_through_transformers():
    """tests/kit/mxfp4.py packs what transformers' convert_moe_packed_tensors unpacks: a weight of
    known FP4 codes comes back exactly, and random weights come back within half an FP4 step of
    their block's scale, and once rounded, exactly on a second round trip."""
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 6.0] * 2)
    exact = (codes * 2.0**-3).reshape(1, 32, 1).repeat(2, 1, 3)  # [E=2, in=32, out=3], every block's largest 6/8
    blocks, scales = pack_mxfp4(exact)
    assert blocks.shape == (2, 3, 1, 16) and scales.shape == (2, 3, 1) and blocks.dtype == torch.uint8
    assert scales.unique().tolist() == [127 - 3]
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), exact)

    weight = torch.randn(4, 64, 96, generator=torch.Generator().manual_seed(0)) * 0.2
    blocks, scales = pack_mxfp4(weight)
    once = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert once.shape == weight.shape
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1).transpose(1, 2)  # [E, in, out]
    assert bool(((once - weight).abs() <= step).all())  # FP4's widest gap (4 -> 6) is 2 steps
    assert not torch.equal(once, weight)
    assert torch.equal(convert_moe_packed_tensors(*pack_mxfp4(once), dtype=torch.float32), once)


def test_the_checkpoint_is_in_the_published_layout(paths):
    keys = Checkpoint(str(paths[1])).weight_map()
    experts = "model.layers.1.mlp.experts."
    assert {experts + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks")} <= set(keys)
    assert experts + "gate_up_proj" not in keys and experts + "gate_up_proj_bias" in keys
    assert AutoConfig.from_pretrained(paths[1]).quantization_config["quant_method"] == "mxfp4"


def test_spans_hold_transformers_dequantized_experts_and_equal_its_logits(paths, reference):
    """Two spans hold exactly the tensors transformers' dequantizing load holds (experts rounded
    to MXFP4, so not the float originals), their logits equal its, and the memory plan's block is a
    loaded block (experts counted in --dtype, as held)."""
    path = paths[1]
    config = AutoConfig.from_pretrained(path)
    spans = [load_span(config, Checkpoint(str(path)), a, b, torch.float32, "cpu") for a, b in [(0, 2), (2, 4)]]
    mine = {
        f"model.layers.{span.start + i}.{name}": tensor
        for span in spans
        for i, layer in enumerate(span.layers)
        for name, tensor in layer.state_dict().items()
    }
    theirs = {n: t for n, t in reference.state_dict().items() if n.startswith("model.layers.")}
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    experts = "model.layers.3.mlp.experts.down_proj"
    original = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32).state_dict()[experts]
    assert not torch.equal(mine[experts], original)

    ids = torch.randint(0, 2000, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    caches = [span.new_cache() for span in spans]
    hidden = spans[0].embed(ids)
    for span, cache in zip(spans, caches):
        hidden = span.forward(hidden, ids, 0, cache, range(span.start, span.end))
    torch.testing.assert_close(spans[-1].logits(hidden), expected, rtol=0, atol=1e-4)
    sizes = model_sizes(config, torch.float32)
    assert sizes.block_bytes == max(resident_bytes(layer) for span in spans for layer in span.layers)
    assert sizes.block_bytes == model_sizes(AutoConfig.from_pretrained(paths[0]), torch.float32).block_bytes


def test_blocks_without_their_scales_are_named(paths, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "no_scales"
    shutil.copytree(paths[1], path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="MXFP4 blocks 'model.layers.2.mlp.experts.down_proj_blocks' but no scales"):
        load_span(AutoConfig.from_pretrained(path), Checkpoint(str(path)), 2, 4, torch.float32, "cpu", Quant.NONE)


def test_cli_servers_of_the_mxfp4_checkpoint_equal_transformers(paths, reference, artifacts_dir):
    """Two servers started with the CLI on the MXFP4 folder: greedy generation with and without
    suffix drafting and seeded sampling, token for token against transformers' dequantizing load."""
    from protocol.messages import SamplingParams

    path = paths[1]
    prompt = torch.tensor([PROMPT[0] + PROMPT[0][1:6]])
    expected = reference.generate(prompt, max_new_tokens=16, do_sample=False)
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    truth = reference_sample(reference, prompt[0].tolist(), 12, SamplingParams(**sampling))
    # --quant none: the default for an MXFP4 checkpoint is nf4 (test_an_mxfp4_checkpoint_defaults_to_nf4)
    with cli_swarm_model(path, [(0, 2), (2, 4)], artifacts_dir / "gpt-oss-mxfp4", ["--quant", "none"]) as model:
        for speculation in (None, "suffix"):
            output = model.generate(prompt, max_new_tokens=16, speculation=speculation)
            assert output.tolist() == expected.tolist(), speculation
        output = model.generate(prompt, max_new_tokens=12, speculation="suffix", **sampling)
        assert output[0, prompt.shape[1] :].tolist() == truth


def quantized_mxfp4_reference(path: Path, quant: Quant):
    """transformers' dequantizing load of the MXFP4 folder, its experts and linears then quantized
    by the servers' recipe (tests/kit/families.py ``quantized_reference``, from MXFP4)."""
    from server.adapters.fused_experts import quantize_loaded_experts
    from server.quantization import quantize_loaded

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    quantize_loaded_experts(model.model.layers, quant, torch.float32)
    quantize_loaded(model.model.layers, quant, torch.float32)
    return model


@pytest.mark.parametrize("quant", [Quant.INT8, Quant.NF4], ids=["int8", "nf4"])
def test_quantized_spans_of_the_mxfp4_checkpoint_equal_the_same_recipe_in_one_process(paths, quant):
    """``--quant`` on the MXFP4 checkpoint: each expert dequantized then re-quantized to one int8/NF4
    linear per expert and projection (server/adapters/gpt_oss_experts.py), equal to transformers'
    dequantizing load quantized alike, and the plan's block is what a loaded block holds."""
    from server.adapters.gpt_oss_experts import QuantizedGptOssExperts

    path = paths[1]
    config = AutoConfig.from_pretrained(path)
    spans = [load_span(config, Checkpoint(str(path)), a, b, torch.float32, "cpu", quant) for a, b in [(0, 2), (2, 4)]]
    assert sum(isinstance(m, QuantizedGptOssExperts) for span in spans for m in span.layers.modules()) == 4
    reference = quantized_mxfp4_reference(path, quant)
    ids = torch.randint(0, 2000, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    caches = [span.new_cache() for span in spans]
    hidden = spans[0].embed(ids)
    for span, cache in zip(spans, caches):
        hidden = span.forward(hidden, ids, 0, cache, range(span.start, span.end))
    torch.testing.assert_close(spans[-1].logits(hidden), expected, rtol=0, atol=1e-3)
    sizes = model_sizes(config, torch.float32, quant)
    assert sizes.block_bytes == max(resident_bytes(layer) for span in spans for layer in span.layers)
    assert sizes.block_bytes < model_sizes(config, torch.float32).block_bytes / 2


def test_nf4_cli_servers_of_the_mxfp4_checkpoint_equal_the_same_recipe_in_one_process(paths, artifacts_dir):
    """What a gpt-oss-120b volunteer runs: ``--quant nf4`` on the published MXFP4 layout, greedy with
    and without suffix drafting, token for token against one process quantized by the same recipe."""
    path = paths[1]
    reference = quantized_mxfp4_reference(path, Quant.NF4)
    prompt = torch.tensor(PROMPT)
    expected = reference.generate(prompt, max_new_tokens=16, do_sample=False)
    with cli_swarm_model(path, [(0, 2), (2, 4)], artifacts_dir / "gpt-oss-mxfp4-nf4", ["--quant", "nf4"]) as model:
        for speculation in (None, "suffix"):
            output = model.generate(prompt, max_new_tokens=16, speculation=speculation)
            assert output.tolist() == expected.tolist(), speculation


def test_an_mxfp4_checkpoint_defaults_to_nf4(paths):
    """Without ``--quant``, a gpt-oss checkpoint as published gets nf4 (as few bits per weight as its
    MXFP4 experts: re-quantized, not lossless), not its experts in bfloat16; a float copy keeps float."""
    from protocol.models import shipped_config_dir
    from server.quantization import default_quant

    for config in (
        AutoConfig.from_pretrained(paths[1]),
        AutoConfig.from_pretrained(shipped_config_dir("gpt-oss-120b")),
    ):
        choice = default_quant(config)
        assert choice.quant == Quant.NF4 and "MXFP4" in choice.reason
    assert default_quant(AutoConfig.from_pretrained(paths[0])).quant == Quant.NONE


# the tensor bytes of openai/gpt-oss-20b's and -120b's published safetensors (model.safetensors.index.json's
# metadata.total_size, as third-party copies of the hub repositories quote it; the hub is not reachable from here)
PUBLISHED_TENSOR_BYTES = {"gpt-oss-20b": 13_761_264_768, "gpt-oss-120b": 65_248_815_744}


@pytest.mark.parametrize("alias", list(PUBLISHED_TENSOR_BYTES))
def test_the_shipped_gpt_oss_configs_give_the_published_checkpoints_bytes(alias):
    """The shipped config's shapes, laid out as OpenAI publishes them (routed experts' weights in
    MXFP4: half a byte a value plus a one-byte scale a block of 32; everything else, expert biases
    included, in bfloat16), add up to the published checkpoint's bytes exactly: a wrong layer,
    expert, head or vocabulary count would not."""
    from protocol.models import shipped_config_dir

    config = AutoConfig.from_pretrained(shipped_config_dir(alias))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    packed = [p.numel() for name, p in model.named_parameters() if name.endswith(("experts.gate_up_proj", "down_proj"))]
    rest = sum(p.numel() for p in model.parameters()) - sum(packed)
    assert sum(n // 2 + n // 32 for n in packed) + 2 * rest == PUBLISHED_TENSOR_BYTES[alias]
