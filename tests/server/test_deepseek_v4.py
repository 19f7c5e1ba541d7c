"""DeepSeek-V4 served in spans equals local transformers, token for token (float32), and its
caches roll back exactly.

A tiny random DeepSeek-V4 (6 blocks: hash-MoE in blocks 0-2; HCA, CSA and sliding-window
attention; hc_mult 4; compression windows of 4 (CSA) and 8 (HCA); a sliding window of 8) is
built by a fixture, so a few dozen positions cross many compression-window boundaries and leave
the sliding window. The spans are first driven directly, the way servers drive them (trim to
start_pos, run the blocks, verify at the tail), then over real servers. Tolerance: logits agree
to 1e-4 (float32; only the batching of positions differs); tokens agree exactly.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, DeepseekV4ForCausalLM

from protocol.messages import SamplingParams
from protocol.models import resolve_model
from protocol.sampling import verify
from server.adapters import SpanCancelled, load_span
from server.adapters.deepseek_v4 import DeepseekV4Adapter
from server.adapters.deepseek_v4_cache import RollbackTooDeep
from server.memory import GiB, blocks_that_fit, model_sizes, plan_blocks
from server.quantization import Quant, resident_bytes
from server.weights import Checkpoint
from swarm import lifeline, warm_start
from tests.kit.checkpoints import CSA, HCA, SWA, build_tiny_deepseek_v4
from tests.kit.deepseek_quant import quantize_like_deepseek
from tests.kit.drafters import ScriptedDrafter
from tests.kit.last_use import last_use
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.swarms import SERVER_ARGS
from tests.kit.threads import single_torch_thread

SPLITS = {
    "2 spans, split inside the hash-MoE blocks": [(0, 2), (2, 6)],
    "3 spans": [(0, 1), (1, 4), (4, 6)],
}
GREEDY = SamplingParams()
SAMPLED = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> Path:
    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v4")


@pytest.fixture(scope="module")
def v4_reference(v4_path):
    return DeepseekV4ForCausalLM.from_pretrained(v4_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def v4_spans(v4_path):
    """Loads each (start, end) once."""
    config, checkpoint, loaded = AutoConfig.from_pretrained(v4_path), Checkpoint(str(v4_path)), {}

    def get(bounds: list[tuple[int, int]]):
        for start, end in bounds:
            if (start, end) not in loaded:
                loaded[(start, end)] = load_span(config, checkpoint, start, end, torch.float32, "cpu")
        return [loaded[b] for b in bounds]

    return get


class Pipeline:
    """Spans driven as servers drive them: trim every cache to start_pos, run, verify at the tail."""

    def __init__(self, spans):
        self.spans, self.caches, self.history = spans, [span.new_cache() for span in spans], []
        self.rejected_at: list[int] = []

    def run(self, token_ids: list[int], start_pos: int, cancel_at_block: int | None = None) -> torch.Tensor:
        for span, cache in zip(self.spans, self.caches):
            span.trim_cache(cache, start_pos)
        del self.history[start_pos:]
        ids = torch.tensor([token_ids])
        hidden = self.spans[0].embed(ids)  # [1, S, hc_mult, hidden] between spans
        check_cancelled = _canceller(cancel_at_block)
        for span, cache in zip(self.spans, self.caches):
            hidden = span.forward(hidden, ids, start_pos, cache, range(span.start, span.end), check_cancelled)
        self.history.extend(token_ids)
        return self.spans[-1].logits(hidden)  # [S, V]

    def generate(self, prompt: list[int], max_new_tokens: int, params: SamplingParams, drafter=None) -> list[int]:
        """One lap per verification, like the client: committed-but-uncached ids + drafts."""
        committed, cached = list(prompt), 0
        while len(committed) - len(prompt) < max_new_tokens:
            drafts = drafter(len(committed)) if drafter else []
            tokens = committed[cached:] + drafts
            logits = self.run(tokens, cached)
            accepted, next_token, _ = verify(logits, self.history, cached, len(drafts), params)
            if accepted < len(drafts):
                self.rejected_at.append(len(committed) + accepted)
            committed += drafts[:accepted] + [next_token]
            cached += len(tokens) - len(drafts) + accepted
        return committed[len(prompt) : len(prompt) + max_new_tokens]


def _canceller(block: int | None):
    """Raises SpanCancelled before block number ``block`` (counted over the whole route)."""
    seen = [0]

    def check() -> None:
        seen[0] += 1
        if block is not None and seen[0] > block:
            raise SpanCancelled()

    return check


def every_offset_drafter(truth: list[int], prompt_len: int, width: int = 8):
    """Drafts ``width`` ids of the truth with one wrong at the index that puts the rejection at
    residue (lap mod width) of the absolute position: over ``width`` laps a rejection falls on
    every offset inside a compression window (width 8 = HCA; CSA's 4 divides it)."""
    lap = [0]

    def propose(position: int) -> list[int]:
        wrong = (lap[0] - position) % width
        lap[0] += 1
        drafts = list(truth[position - prompt_len : position - prompt_len + width])
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 1000
        return drafts

    return propose


# ---- spans, driven directly ------------------------------------------------------------------


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_spans_greedy_equals_transformers(v4_spans, v4_reference, split):
    expected = v4_reference.generate(torch.tensor(PROMPT), max_new_tokens=24, do_sample=False)
    output = Pipeline(v4_spans(SPLITS[split])).generate(PROMPT[0], 24, GREEDY)
    assert output == expected[0, len(PROMPT[0]) :].tolist()


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_spans_seeded_sampling_equals_reference_sampler(v4_spans, v4_reference, split):
    expected = reference_sample(v4_reference, PROMPT[0], 20, SAMPLED)
    assert Pipeline(v4_spans(SPLITS[split])).generate(PROMPT[0], 20, SAMPLED) == expected


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_rejections_at_every_window_offset_never_change_the_output(v4_spans, params):
    spans = v4_spans(SPLITS["3 spans"])
    plain = Pipeline(spans).generate(PROMPT[0], 40, params)
    pipeline = Pipeline(spans)
    output = pipeline.generate(PROMPT[0], 40, params, every_offset_drafter(plain, len(PROMPT[0])))
    assert output == plain
    assert {p % 8 for p in pipeline.rejected_at} == set(range(8))  # every HCA (and CSA) window offset


def test_trim_inside_a_compression_window_is_exact(v4_spans, v4_reference):
    """Wrong drafts at 16..24 (past the sliding window, across an HCA window), trimmed back to every
    position of that window: continuing gives the logits of a run that never saw them."""
    spans = v4_spans(SPLITS["3 spans"])
    truth = (PROMPT[0] * 4)[:32]
    with torch.no_grad():
        full = v4_reference(torch.tensor([truth])).logits[0]  # [32, V]
    for keep in range(16, 25):
        pipeline = Pipeline(spans)
        pipeline.run(truth[:16], 0)
        drafts = truth[16:keep] + [(t + 7) % 1000 for t in truth[keep:25]]
        pipeline.run(drafts, 16)
        logits = pipeline.run(truth[keep:], keep)  # trims to `keep` first
        fresh = Pipeline(spans)
        fresh.run(truth[:16], 0)
        if keep > 16:
            fresh.run(truth[16:keep], 16)
        never = fresh.run(truth[keep:], keep)
        assert torch.allclose(logits, never, atol=ATOL), f"trim to {keep}"
        assert torch.allclose(logits, full[keep:], atol=ATOL), f"trim to {keep}"
        assert logits.argmax(-1).tolist() == full[keep:].argmax(-1).tolist()


def test_rollback_deeper_than_the_kept_history_is_refused(v4_path):
    config = AutoConfig.from_pretrained(v4_path)
    span = DeepseekV4Adapter(config, Checkpoint(str(v4_path)), 0, 6, max_rollback=4)
    truth = (PROMPT[0] * 3)[:28]
    pipeline = Pipeline([span])
    pipeline.run(truth[:12], 0)
    pipeline.run([(t + 3) % 1000 for t in truth[12:20]], 12)
    with pytest.raises(RollbackTooDeep, match="cannot roll back"):
        span.trim_cache(pipeline.caches[0], 15)  # 5 back, 4 kept
    assert span.cache_length(pipeline.caches[0]) == 20  # a refused trim changes nothing
    logits = pipeline.run(truth[16:], 16)  # exactly max_rollback back: allowed, and exact
    fresh = Pipeline([span])  # never saw positions 16..19 (its 12..15 are the same wrong ids)
    fresh.run(truth[:12], 0)
    fresh.run([(t + 3) % 1000 for t in truth[12:16]], 12)
    assert torch.allclose(logits, fresh.run(truth[16:], 16), atol=ATOL)


def test_cancel_between_blocks_leaves_no_trace(v4_spans, v4_reference):
    spans = v4_spans(SPLITS["2 spans, split inside the hash-MoE blocks"])
    truth = (PROMPT[0] * 3)[:30]
    with torch.no_grad():
        full = v4_reference(torch.tensor([truth])).logits[0]
    pipeline = Pipeline(spans)
    pipeline.run(truth[:13], 0)
    with pytest.raises(SpanCancelled):  # abandoned inside the second span, as a Cancel would
        pipeline.run([(t + 5) % 1000 for t in truth[13:22]], 13, cancel_at_block=4)
    for span, cache in zip(spans, pipeline.caches):
        span.trim_cache(cache, 13)  # what the batch scheduler does on SpanCancelled
    assert torch.allclose(pipeline.run(truth[13:], 13), full[13:], atol=ATOL)


# ---- weights ---------------------------------------------------------------------------------


def test_quantized_hub_layout_loads_as_transformers_does(v4_path, tmp_path):
    path = tmp_path / "quantized"
    expected = quantize_like_deepseek(v4_path, path)
    config = AutoConfig.from_pretrained(path)
    reference = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # dequantizes on CPU
    spans = [load_span(config, Checkpoint(str(path)), a, b, torch.float32, "cpu") for a, b in [(0, 2), (2, 6)]]
    params = {prefix + n: t for s in spans for prefix, m in s._owned().items() for n, t in m.state_dict().items()}
    assert params.keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(params[name], tensor), name
    w1 = torch.stack([expected[f"layers.3.ffn.experts.{e}.w1.weight"] for e in range(4)])
    assert torch.equal(params["model.layers.3.mlp.experts.gate_up_proj"][:, :32], w1)  # FP4 unpacked and scaled
    assert torch.equal(params["model.layers.1.self_attn.q_b_proj.weight"], expected["layers.1.attn.wq_b.weight"])
    ids = torch.tensor([PROMPT[0]])
    with torch.no_grad():
        assert torch.allclose(Pipeline(spans).run(PROMPT[0], 0), reference(ids).logits[0], atol=ATOL)


def test_bfloat16_span_keeps_transformers_float32_modules(v4_path):
    config = AutoConfig.from_pretrained(v4_path)
    span = load_span(config, Checkpoint(str(v4_path)), 0, 6, torch.bfloat16, "cpu")
    reference = DeepseekV4ForCausalLM.from_pretrained(v4_path, dtype=torch.bfloat16)
    dtypes = {prefix + n: t.dtype for prefix, m in span._owned().items() for n, t in m.state_dict().items()}
    assert dtypes == {n: t.dtype for n, t in reference.state_dict().items()}
    assert dtypes["model.layers.0.attn_hc.fn"] == torch.float32 and dtypes["lm_head.weight"] == torch.bfloat16


# ---- server: memory, aliases, offline start -----------------------------------------------------


def test_blocks_that_fit_a_fabricated_budget():
    assert blocks_that_fit(GiB, 10 * GiB, int(2.5 * GiB), 61, reserve_bytes=int(1.5 * GiB)) == 6
    assert blocks_that_fit(GiB, 100 * GiB, 0, 6) == 6  # never more than the model has
    assert blocks_that_fit(3 * GiB, 10 * GiB, 2 * GiB, 61, reserve_bytes=2 * GiB) == 2  # rounds down
    with pytest.raises(ValueError, match="not even one block fits"):
        blocks_that_fit(4 * GiB, 8 * GiB, 2 * GiB, 61, reserve_bytes=3 * GiB)


def test_plan_blocks_for_a_fabricated_free_memory(v4_path, v4_reference):
    config = AutoConfig.from_pretrained(v4_path)
    sizes = model_sizes(config, torch.float32)
    # every tensor a block keeps: float32 parameters and the hash layers' integer token-to-expert table
    assert sizes.block_bytes == max(resident_bytes(layer) for layer in v4_reference.model.layers)
    per_token = sizes.cache_bytes_per_token * 2048  # --cache-tokens 2048, per block
    free = int((3.5 * sizes.block_bytes + 4 * per_token) / 0.95)  # 5% headroom; 3.5 blocks with their cache
    plan = plan_blocks(config, torch.float32, "cpu", 6, free_bytes=free, cache_tokens=2048)
    assert plan.blocks == 3 and plan.cache_bytes(3) == 3 * per_token and plan.cache_budget_tokens(3) == 2048
    assert plan.head_blocks < 3 and plan.tail_blocks < 3  # the ends hold embeddings or LM head (12 MiB) too
    assert "3 of 6 blocks fit" in plan.describe("cpu")


def test_the_memory_plan_counts_the_mtp_block_at_the_tail(v4_mtp_paths):
    """A tail also holds the checkpoint's MTP module (one more block plus its projections): the
    plan says how many blocks still fit beside it, and the server's estimate matches what loads."""
    from server.adapters.deepseek_v4_mtp import load_mtp, mtp_bytes
    from server.drafter_attach import drafter_bytes
    from server.server_config import ServerConfig

    path = v4_mtp_paths("csa")
    config, checkpoint = AutoConfig.from_pretrained(path), Checkpoint(str(path))
    expected = resident_bytes(load_mtp(config, checkpoint, torch.float32, "cpu"))
    assert mtp_bytes(config, checkpoint, torch.float32) == expected
    assert mtp_bytes(config, None, torch.float32) == expected  # from the config alone (--plan-only): CSA assumed
    assert drafter_bytes(ServerConfig(model=str(path)), config, checkpoint, torch.float32, Quant.NONE) == expected
    assert (
        drafter_bytes(ServerConfig(model=str(path), drafter="none"), config, checkpoint, torch.float32, Quant.NONE) == 0
    )
    sizes = model_sizes(config, torch.float32)
    assert (
        0.1 * sizes.block_bytes < expected < sizes.block_bytes
    )  # the tiny MTP block is smaller than the largest main block
    per_token = sizes.cache_bytes_per_token * 2048
    # room for 3.1 blocks beside the LM head: 3, or 2 beside the MTP module
    free = int((sizes.tail_bytes + 3.1 * sizes.block_bytes + 3 * per_token) / 0.95)
    plan = plan_blocks(config, torch.float32, "cpu", 6, free_bytes=free, drafter_bytes=expected, cache_tokens=2048)
    assert (plan.tail_blocks, plan.most_blocks(tail=True, drafter=False), plan.drafter_bytes) == (2, 3, expected)
    assert "2 blocks (3 without it)" in plan.describe("cpu")


def test_aliases_name_the_official_hub_repos():
    assert resolve_model("deepseek-v4-pro").source == "deepseek-ai/DeepSeek-V4-Pro"
    assert resolve_model("deepseek-v4-flash").source == "deepseek-ai/DeepSeek-V4-Flash"
    assert resolve_model("deepseek-v4-pro").dht_name == "deepseek-v4-pro"


def test_server_without_network_fails_fast_naming_the_repo(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, "-m", "swarm.server", "--model", "deepseek-v4-pro", "--new-swarm", "--host", "127.0.0.1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "deepseek-ai/DeepSeek-V4-Pro" in output and "Traceback" not in output


def test_server_without_blocks_takes_what_fits_and_says_so(v4_path):
    process = warm_start.start(
        "swarm.server",
        ["--model", str(v4_path), "--new-swarm", "--host", "127.0.0.1", "--torch-threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
        env=lifeline.child_env(),  # exits if pytest is killed
    )
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "Serving blocks" in line or "Ready" in line or process.poll() is not None:
                break
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log = "".join(lines)
    assert "6 of 6 blocks fit" in log and "GiB free on cpu" in log, log
    assert "Serving blocks 0:6" in log, log


# ---- over real servers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def v4_model(request, v4_path, artifacts_dir):
    from swarm import AutoDistributedModelForCausalLM
    from swarm.local import LocalSwarm
    from tests.kit.faulty_server import faulty

    swarm = LocalSwarm(
        str(v4_path),
        spans=[(0, 2), (2, 6)],
        server_args=SERVER_ARGS,
        log_dir=str(artifacts_dir / "v4-swarm"),
        names=["V4-head", "V4-tail"],
        launcher=faulty("--block-delay-ms", "5"),
    )  # slow blocks: cancels catch runs mid-span
    with swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(str(v4_path), initial_peers=swarm.initial_peers)
        with last_use.until_last_use(request, lambda: (model.shutdown(), swarm.stop())):
            yield model


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_swarm_with_rejected_drafts_equals_plain_and_transformers(v4_model, v4_reference, monkeypatch, sampling, mode):
    """Rejections and (async) cancelled runs roll the servers' caches back; the output never changes."""
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1234) if sampling else {}
    plain = v4_model.generate(torch.tensor(PROMPT), max_new_tokens=24, speculation=None, **kwargs)
    truth = plain[0, len(PROMPT[0]) :].tolist()
    if sampling:
        assert truth == reference_sample(v4_reference, PROMPT[0], 24, SAMPLED)
    else:
        expected = v4_reference.generate(torch.tensor(PROMPT), max_new_tokens=24, do_sample=False)
        assert plain.tolist() == expected.tolist()
    drafter = ScriptedDrafter(truth, len(PROMPT[0]), wrong_at={1, 6, 11, 12, 16, 21}, length=5)
    monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
    # async: 4 drafts and the drafter's fifth id as the guess that sends the next run early
    speculation = (
        dict(async_speculation=True, max_inflight_runs=3, num_draft_tokens=4)
        if mode == "async"
        else dict(num_draft_tokens=5)
    )
    output = v4_model.generate(torch.tensor(PROMPT), max_new_tokens=24, **speculation, **kwargs)
    assert output.tolist() == plain.tolist()
    stats = v4_model.last_generation_stats
    assert 0 < stats.accepted < stats.drafted and stats.laps < 24
    if mode == "async":  # refuted runs in flight were cancelled, and the caches trimmed back
        assert stats.runs_cancelled > 0


def test_v4_tail_without_mtp_sends_no_tail_drafts(v4_model):
    """The tiny V4 has no ``mtp.*`` tensors: its tail drafts nothing, as a Llama without a head."""
    v4_model.generate(torch.tensor(PROMPT), max_new_tokens=8, speculation="tail")
    stats = v4_model.last_generation_stats
    assert stats.drafted == 0 and stats.drafter_sources["tail"][1] == 0


# ---- the MTP module as the tail's drafter (server/adapters/deepseek_v4_mtp.py) ------------

MTP_KINDS = {"csa": CSA, "hca": HCA, "sliding": SWA}


@pytest.fixture(scope="module")
def v4_mtp_paths(v4_path, tmp_path_factory):
    """The tiny V4 plus one random MTP module whose block has attention of the given kind."""
    from tests.kit.checkpoints import add_random_mtp

    built = {}

    def get(kind: str = "csa") -> Path:
        if kind not in built:
            path = tmp_path_factory.mktemp("ckpt") / f"tiny-v4-mtp-{kind}"
            built[kind] = add_random_mtp(v4_path, path, MTP_KINDS[kind])
        return built[kind]

    return get


def _mtp_cache_state(cache) -> dict:
    """Everything a rewindable V4 cache layer keeps that later positions read."""
    state = {}
    for i, layer in enumerate(cache.layers):
        state[f"{i}.length"] = layer.cumulative_length
        state[f"{i}.window"] = layer.history
        for name in getattr(layer, "compressed_kv", {}):
            state[f"{i}.{name}.entries"] = layer.entry_count[name]
            for what in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
                state[f"{i}.{name}.{what}"] = getattr(layer, what, {}).get(name)
            state[f"{i}.{name}.raw"] = layer._raw[name]
    return state


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            assert len(x) == len(y) and all(torch.allclose(p, q, atol=1e-5) for p, q in zip(x, y)), key
        elif isinstance(x, torch.Tensor):
            assert y is not None and x.shape == y.shape and torch.allclose(x, y, atol=1e-5), key
        else:
            assert x == y, key


# ---- continuous batching (server/adapters/deepseek_v4_batch.py) ----------------------------------

# (cached positions, new positions): decodes past the sliding window and at every compression-window
# offset, a prefill that closes windows of both rates, drafts across a window boundary
BATCH_MEMBERS = [(13, 1), (0, 11), (6, 3), (21, 5), (3, 1), (9, 2)]


def _v4_member(span, length: int, num_new: int, seed: int, cancelled=lambda: False):
    """A cache filled with ``length`` random positions, its deep copy, and a member of ``num_new``."""
    from server.adapters.base import BatchMember

    cache = span.new_cache()
    if length:
        ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(seed))
        span.forward(span.embed(ids), ids, 0, cache, range(span.start, span.end))
    ids = torch.randint(0, 1000, (1, num_new), generator=torch.Generator().manual_seed(100 + seed))
    twin = copy.deepcopy(cache)
    return cache, BatchMember(span.embed(ids), ids, length, twin, None, cancelled)


def test_a_batched_pass_gives_each_member_what_it_gets_alone(v4_spans, monkeypatch):
    """One packed pass over members at different offsets (sliding window, CSA and HCA windows):
    each member's activations and its whole cache state (window, compressor buffers, overlap
    slices, compressed entries, raw history) equal what its run alone gives, up to the rounding of
    rows computed together; the pass never falls back to one member at a time."""
    (span,) = v4_spans([(0, 6)])
    alone, members = [], []
    for i, (length, num_new) in enumerate(BATCH_MEMBERS):
        cache, member = _v4_member(span, length, num_new, seed=i)
        alone.append((span.forward(member.hidden, member.token_ids, length, cache, range(0, 6)), cache))
        members.append(member)
    monkeypatch.setattr(span, "forward", lambda *a, **k: pytest.fail("a member computed alone"))
    outputs = span.forward_batch(members, range(0, 6))
    for (expected, cache), got, member in zip(alone, outputs, members):
        torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)
        _assert_same_state(_mtp_cache_state(member.cache), _mtp_cache_state(cache))


