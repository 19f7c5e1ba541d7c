"""EAGLE-3 heads in their published layout as the tail's drafter (server/eagle3_drafter.py): the
tail taps the features vLLM counts, drafts map to target ids through d2t, the drafter's cache rolls
back exactly, the output through CLI servers equals transformers', and heads for another model or
malformed folders are refused at start naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import SamplingParams
from swarm import warm_start
from tests.kit.eagle3_heads import draft_vocab_ids, write_head
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.swarms import tail_drafter_swarm

TEXT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 657, 506, 88, 901, 77, 5, 4102, 33, 250, 61, 7000]


@pytest.fixture(scope="session")
def tiny_config(tiny_llama_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="session")
def eagle3_head(tiny_config, tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle3") / "tiny-eagle3", tiny_config)


def _tail(tiny_llama_path, head, start: int = 0, drafter_tokens: int = 4):
    from transformers import AutoConfig

    from server.adapters import load_span
    from server.drafter_attach import attach_drafter
    from server.server_config import ServerConfig
    from server.weights import Checkpoint

    config, checkpoint = AutoConfig.from_pretrained(tiny_llama_path), Checkpoint(str(tiny_llama_path))
    span = load_span(config, checkpoint, start, config.num_hidden_layers, torch.float32, "cpu")
    server_config = ServerConfig(model=str(tiny_llama_path), drafter=str(head), drafter_tokens=drafter_tokens)
    attach_drafter(span, server_config, config, checkpoint)
    return span


def _run(span, cache, ids: list[int], start_pos: int, hidden_in=None) -> torch.Tensor:
    """The span over ids at start_pos; the tapped features of those positions."""
    x = span.embed(torch.tensor([ids])) if hidden_in is None else hidden_in
    span.forward(x, torch.tensor([ids]), start_pos, cache, range(span.start, span.end))
    return span.taps.take(cache, start_pos, len(ids))


@pytest.mark.parametrize("start", [0, 3])
def test_taps_are_the_hidden_states_vllm_counts(tiny_llama_path, tiny_reference, eagle3_head, start):
    """Boundary j is transformers' hidden_states[j] (the input of block j); a tail of blocks 3:6 stands
    in for boundary 2, which it does not hold, with its own input, hidden_states[3]."""
    span = _tail(tiny_llama_path, eagle3_head, start)
    assert span.taps.boundaries == (2, 3, 3)  # vLLM's default for 6 layers: (2, L // 2, L - 3)
    states = tiny_reference(torch.tensor([TEXT]), output_hidden_states=True).hidden_states
    features = _run(span, span.new_cache(), TEXT, 0, None if start == 0 else states[start])
    expected = torch.cat([states[max(j, start)] for j in (2, 3, 3)], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)  # float32, same blocks in a pass


def test_a_packed_batch_taps_each_members_features(tiny_llama_path, eagle3_head):
    """Two sessions through the tail in one packed pass keep the features each keeps alone (up to the
    rounding of rows computed together, float32), and a cancelled member keeps none."""
    from server.adapters.base import BatchMember

    span = _tail(tiny_llama_path, eagle3_head)
    blocks = range(span.start, span.end)
    alone = [_run(span, span.new_cache(), ids, 0) for ids in (TEXT[:7], TEXT[7:])]
    members = [
        BatchMember(span.embed(torch.tensor([ids])), torch.tensor([ids]), 0, span.new_cache())
        for ids in (TEXT[:7], TEXT[7:], TEXT[3:9])
    ]
    members[2].cancelled = lambda: True
    outputs = span.forward_batch(members, blocks)
    assert outputs[2] is None and span.taps.take(members[2].cache, 0, 6) is None
    for member, expected in zip(members[:2], alone):
        torch.testing.assert_close(span.taps.take(member.cache, 0, expected.shape[1]), expected, rtol=1e-4, atol=1e-5)


def test_a_deep_prompt_prefill_taps_the_features_of_its_prompted_pass(tiny_llama_path, tiny_reference, eagle3_head):
    """A deep-prompt session's prefill runs block by block (server/deep_prompts.py); the tail still taps
    transformers' hidden_states of the prompted model (boundary j: block j - 1's output, before block j
    adds its prompts), so that run drafts like any other."""
    from types import SimpleNamespace

    from server.adapters.base import BatchMember
    from server.deep_prompts import forward_member
    from tests.training.test_deep_ptune import deep_hooks

    span = _tail(tiny_llama_path, eagle3_head)
    prompts = 0.5 * torch.randn(
        span.end, 4, tiny_reference.config.hidden_size, generator=torch.Generator().manual_seed(2)
    )
    session = SimpleNamespace(deep_prompts=prompts, hop=SimpleNamespace(start=0))
    member = BatchMember(span.embed(torch.tensor([TEXT])), torch.tensor([TEXT]), 0, span.new_cache())
    out = forward_member(span, session, member, range(span.start, span.end))
    with deep_hooks(tiny_reference, prompts):
        reference = tiny_reference(torch.tensor([TEXT]), output_hidden_states=True)
    states = reference.hidden_states
    torch.testing.assert_close(span.logits(out), reference.logits[0], rtol=1e-4, atol=1e-4)  # the prompted model
    features = span.taps.take(member.cache, 0, len(TEXT))
    expected = torch.cat([states[j] for j in (2, 3, 3)], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)


def test_drafts_are_target_ids_through_d2t(tiny_llama_path, eagle3_head, tiny_config):
    """Every draft is a target id of the head's draft vocabulary (draft id + d2t), and the drafts of a
    run equal the head's argmax over the whole committed text in one uncached pass."""
    from server.adapters.llama import _causal_mask

    span = _tail(tiny_llama_path, eagle3_head)
    drafter = span.drafter
    features = _run(span, span.new_cache(), TEXT, 0)
    drafts = drafter.draft(drafter.new_session(), features, TEXT, 0, len(TEXT), 42, 4)
    allowed = set(draft_vocab_ids(tiny_config.vocab_size).tolist())
    assert len(drafts) == 4 and set(drafts) <= allowed
    with torch.no_grad():  # the first draft, from one pass of the head over the text
        net = drafter.net
        embeds = drafter.embed_weight[torch.tensor(TEXT[1:] + [42])].unsqueeze(0)
        positions = torch.arange(len(TEXT)).unsqueeze(0)
        out = net(net.fc(features), embeds, positions, None, _causal_mask(0, len(TEXT), features.device))
        index = int(torch.argmax(net.lm_head(net.norm(out[0, -1]))))
    assert drafts[0] == index + int(drafter.d2t[index])


