"""Mixtures of experts through the generic adapter (server/adapters/llama.py): Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3 (latent attention, shared experts, a dense first block) and GLM-4-MoE, each
a tiny random checkpoint in the hub's layout (one tensor per expert, written by transformers'
save_pretrained), equal local transformers.

Span level (float32; logits within 1e-4, only the grouping of positions differs): two spans over
a prefill, a decode and a rollback; a batched pass against each member alone; the memory plan's
block and cache bytes against what a loaded span holds. Over real servers: greedy and seeded
sampling, without speculation and with suffix drafting, token-equal to transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from server.adapters import GENERIC_FAMILIES, adapter_class, load_span
from server.adapters.expert_weights import map_keys
from server.adapters.fused_experts import QuantizedExperts
from server.adapters.gpt_oss_experts import QuantizedGptOssExperts
from server.memory import model_sizes
from server.quantization import Quant, resident_bytes
from server.weights import Checkpoint
from tests.kit.batch_rows import MEMBERS, alone_and_together
from tests.kit.checkpoints import MOE_FAMILIES
from tests.kit.expert_calls import mlp_calls
from tests.kit.families import cli_swarm_model, quantized_reference
from tests.kit.reference import PROMPT, reference_sample

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]
FAMILIES = list(MOE_FAMILIES)
ATOL = 1e-4


def _spans(path: Path, bounds: list[tuple[int, int]], quant: Quant = Quant.NONE):
    config = AutoConfig.from_pretrained(path)
    return [load_span(config, Checkpoint(str(path)), a, b, torch.float32, "cpu", quant) for a, b in bounds]


def _run(spans, caches, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
    for span, cache in zip(spans, caches):
        span.trim_cache(cache, start_pos)
    hidden = spans[0].embed(ids)
    for span, cache in zip(spans, caches):
        hidden = span.forward(hidden, ids, start_pos, cache, range(span.start, span.end))
    return spans[-1].logits(hidden)


def test_all_families_are_served_by_the_generic_adapter():
    assert set(FAMILIES) <= set(GENERIC_FAMILIES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_checkpoint_is_in_the_hub_layout(family_paths, model_type):
    """save_pretrained writes one tensor per expert (transformers' reverse conversion), so the
    spans below load what the hub ships, not the fused modules."""
    keys = Checkpoint(str(family_paths(model_type))).weight_map()
    if model_type == "gpt_oss":  # its hub layout is the fused experts themselves, with biases
        assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj_bias"} <= set(keys)
        return
    assert not any("gate_up_proj" in key for key in keys)
    expert = "block_sparse_moe.experts.3.w1.weight" if model_type == "mixtral" else "mlp.experts.3.gate_proj.weight"
    assert f"model.layers.1.{expert}" in keys


@pytest.mark.parametrize("model_type", FAMILIES)
def test_spans_equal_transformers_through_decode_and_rollback(family_paths, references, model_type):
    path, reference = family_paths(model_type), references(model_type)
    spans = _spans(path, [(0, 1), (1, 3), (3, 4)])  # splits a dense first block from the sparse ones
    caches = [span.new_cache() for span in spans]
    ids = torch.randint(0, 2000, (1, 14), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    torch.testing.assert_close(_run(spans, caches, ids[:, :9], 0), expected[:9], rtol=0, atol=ATOL)
    wrong = torch.tensor([[5, 6, 7]])  # drafts that get rejected: computed, then trimmed away
    _run(spans, caches, wrong, 9)
    assert spans[1].cache_length(caches[1]) == 12
    torch.testing.assert_close(_run(spans, caches, ids[:, 9:12], 9), expected[9:12], rtol=0, atol=ATOL)
    torch.testing.assert_close(_run(spans, caches, ids[:, 12:], 12), expected[12:], rtol=0, atol=ATOL)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_batched_pass_gives_each_member_what_it_gets_alone(family_paths, model_type):
    """Each session's own routing: members computed together (their experts over all members' tokens
    at once; attention packed, or member by member for DeepSeek-V3's latent attention and gpt-oss's
    sinks) get their own activations and caches, a tree included."""
    (span,) = _spans(family_paths(model_type), [(0, 4)])
    assert span.packs_attention == (model_type not in ("deepseek_v3", "gpt_oss")) and span.supports_trees
    with mlp_calls(span) as calls:
        alone, members, outputs = alone_and_together(span, seed=11)
    # every block's experts: once per cache filled and per member alone, then once for all members' rows together
    # (one after another, the pass would call them once per member)
    rows, fills = [member.hidden.shape[1] for member in members], sum(1 for length, _, _ in MEMBERS if length)
    assert all(len(c) == fills + len(members) + 1 and c[-1] == sum(rows) for c in calls), calls
    for (expected, cache), got, member in zip(alone, outputs, members):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert span.cache_length(member.cache) == span.cache_length(cache)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_memory_plan_counts_the_experts_and_the_cache(family_paths, references, model_type):
    """The plan's block bytes are the largest loaded block (an MoE block, fused experts included);
    its cache bytes per token are what a span's cache grows by (DeepSeek-V3: the latent and the
    rotary key, not heads x head_dim)."""
    path, reference = family_paths(model_type), references(model_type)
    config = AutoConfig.from_pretrained(path)
    sizes = model_sizes(config, torch.float32)
    assert sizes.block_bytes == max(resident_bytes(layer) for layer in reference.model.layers)
    (span,) = _spans(path, [(1, 3)])
    cache = span.new_cache()
    hidden = torch.randn(1, 10, config.hidden_size)
    span.forward(hidden, torch.zeros(1, 10, dtype=torch.long), 0, cache, range(1, 3))
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)
    assert held == 10 * span.cache_bytes_per_token() == 10 * 2 * sizes.cache_bytes_per_token


@pytest.mark.parametrize("quant", [Quant.INT8, Quant.NF4], ids=["int8", "nf4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_quantized_spans_equal_the_same_quantization_in_one_process(family_paths, model_type, quant):
    """int8/NF4 spans, experts included (one bitsandbytes linear per expert and projection, each
    quantized as it is read), equal one process quantized alike; the plan's block bytes are what a
    loaded quantized block holds."""
    path = family_paths(model_type)
    reference = quantized_reference(path, quant)
    spans = _spans(path, [(0, 2), (2, 4)], quant)
    # gpt_oss's experts (transposed, with biases, gate/up interleaved and clamped) have a split of their own
    kind = QuantizedGptOssExperts if model_type == "gpt_oss" else QuantizedExperts
    assert sum(isinstance(m, kind) for m in spans[1].layers.modules()) == 2
    assert not any(isinstance(m, torch.nn.Parameter) and m.ndim == 3 for m in spans[1].layers.parameters())
    caches = [span.new_cache() for span in spans]
    ids = torch.randint(0, 2000, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    got = torch.cat([_run(spans, caches, ids[:, :8], 0), _run(spans, caches, ids[:, 8:], 8)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    sizes = model_sizes(AutoConfig.from_pretrained(path), torch.float32, quant)
    assert sizes.block_bytes == max(resident_bytes(layer) for span in spans for layer in span.layers)


def test_an_unsupported_family_is_refused_naming_it_and_the_supported_ones():
    from transformers import FalconConfig

    with pytest.raises(ValueError, match=r"model type 'falcon' is not supported yet; supported: \[.*'gpt_oss'"):
        adapter_class(FalconConfig())


def test_an_expert_missing_from_the_checkpoint_is_named(family_paths):
    keys = [k for k in Checkpoint(str(family_paths("qwen3_moe"))).weight_map() if ".experts.2.up_proj" not in k]
    with pytest.raises(
        KeyError, match="lacks 1 expert tensor.s. of model.layers.0.mlp.experts.gate_up_proj, e.g. source.expert .1, 2."
    ):
        sources = map_keys("qwen3_moe", keys, ["model.layers.0.mlp.experts.gate_up_proj"])
        sources["model.layers.0.mlp.experts.gate_up_proj"].parts()


# ---- over real servers -------------------------------------------------------------------------

# Every family runs no speculation, token trees, its tail EAGLE head and scripted chains that the
# servers verify and roll back (the server paths a family's code takes); the client's other modes
# (suffix and n-gram chains, async runs, mixed drafters) send the same Steps whatever the family, so
# one family runs them all and the rest save a minute of the suite.
FULL_MODES_FAMILY = "deepseek_v3"

SWARM_SPANS = {
    "mixtral": [(0, 2), (2, 4)],
    "qwen2_moe": [(0, 1), (1, 3), (3, 4)],
    "qwen3_moe": [(0, 3), (3, 4)],
    "deepseek_v3": [(0, 1), (1, 4)],
    "glm4_moe": [(0, 2), (2, 4)],
    "gpt_oss": [(0, 2), (2, 4)],
}


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, family_paths, references, artifacts_dir):
    from tests.kit.checkpoints import build_random_drafter

    model_type = request.param
    path = family_paths(model_type)
    drafter = build_random_drafter(path, path.parent / f"{model_type}-eagle.safetensors")
    drafting = ["--drafter", str(drafter), "--drafter-tokens", "4"]
    # a second head and a second tail: the substitutes of spot-checks and verdict audits
    spans = [*SWARM_SPANS[model_type], SWARM_SPANS[model_type][0], SWARM_SPANS[model_type][-1]]
    log_dir = artifacts_dir / f"moe-{model_type}"
    with cli_swarm_model(path, spans, log_dir, drafting, verdict_audit_every=4) as model:
        yield model_type, model, references(model_type)


def test_swarm_generation_equals_transformers(served, monkeypatch):
    """Greedy and seeded sampling, with no speculation, token trees, the tail's random EAGLE head,
    and scripted drafts wrong at chosen offsets (so the servers verify and roll back), token for
    token against local transformers; FULL_MODES_FAMILY also with suffix and n-gram chains, async
    speculation and mixed drafters."""
    from protocol.messages import SamplingParams
    from tests.kit.drafters import ScriptedDrafter

    model_type, model, reference = served
    prompt = torch.tensor([PROMPT[0] + PROMPT[0][1:6]])  # a repeat, so suffix drafting has something to draft
    expected = reference.generate(prompt, max_new_tokens=20, do_sample=False)
    modes = [
        dict(speculation=None),
        dict(speculation="suffix", draft_tree=True),  # tree masks through the family's attention
        dict(speculation="tail", draft_lap_costs=(1.0, 0.0)),  # fixed lap costs: the cost model cuts no tail draft
    ]
    if model_type == FULL_MODES_FAMILY:  # the client's other modes reach the servers as the chains below do
        modes[1:1] = [
            dict(speculation="suffix"),
            dict(speculation="ngram"),
            dict(speculation="suffix", async_speculation=True),
            dict(speculation="suffix+tail", draft_lap_costs=(1.0, 0.0)),
        ]
    for extra in modes:
        output = model.generate(prompt, max_new_tokens=20, **extra)
        assert output.tolist() == expected.tolist(), (model_type, extra)
        if extra["speculation"] == "tail":  # the tail's EAGLE head (a decoder layer of the family's own class) drafted
            assert model.last_generation_stats.drafted > 0
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    truth = reference_sample(reference, prompt[0].tolist(), 16, SamplingParams(**sampling))
    for speculation in (None, "suffix") if model_type == FULL_MODES_FAMILY else (None,):
        output = model.generate(prompt, max_new_tokens=16, speculation=speculation, **sampling)
        assert output[0, prompt.shape[1] :].tolist() == truth, (model_type, speculation)
    for kwargs, want in (({}, expected[0, prompt.shape[1] :].tolist()), (sampling, truth)):
        drafter = ScriptedDrafter(want, prompt.shape[1], wrong_at={1, 6, 7, 12}, length=4)
        monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, drafter=drafter, **k: drafter)
        output = model.generate(prompt, max_new_tokens=len(want), num_draft_tokens=4, **kwargs)
        assert output[0, prompt.shape[1] :].tolist() == want, (model_type, kwargs)
        stats = model.last_generation_stats
        assert 0 < stats.accepted < stats.drafted and stats.laps < len(want)  # accepted, and rolled back


def test_concurrent_sessions_batched_on_the_servers_each_equal_transformers(served):
    """Eight sessions in one generate call, whose runs reach the servers together (the batched pass
    itself is checked span-level above; each session routes its own tokens to its own experts): each
    equals transformers alone."""
    from tests.kit.batch_rows import greedy_truth, padded, prompts

    model_type, model, reference = served
    rows = prompts(8, seed=3)
    ids, mask = padded(rows)
    output = model.generate(ids, attention_mask=mask, max_new_tokens=10, speculation="suffix")
    got = [output[i, ids.shape[1] :].tolist() for i in range(len(rows))]
    assert got == [greedy_truth(reference, row, 10) for row in rows], model_type


@pytest.mark.parametrize("model_type, quant", [("mixtral", Quant.NF4), ("deepseek_v3", Quant.INT8)])
def test_quantized_swarm_equals_the_same_quantization_in_one_process(family_paths, artifacts_dir, model_type, quant):
    """Servers started with ``--quant``: greedy generation, with and without suffix drafting, equals
    one process quantized by the same recipe."""

    path = family_paths(model_type)
    reference = quantized_reference(path, quant)
    prompt = torch.tensor(PROMPT)
    expected = reference.generate(prompt, max_new_tokens=16, do_sample=False)
    log_dir = artifacts_dir / f"moe-{model_type}-{quant.value}"
    with cli_swarm_model(path, [(0, 2), (2, 4)], log_dir, ["--quant", quant.value]) as model:
        for speculation in (None, "suffix"):
            output = model.generate(prompt, max_new_tokens=16, speculation=speculation)
            assert output.tolist() == expected.tolist(), speculation


def fp8_like_the_hub(src: Path, dst: Path, block: int = 16) -> None:
    """A copy of a tiny DeepSeek-V3 in its hub's FP8 form: every linear whose shape is whole
    [block, block] tiles (routed and shared experts, q_b, o_proj ...) as FP8 e4m3 with a
    ``.weight_scale_inv`` companion (one float32 scale per tile), the config's
    ``quantization_config`` as the hub ships it (with the tiny block size)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    out = {}
    for key, tensor in load_file(src / "model.safetensors").items():
        rows, cols = tensor.shape if tensor.ndim == 2 else (0, 0)
        if ".layers." in key and key.endswith("proj.weight") and rows and rows % block == 0 and cols % block == 0:
            tiles = tensor.float().reshape(rows // block, block, cols // block, block)
            scale = tiles.abs().amax(dim=(1, 3)) / 448.0
            out[key] = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
            out[key + "_scale_inv"] = scale
        else:
            out[key] = tensor
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
    }
    (dst / "config.json").write_text(json.dumps(config))