def test_a_member_cancelled_mid_pass_leaves_and_the_others_are_exact(v4_spans):
    (span,) = v4_spans([(0, 6)])
    blocks_seen, alone, members = [], [], []
    for i, (length, num_new) in enumerate(BATCH_MEMBERS[:4]):
        cancelled = (lambda: len(blocks_seen) > 2) if i == 1 else (lambda: False)
        cache, member = _v4_member(span, length, num_new, seed=20 + i, cancelled=cancelled)
        alone.append(span.forward(member.hidden, member.token_ids, length, cache, range(0, 6)))
        members.append(member)
    outputs = span.forward_batch(members, range(0, 6), lambda: blocks_seen.append(1))
    assert outputs[1] is None
    for i in (0, 2, 3):
        torch.testing.assert_close(outputs[i], alone[i], rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize(
    "kind,quant",
    [("csa", "none"), ("hca", "none"), ("sliding", "none"), ("csa", "nf4"), ("csa", "int8")],
    ids=["csa", "hca", "sliding", "csa-nf4", "csa-int8"],
)
def test_mtp_drafter_cache_rolls_back_exactly(v4_mtp_paths, v4_spans, kind, quant):
    """Runs with rejected drafts, rollbacks into a compression window and past the sliding window,
    and a different token where a run ended: after each, the MTP head's cache equals that of a
    fresh head over the committed text in one pass, and so do its drafts."""
    from server.adapters.deepseek_v4_mtp import MTPDrafter, build_mtp_drafter
    from server.adapters.deepseek_v4_quant import QuantizedExperts
    from server.quantization import Quant, is_quantized_param

    path = v4_mtp_paths(kind)
    config = AutoConfig.from_pretrained(path)
    if quant == "none":
        (span,) = v4_spans([(0, 6)])  # the main weights are the tiny V4's own
    else:
        span = load_span(config, Checkpoint(str(path)), 0, 6, torch.float32, "cpu", Quant(quant))
    drafter = build_mtp_drafter(span, config, Checkpoint(str(path)), "auto", max_drafts=4)
    assert isinstance(drafter, MTPDrafter) and drafter.mtp.attention_type == MTP_KINDS[kind]
    if quant != "none":  # the MTP block is quantized as the span's blocks are
        assert is_quantized_param(drafter.mtp.layer.self_attn.q_a_proj.weight)
        assert isinstance(drafter.mtp.layer.mlp.experts, QuantizedExperts)
    text = (PROMPT[0] * 4)[:40]

    def run(cache, state, ids: list[int], start_pos: int, committed: int, next_token: int) -> list[int]:
        span.trim_cache(cache, start_pos)
        hidden = span.forward(span.embed(torch.tensor([ids])), torch.tensor([ids]), start_pos, cache, range(6))
        drafts = drafter.draft(state, hidden, ids, start_pos, committed, next_token, 4)
        span.trim_cache(cache, start_pos + committed)
        return drafts

    cache, state, history = span.new_cache(), drafter.new_session(), []
    # (start_pos, token ids, ids of them committed after the verdict, next token)
    runs = [
        (0, text[:8], 8, text[8]),
        (8, text[8:12], 2, 999),
        (10, [999, 5, 6], 1, 42),
        (11, [42, 7], 2, 43),
        (5, text[5:9], 4, 1234),
        (9, [77, 78, 79, 80], 4, 81),
        (13, [81] + text[14:29], 16, text[29]),
        (21, [5, 6, 7, 8, 9], 3, 77),
        (24, [77, 1, 2, 3], 2, 300),
        (26, [300, 9, 9], 3, 4),
    ]
    for start_pos, ids, committed, next_token in runs:
        drafts = run(cache, state, ids, start_pos, committed, next_token)
        history = history[:start_pos] + ids[:committed]
        fresh = drafter.new_session()
        assert drafts == run(span.new_cache(), fresh, history, 0, len(history), next_token), (start_pos, ids)
        assert state.base == 0 and state.end == len(history) and len(drafts) >= 1
        _assert_same_state(_mtp_cache_state(state.cache), _mtp_cache_state(fresh.cache))


def test_mtp_loads_from_the_hub_layout_dequantized(v4_mtp_paths, tmp_path):
    """``mtp.0.*`` in DeepSeek's layout (FP8 attention and shared-expert linears, FP4 routed experts,
    ``.scale`` companions) loads dequantized by the span's own routine; everything else as stored."""
    from server.adapters.deepseek_v4_mtp import load_mtp
    from server.adapters.deepseek_v4_weights import map_mtp

    path = v4_mtp_paths("csa")
    expected = quantize_like_deepseek(path, tmp_path / "quantized")
    config = AutoConfig.from_pretrained(path)
    plain = load_mtp(config, Checkpoint(str(path)), torch.float32, "cpu").state_dict()
    checkpoint = Checkpoint(str(tmp_path / "quantized"))
    loaded = load_mtp(config, checkpoint, torch.float32, "cpu").state_dict()
    sources = map_mtp(checkpoint.weight_map(), set(loaded), 0, config.num_hidden_layers)
    quantized = 0
    for name, tensor in loaded.items():
        keys = [weight for weight, _ in sources[name].parts]
        if keys[0] not in expected:
            assert torch.equal(tensor, plain[name]), name
        elif sources[name].kind == "plain":
            assert torch.equal(tensor, expected[keys[0]]), name
        else:  # fused experts: gate_up = every expert's w1, then every expert's w3
            assert name.endswith(("gate_up_proj", "down_proj"))
            if name.endswith("down_proj"):
                assert torch.equal(tensor, torch.stack([expected[k] for k in keys])), name
            else:
                half = len(keys) // 2
                both = [torch.cat([expected[keys[e]], expected[keys[half + e]]]) for e in range(half)]
                assert torch.equal(tensor, torch.stack(both)), name
        quantized += keys[0] in expected
    assert quantized >= 6  # wq_a, wq_b, wkv, wo_b, shared experts, routed experts


def test_drafter_choice_on_deepseek_v4(v4_path, v4_mtp_paths, v4_spans):
    """--drafter auto: the MTP module where the checkpoint has one, nothing where it has none;
    --drafter none: nothing; a head file: refused (V4 has its own)."""
    from types import SimpleNamespace

    from server.adapters.deepseek_v4_mtp import MTPDrafter
    from server.drafter_attach import attach_drafter

    (tail,) = v4_spans([(2, 6)])
    options = SimpleNamespace(drafter="auto", drafter_tokens=4)
    attach_drafter(tail, options, AutoConfig.from_pretrained(v4_path), Checkpoint(str(v4_path)))
    assert tail.drafter is None
    mtp_path = v4_mtp_paths("csa")
    attach_drafter(tail, options, AutoConfig.from_pretrained(mtp_path), Checkpoint(str(mtp_path)))
    assert isinstance(tail.drafter, MTPDrafter) and tail.drafter.max_drafts == 4
    assert tail.drafter.embed_weight.shape == (tail.vocab_size, tail.config.hidden_size)  # a tail reads them
    options.drafter = "none"
    attach_drafter(tail, options, AutoConfig.from_pretrained(mtp_path), Checkpoint(str(mtp_path)))
    assert tail.drafter is None
    options.drafter = str(mtp_path / "model.safetensors")
    with pytest.raises(ValueError, match="its checkpoint's own MTP module"):
        attach_drafter(tail, options, AutoConfig.from_pretrained(mtp_path), Checkpoint(str(mtp_path)))
    assert tail.drafter is None


@pytest.fixture(scope="module")
def v4_mtp_model(request, v4_mtp_paths, artifacts_dir):
    """Two servers of the tiny V4 with an MTP module (0:2, 2:6); the tail drafts up to 4 ids with it."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.local import LocalSwarm

    path = v4_mtp_paths("csa")
    swarm = LocalSwarm(
        str(path),
        spans=[(0, 2), (2, 6)],
        server_args=[*SERVER_ARGS, "--drafter-tokens", "4"],
        log_dir=str(artifacts_dir / "v4-mtp-swarm"),
        names=["V4-MTP-head", "V4-MTP-tail"],
    )
    with swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
        with last_use.until_last_use(request, lambda: (model.shutdown(), swarm.stop())):
            yield model


@pytest.fixture(scope="module")
def v4_mtp_plain(v4_mtp_model, v4_reference):
    """Outputs without speculation, once per sampling mode, checked against transformers."""
    outputs = {}

    def get(sampling: bool) -> list:
        if sampling not in outputs:
            kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1234) if sampling else {}
            plain = v4_mtp_model.generate(torch.tensor(PROMPT), max_new_tokens=24, speculation=None, **kwargs)
            if sampling:
                assert plain[0, len(PROMPT[0]) :].tolist() == reference_sample(v4_reference, PROMPT[0], 24, SAMPLED)
            else:  # transformers ignores mtp.* and computes the main model only
                expected = v4_reference.generate(torch.tensor(PROMPT), max_new_tokens=24, do_sample=False)
                assert plain.tolist() == expected.tolist()
            outputs[sampling] = plain.tolist()
        return outputs[sampling]

    return get


@pytest.mark.parametrize(
    "speculation,mode", [("tail", "sync"), ("suffix+tail", "sync"), ("tail", "async"), ("tail", "looped")]
)
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_mtp_tail_drafts_leave_the_output_unchanged(v4_mtp_model, v4_mtp_plain, speculation, mode, sampling):
    """The tail's MTP drafts reach the client every lap, ride in the next runs, are verified, and
    the output is that of no speculation (and of transformers)."""
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=1234) if sampling else {}
    kwargs.update(draft_lap_costs=(1.0, 0.0))  # the cost model cuts no draft: the random MTP's ids ride every lap
    if mode == "async":  # runs sent behind unverified ones: cancels, and MTP caches meeting gaps
        kwargs.update(async_speculation=True, max_inflight_runs=3, num_draft_tokens=4)
    plain = v4_mtp_plain(sampling)
    output = v4_mtp_model.generate(
        torch.tensor(PROMPT), max_new_tokens=24, speculation=speculation, loop_runs=mode == "looped", **kwargs
    )
    assert output.tolist() == plain
    stats = v4_mtp_model.last_generation_stats
    if mode == "looped":  # the tail's MTP ids ride in the runs it starts at the head
        assert stats.runs_sent == 1 and stats.looped_runs >= stats.laps - 1 and stats.drafted >= stats.laps
        return
    proposals, proposed, _ = stats.drafter_sources["tail"]
    assert proposals >= 5 and proposed >= 3 * proposals  # 4 ids per verdict, fewer only after an EOS
    assert stats.drafter_choices["tail"] >= 5 and stats.drafted > 0  # sent in runs, so verified by the tail
    if mode == "async":  # runs behind refuted ones were sent (the tail drafted after them too) and cancelled
        assert stats.runs_sent > stats.laps and stats.runs_cancelled > 0