def _published_formula(
    weights: dict, features: torch.Tensor, embeds: torch.Tensor, heads: int, kv_heads: int, norm_first: bool = False
):
    """EAGLE-3's head over one sequence from the raw published tensors, written out as vLLM's
    llama_eagle3.py computes it (fc; [input_layernorm(embeds), hidden_norm(h)] into attention with the
    feature as residual; post_attention_layernorm, MLP; the pre-norm output), with Llama's rotary
    embedding (theta 10000): an oracle independent of the transformers modules the drafter uses.
    ``norm_first``: speculators' norm_before_residual (the residual is the feature after hidden_norm)."""

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    n, w = features.shape[0], weights
    h = features @ w["fc.weight"].T  # [n, H]
    normed = rms(h, w["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), normed], -1)
    dim = h.shape[-1] // heads
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, dim).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)
    freqs = torch.arange(n)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = (q @ k.transpose(1, 2)) / dim**0.5 + torch.full((n, n), float("-inf")).triu(1)
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ w["midlayer.self_attn.o_proj.weight"].T
    h = (normed if norm_first else h) + attended
    m = rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    pre = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return pre, rms(pre, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("speculators", [False, True], ids=["eagle", "speculators"])
def test_the_head_computes_the_published_formula(tiny_llama_path, tiny_config, tmp_path, speculators):
    """The drafter's head (transformers' layer, q/k/v widened) over the tapped features equals the
    formula written out from the raw tensors, and its first draft is that formula's argmax through d2t;
    for EAGLE's layout and for speculators' (its config nested, ``layers.0``, norm_before_residual)."""
    from safetensors.torch import load_file

    head = write_head(tmp_path / "tiny-llama" / "head", tiny_config, speculators=speculators)
    weights = {n.replace("layers.0.", "midlayer."): t for n, t in load_file(str(head / "model.safetensors")).items()}
    span = _tail(tiny_llama_path, head)
    drafter = span.drafter
    assert drafter.net.norm_before_residual == speculators
    features = _run(span, span.new_cache(), TEXT, 0)
    after = TEXT[1:] + [42]
    embeds = drafter.embed_weight[torch.tensor(after)]
    pre, logits = _published_formula(weights, features[0], embeds, heads=4, kv_heads=2, norm_first=speculators)
    with torch.no_grad():
        mask = torch.ones(len(TEXT), len(TEXT), dtype=torch.bool).tril()[None, None]
        out = drafter.net(drafter.net.fc(features), embeds[None], torch.arange(len(TEXT))[None], None, mask)
    torch.testing.assert_close(out[0], pre, rtol=1e-4, atol=1e-4)  # float32, same sums in another order
    index = int(logits[-1].argmax())
    drafts = drafter.draft(drafter.new_session(), features, TEXT, 0, len(TEXT), 42, 1)
    assert drafts == [index + int(weights["d2t"][index])]


def test_eagle3_cache_rolls_back_exactly(tiny_llama_path, eagle3_head):
    """Drafts after runs with rejected drafts and rollbacks equal a fresh head's over the same
    committed text in one pass: the head's cache keeps exactly the committed positions."""
    span = _tail(tiny_llama_path, eagle3_head)
    drafter = span.drafter

    def fresh_drafts(committed: list[int], next_token: int) -> list[int]:
        features = _run(span, span.new_cache(), committed, 0)
        return drafter.draft(drafter.new_session(), features, committed, 0, len(committed), next_token, 4)

    cache, state = span.new_cache(), drafter.new_session()
    runs = [(0, TEXT[:8], 8, TEXT[8]), (8, TEXT[8:12], 2, 999), (10, [999, 5, 6], 1, 42), (5, TEXT[5:9], 4, 1234)]
    history: list[int] = []
    for start_pos, ids, committed, next_token in runs:
        span.trim_cache(cache, start_pos)
        drafts = drafter.draft(state, _run(span, cache, ids, start_pos), ids, start_pos, committed, next_token, 4)
        history = history[:start_pos] + ids[:committed]
        span.trim_cache(cache, start_pos + committed)
        assert drafts == fresh_drafts(history, next_token), (start_pos, ids)


def test_the_memory_plan_counts_the_head_and_the_embeddings_it_reads(tiny_llama_path, tiny_config, eagle3_head):
    """What drafter_bytes keeps room for is what the loaded drafter holds: the head's tensors, d2t and
    (the tiny model does not tie them) the target's embeddings, read at the tail; within the rotary
    embedding's few frequencies."""
    from server.drafter_attach import drafter_bytes
    from server.quantization import Quant, resident_bytes
    from server.server_config import ServerConfig
    from server.weights import Checkpoint

    drafter = _tail(tiny_llama_path, eagle3_head).drafter
    loaded = resident_bytes(drafter.net) + drafter.embed_weight.numel() * 4 + drafter.d2t.numel() * 8
    config = ServerConfig(model=str(tiny_llama_path), drafter=str(eagle3_head))
    planned = drafter_bytes(config, tiny_config, Checkpoint(str(tiny_llama_path)), torch.float32, Quant.NONE)
    assert drafter.embed_weight.shape == (tiny_config.vocab_size, tiny_config.hidden_size)
    assert 0 <= loaded - planned <= 4 * tiny_config.hidden_size  # the rotary frequencies are computed, not stored


def _refusal(tiny_llama_path, head) -> str:
    """What a server started with ``--drafter head`` says; it must refuse to start, without a traceback."""
    args = ["--model", str(tiny_llama_path), "--new-swarm", "--host", "127.0.0.1", "--drafter", str(head)]
    result = warm_start.run("swarm.server", args, timeout=180)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_a_head_for_another_model_is_refused_at_start(tiny_llama_path, tiny_config, tmp_path):
    other = write_head(
        tmp_path / "llama-8b-head",
        tiny_config,
        hidden_size=96,
        target_hidden_size=4096,
        vocab_size=128256,
        target_model="meta-llama/Llama-3.1-8B-Instruct",
    )
    stderr = _refusal(tiny_llama_path, other)
    lines = [line for line in stderr.splitlines() if "was trained for another model" in line]
    assert len(lines) == 1, stderr
    for named in ("meta-llama/Llama-3.1-8B-Instruct", "hidden size 4096", "vocabulary 128256", "hidden size 64"):
        assert named in lines[0], lines[0]
    assert str(tiny_llama_path) in lines[0] and f"vocabulary {tiny_config.vocab_size}" in lines[0]


def test_a_head_naming_another_target_is_refused(tiny_llama_path, tiny_config, tmp_path):
    """Same sizes, but the config names another target model."""
    from server.drafter_attach import eagle3_checkpoint
    from server.server_config import ServerConfig

    named = write_head(tmp_path / "named", tiny_config, target_model="HuggingFaceTB/SmolLM2-360M")
    with pytest.raises(ValueError, match="trained for another model: HuggingFaceTB/SmolLM2-360M"):
        eagle3_checkpoint(ServerConfig(model=str(tiny_llama_path), drafter=str(named)), tiny_config)
    ours = write_head(tmp_path / "ours", tiny_config, target_model="someone/tiny-llama")
    assert eagle3_checkpoint(ServerConfig(model=str(tiny_llama_path), drafter=str(ours)), tiny_config) is not None
    verifier = write_head(tmp_path / "Llama-3.1-8B-Instruct" / "head", tiny_config, speculators=True)
    with pytest.raises(ValueError, match="trained for another model: Llama-3.1-8B-Instruct"):  # speculators' verifier
        eagle3_checkpoint(ServerConfig(model=str(tiny_llama_path), drafter=str(verifier)), tiny_config)


@pytest.mark.parametrize(
    "malformed, says",
    [
        ({"drop": ("d2t",)}, "no d2t, which a draft vocabulary of 300 ids"),
        ({"replace": {"fc.weight": torch.zeros(64, 128)}}, "fc.weight has shape [64, 128], the config needs [64, 192]"),
        ({"drop": ("midlayer.hidden_norm.weight",)}, "missing midlayer.hidden_norm.weight"),
        ({"replace": {"t2d": torch.ones(5, dtype=torch.bool)}}, "t2d has shape [5]"),
        ({"replace": {"d2t": torch.full((300,), 10**6)}}, "d2t maps draft ids outside the target vocabulary"),
    ],
)
def test_a_malformed_head_is_refused_naming_what_is_wrong(tiny_llama_path, tiny_config, tmp_path, malformed, says):
    """Each through the server's start path: the memory plan (drafter_bytes) reads the config and maps,
    the tail's attach_drafter the weights."""
    from server.drafter_attach import drafter_bytes
    from server.quantization import Quant
    from server.server_config import ServerConfig
    from server.weights import Checkpoint

    head = write_head(tmp_path / "bad", tiny_config, **malformed)
    with pytest.raises(ValueError, match="EAGLE-3 drafter") as refused:
        config = ServerConfig(model=str(tiny_llama_path), drafter=str(head))
        drafter_bytes(config, tiny_config, Checkpoint(str(tiny_llama_path)), torch.float32, Quant.NONE)
        _tail(tiny_llama_path, head)
    assert says in str(refused.value)


def test_a_malformed_head_is_refused_by_the_server(tiny_llama_path, tiny_config, tmp_path):
    head = write_head(tmp_path / "bad", tiny_config, replace={"fc.weight": torch.zeros(64, 128)})
    stderr = _refusal(tiny_llama_path, head)
    assert "fc.weight has shape [64, 128], the config needs [64, 192]" in stderr, stderr


@pytest.fixture(scope="session")
def eagle3_model(request, tiny_llama_path, eagle3_head, artifacts_dir):
    """Two servers of the tiny model (0:3, 3:6); the tail drafts with the tiny EAGLE-3 head."""
    yield from tail_drafter_swarm(request, tiny_llama_path, eagle3_head, artifacts_dir / "eagle3-swarm")


def test_eagle3_drafts_leave_greedy_output_unchanged(eagle3_model, tiny_reference):
    expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=24, do_sample=False)
    eagle3_model.reset_draft_store()
    output = eagle3_model.generate(torch.tensor(PROMPT), max_new_tokens=24, speculation="tail", loop_runs=False)
    assert output.tolist() == expected.tolist()
    proposals, proposed, _ = eagle3_model.last_generation_stats.drafter_sources["tail"]
    assert proposals >= 20 and proposed >= 3 * proposals  # the head's drafts reached the client every lap
    started = eagle3_model.generate(torch.tensor(PROMPT), max_new_tokens=24, speculation="tail")
    assert started.tolist() == expected.tolist()  # the default: drafts in runs the tail starts