def test_deepseek_v3_fp8_checkpoint_loads_dequantized_as_transformers_does(family_paths, references, tmp_path):
    """DeepSeek-V3's hub weights are FP8 blocks with ``weight_scale_inv``: a span dequantizes them
    as transformers does on a machine without FP8 kernels, experts included."""
    path = tmp_path / "fp8"
    fp8_like_the_hub(family_paths("deepseek_v3"), path)
    keys = Checkpoint(str(path)).weight_map()
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv" in keys
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spans = _spans(path, [(0, 2), (2, 4)])
    mine = {
        f"model.layers.{span.start + i}.{n}": t
        for span in spans
        for i, layer in enumerate(span.layers)
        for n, t in layer.state_dict().items()
    }
    theirs = {n: t for n, t in reference.state_dict().items() if n.startswith("model.layers.")}
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    experts = "model.layers.1.mlp.experts.gate_up_proj"  # FP8-rounded: near the float weights, not equal
    original = references("deepseek_v3").state_dict()[experts]
    assert not torch.equal(mine[experts], original)
    torch.testing.assert_close(mine[experts], original, rtol=0.07, atol=1e-3)
    ids = torch.randint(0, 2000, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    torch.testing.assert_close(_run(spans, [s.new_cache() for s in spans], ids, 0), expected, rtol=0, atol=ATOL)


SHIPPED = {
    "mixtral-8x22b": "mixtral",
    "qwen3-235b-a22b": "qwen3_moe",
    "deepseek-v3": "deepseek_v3",
    "gpt-oss-20b": "gpt_oss",
    "gpt-oss-120b": "gpt_oss",
}


@pytest.mark.parametrize("alias", list(SHIPPED))
def test_shipped_configs_plan_the_published_shapes_offline(alias):
    """The aliases' published configs ship with the package (--plan-only answers offline); an nf4
    block holds at least its routed experts as one NF4 linear per expert and projection (gpt-oss's,
    MXFP4 as published, with their biases in bfloat16)."""
    from protocol.models import ALIASES, shipped_config_dir
    from server.quantization import estimate_linear_bytes

    assert "/" in ALIASES[alias]
    config = AutoConfig.from_pretrained(shipped_config_dir(alias))
    assert config.model_type == SHIPPED[alias]
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    experts = experts or config.n_routed_experts
    inner = config.intermediate_size if config.model_type in ("mixtral", "gpt_oss") else config.moe_intermediate_size
    hidden = config.hidden_size
    routed = experts * (
        estimate_linear_bytes(2 * inner, hidden, Quant.NF4, torch.bfloat16)
        + estimate_linear_bytes(hidden, inner, Quant.NF4, torch.bfloat16)
    )
    if config.model_type == "gpt_oss":
        assert config.quantization_config["quant_method"] == "mxfp4"
        assert config.layer_types == ["sliding_attention", "full_attention"] * (config.num_hidden_layers // 2)
        routed += experts * 2 * (2 * inner + hidden)
    sizes = model_sizes(config, torch.bfloat16, Quant.NF4)
    assert routed < sizes.block_bytes < 1.25 * routed
    if config.model_type == "deepseek_v3":  # the latent (512) and rotary key (64) per token, bfloat16
        assert sizes.cache_bytes_per_token == (512 + 64) * 2


# ---- DeepSeek-V3's MTP layer as the tail's drafter (server/adapters/deepseek_v3_mtp.py) ------------


@pytest.fixture(scope="module")
def v3_mtp_path(tmp_path_factory):
    from tests.kit.checkpoints import build_tiny_deepseek_v3_with_mtp

    return build_tiny_deepseek_v3_with_mtp(tmp_path_factory.mktemp("v3mtp") / "deepseek_v3_mtp")


@pytest.mark.parametrize("quant", [Quant.NONE, Quant.NF4], ids=["float", "nf4"])
def test_v3_mtp_drafts_after_a_rollback_equal_a_fresh_start(v3_mtp_path, quant):
    """The MTP layer's cache follows the committed text: drafts after a run whose drafts were
    rejected equal those of a drafter that saw only the committed text, in one run."""
    from server.adapters.deepseek_v3_mtp import MTPDrafter, build_mtp_drafter, mtp_bytes

    config = AutoConfig.from_pretrained(v3_mtp_path)
    (span,) = _spans(v3_mtp_path, [(0, 4)], quant)
    drafter = build_mtp_drafter(span, config, Checkpoint(str(v3_mtp_path)), max_drafts=4)
    assert isinstance(drafter, MTPDrafter)
    if quant == Quant.NONE:
        assert resident_bytes(drafter.net) + drafter.embed_weight.nbytes == mtp_bytes(config, torch.float32, quant)
    ids = torch.randint(0, 2000, (1, 12), generator=torch.Generator().manual_seed(5)).tolist()[0]

    def hidden(cache, tokens: list[int], start: int) -> torch.Tensor:
        span.trim_cache(cache, start)
        x = span.embed(torch.tensor([tokens]))
        return span.forward(x, torch.tensor([tokens]), start, cache, range(0, 4))

    cache, state = span.new_cache(), drafter.new_session()
    drafter.draft(state, hidden(cache, ids[:9], 0), ids[:9], 0, 9, ids[9], 4)
    wrong = [ids[9], 7, 8]  # the run's drafts 7, 8 rejected: only ids[9] is committed, ids[10] follows
    after_rollback = drafter.draft(state, hidden(cache, wrong, 9), wrong, 9, 1, ids[10], 4)
    fresh_cache, fresh = span.new_cache(), drafter.new_session()
    expected = drafter.draft(fresh, hidden(fresh_cache, ids[:10], 0), ids[:10], 0, 10, ids[10], 4)
    assert after_rollback == expected and len(expected) == 4


def test_v3_mtp_tail_drafts_leave_the_output_unchanged(v3_mtp_path, artifacts_dir):
    """Servers started with the default ``--drafter auto`` draft with the checkpoint's MTP layer:
    greedy and seeded sampling equal transformers, and the tail drafted."""
    from protocol.messages import SamplingParams

    reference = AutoModelForCausalLM.from_pretrained(v3_mtp_path, dtype=torch.float32).eval()
    prompt = torch.tensor(PROMPT)
    expected = reference.generate(prompt, max_new_tokens=16, do_sample=False)
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    truth = reference_sample(reference, PROMPT[0], 16, SamplingParams(**sampling))
    log_dir = artifacts_dir / "moe-deepseek-v3-mtp"
    with cli_swarm_model(v3_mtp_path, [(0, 2), (2, 4)], log_dir, ["--drafter-tokens", "3"]) as model:
        for speculation in ("tail", "suffix+tail"):
            fixed = dict(draft_lap_costs=(1.0, 0.0))  # the cost model cuts no tail draft
            output = model.generate(prompt, max_new_tokens=16, speculation=speculation, **fixed)
            assert output.tolist() == expected.tolist(), speculation
            assert model.last_generation_stats.drafted > 0
            output = model.generate(prompt, max_new_tokens=16, speculation=speculation, **sampling)
            assert output[0, prompt.shape[1] :].tolist() == truth, speculation


def test_spot_checks_and_verdict_audits_find_honest_servers_agree(served):
    """Every lap's activations audited on the second head server (spot_check_rate=1.0) and a
    verdict audit every 4 tokens on the second tail: MoE blocks recomputed elsewhere agree within
    the audits' tolerance, so nobody is excluded, and the output is still transformers'."""
    from client._swarm import ExclusionList

    model_type, model, reference = served
    # what a fresh client knows: an earlier test's exclusion (a missed ping on a loaded machine) of the
    # second tail would leave this generation no verdict audit to run
    model.swarm.excluded = ExclusionList()
    prompt = torch.tensor(PROMPT)
    expected = reference.generate(prompt, max_new_tokens=8, do_sample=False)
    output = model.generate(prompt, max_new_tokens=8, speculation=None, spot_check_rate=1.0)
    assert output.tolist() == expected.tolist(), model_type
    stats = model.last_generation_stats
    assert stats.spot_checks > 0, stats.spot_check_events
    assert stats.liars_excluded == [] and stats.tokens_retracted == 0
    assert stats.spot_checks_undecided == 0 and stats.spot_checks_failed == 0
    assert stats.verdict_audits > 0 and stats.verdict_audits_failed == 0 and stats.verdict_audits_undecided == 0


def test_a_gpt_oss_eagle_head_attends_through_sinks_in_pieces_as_in_one_pass(family_paths, tmp_path):
    """gpt_oss's EAGLE head is one of its own decoder layers under eager attention (its sinks), fed
    additive masks: a chain computed in two pieces over its cache equals the chain in one pass."""
    from server.adapters.llama import _causal_mask
    from server.tail_drafter import load_drafter
    from tests.kit.checkpoints import build_random_drafter

    path = family_paths("gpt_oss")
    net, _ = load_drafter(build_random_drafter(path, tmp_path / "eagle.safetensors"), AutoConfig.from_pretrained(path))
    assert net.additive_masks and hasattr(net.layer.self_attn, "sinks")
    generator = torch.Generator().manual_seed(2)
    features, embeds = torch.randn(1, 6, 64, generator=generator), torch.randn(1, 6, 64, generator=generator)
    cpu = torch.device("cpu")
    with torch.no_grad():
        whole = net(features, embeds, torch.arange(6)[None], None, _causal_mask(0, 6, cpu))
        cache = net.new_cache()
        first = net(features[:, :4], embeds[:, :4], torch.arange(4)[None], cache, _causal_mask(0, 4, cpu))
        second = net(features[:, 4:], embeds[:, 4:], torch.arange(4, 6)[None], cache, _causal_mask(4, 2, cpu))
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=0, atol=1e-5)