def test_eagle3_drafts_leave_seeded_sampling_unchanged(eagle3_model, tiny_reference):
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    expected = reference_sample(tiny_reference, PROMPT[0], 20, params)
    output = eagle3_model.generate(
        torch.tensor(PROMPT),
        max_new_tokens=20,
        do_sample=True,
        temperature=0.8,
        top_p=0.9,
        seed=1234,
        speculation="tail",
        loop_runs=False,
    )
    assert output[0, len(PROMPT[0]) :].tolist() == expected
    assert eagle3_model.last_generation_stats.drafter_sources["tail"][0] >= 15


def test_concurrent_sessions_batch_at_an_eagle3_tail(tiny_llama_path, tiny_reference, eagle3_head):
    """Six sessions at once (a padded batch) through in-process servers whose tail drafts with the
    head: every row equals transformers' greedy output, the tail batched runs together (packed, the
    features tapped per member) and its drafter drafted."""
    from tests.kit.swarms import start_inprocess

    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(10, 2000, (4 + i,), generator=generator).tolist() for i in range(6)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    expected = []
    with torch.no_grad():
        for row in rows:
            out = tiny_reference.generate(torch.tensor([row]), max_new_tokens=10, do_sample=False)
            expected.append(out[0, len(row) :].tolist())
    swarm = start_inprocess(tiny_llama_path, drafter=str(eagle3_head), drafter_tokens=4)
    try:
        tail = swarm.servers[-1]
        assert type(tail.span.drafter).__name__ == "Eagle3Drafter" and tail.span.taps is not None
        output = swarm.model.generate(ids, attention_mask=mask, max_new_tokens=10, speculation="tail")
        assert [output[i, width : width + 10].tolist() for i in range(6)] == expected
        stats = tail.handler.batches.stats
        assert stats["batched_runs"] > stats["batches"]  # runs rode in a batch beside another
        assert tail.span.drafter.stats["drafts"] > 0
    finally:
        swarm.stop()
