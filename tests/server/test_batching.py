"""Continuous batching (server/batching.py): the runs of many sessions go through a server's span
together, and each session still gets exactly what it gets alone (float32, tiny random Llama).

Three levels: the adapter's batched pass against its one-session pass (activations and caches);
the scheduler driving 16 sessions of real ServerSessions over a whole-model span (head and tail in
one), with chunked prefills and a cancellation; and 16 concurrent client sessions through two
in-process servers on 127.0.0.1, against local transformers and against each session alone.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoConfig

from protocol.messages import GREEDY, Hop, SamplingParams, Step
from server.adapters import SpanCancelled, load_span
from server.adapters.base import BatchMember
from server.batching import BatchScheduler
from server.quantization import Quant
from server.session import QueuedRun, ServerSession
from server.weights import Checkpoint
from tests.kit.batch_rows import MEMBERS, alone_and_together, filled_cache, greedy_truth, padded, prompts, span_blocks
from tests.kit.reference import reference_sample
from tests.kit.swarms import inprocess_servers
from tests.kit.threads import single_torch_thread

pytestmark = pytest.mark.timeout(600)

SESSIONS = 16


def _whole_span(path, quant: Quant = Quant.NONE):
    config = AutoConfig.from_pretrained(path)
    return load_span(config, Checkpoint(str(path)), 0, config.num_hidden_layers, torch.float32, "cpu", quant)


@pytest.fixture(scope="module")
def whole_span(tiny_llama_path):
    return _whole_span(tiny_llama_path)


# ---- the adapter's batched pass -----------------------------------------------------------------


@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_a_batched_pass_gives_each_member_its_own_activations_and_cache(tiny_llama_path, whole_span, quant):
    """Quantized spans batch too: their linears take the packed row like any other."""
    if quant != "none":
        whole_span = _whole_span(tiny_llama_path, Quant(quant))
    alone, members, outputs = alone_and_together(whole_span, seed=100)
    _assert_each_member_got_its_own(whole_span, alone, outputs, members)


def _assert_each_member_got_its_own(span, alone, outputs, members):
    for (expected, cache), got, member in zip(alone, outputs, members):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # rounding of rows computed together
        assert span.cache_length(member.cache) == span.cache_length(cache)
        for mine, theirs in zip(member.cache.layers, cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-4)


# DeepSeek-V4 runs chains only (no token trees): decode steps, a prefill past the sliding window of
# 8 and across compression windows, drafts
V4_MEMBERS = [(5, 1, None), (0, 11, None), (3, 4, None), (9, 3, None), (14, 1, None)]


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_a_quantized_deepseek_v4_pass_gives_each_member_its_own_activations_and_cache(tiny_v4_path, quant):
    """The packed V4 pass (server/adapters/deepseek_v4_batch.py) over bitsandbytes-quantized experts
    and projections: each member gets what the same quantized span gives it alone, caches included
    (the compressor's and indexer's state is part of what the next lap reads)."""
    span = _whole_span(tiny_v4_path, Quant(quant))
    assert any(isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) for m in span.layers.modules())
    alone, members, outputs = alone_and_together(span, seed=300, members_spec=V4_MEMBERS)
    _assert_each_member_got_its_own(span, alone, outputs, members)
    for member, (_, cache) in zip(members, alone):  # the next lap reads the whole cache state
        torch.testing.assert_close(_cache_tensors(member.cache), _cache_tensors(cache), rtol=1e-4, atol=1e-4)


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache object holds, in a fixed order (V4's layers keep compressor and indexer
    state beside keys and values)."""
    found = []
    for layer in cache.layers:
        for name in sorted(vars(layer)):
            value = getattr(layer, name)
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def test_a_member_cancelled_between_blocks_leaves_without_disturbing_the_others(whole_span):
    blocks_seen = []
    members, alone = [], []
    with single_torch_thread():
        for i, (length, num_new, tree) in enumerate(MEMBERS[:4]):
            cache = filled_cache(whole_span, length, seed=i)
            twin = copy.deepcopy(cache)
            ids = torch.randint(0, 1000, (1, num_new), generator=torch.Generator().manual_seed(200 + i))
            hidden = whole_span.embed(ids)
            extra = {"tree": tree} if tree else {}
            alone.append(whole_span.forward(hidden, ids, length, cache, span_blocks(whole_span), **extra))
            cancelled = (lambda: len(blocks_seen) > 2) if i == 1 else (lambda: False)
            members.append(BatchMember(hidden, ids, length, twin, tree, cancelled))
        outputs = whole_span.forward_batch(members, span_blocks(whole_span), lambda: blocks_seen.append(1))
    assert outputs[1] is None
    for i in (0, 2, 3):
        torch.testing.assert_close(outputs[i], alone[i], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """A tiny random Qwen2 whose layers 2-5 have a sliding window of 6 (layers 0-1 full attention,
    as Qwen2's ``max_window_layers`` makes them), its whole-model span and local transformers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("sliding") / "qwen2"
    model.save_pretrained(path)
    return _whole_span(path), Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_sliding_window_spans_batch_a_pass_like_full_attention(sliding):
    """Sliding-window layers (Qwen2) pack like full attention: each member's activations and cache
    equal its pass alone, with members past the window, a prefill longer than it and a tree."""
    span, _ = sliding
    assert span.windows == [None, None, 6, 6, 6, 6] and span.supports_trees
    alone, members, outputs = alone_and_together(span, seed=300)
    for (expected, cache), got, member in zip(alone, outputs, members):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for mine, theirs in zip(member.cache.layers, cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)


def test_sliding_window_sessions_through_the_scheduler_equal_transformers(sliding):
    """Sessions whose prompts and drafts run past the sliding window, computed together: each
    equals local transformers (its own sliding-window cache and mask), chunked prefills included."""
    span, reference = sliding
    rows = [row * 2 for row in prompts(6, seed=4)]  # 6 to 36 ids: past the window of 6
    outputs, truths, scheduler = _through_scheduler(span, reference, rows, 8, cap=10)
    assert outputs == truths
    assert scheduler.stats["max_batch_runs"] >= 2 and scheduler.stats["chunks"] > 0


# ---- the scheduler over real sessions -------------------------------------------------------------


async def _decode(
    scheduler, span, session: ServerSession, prompt: list[int], tokens: int, drafts: list[int], sampling=GREEDY
) -> list[int]:
    """One session's decode through the scheduler (greedy, or seeded ``sampling``), one run at a
    time: each run carries the last token and, every other run, ``drafts`` (some right, some wrong)."""
    committed, run_id, start = list(prompt), 0, 0
    pending = list(prompt)
    while len(committed) - len(prompt) < tokens:
        run_id += 1
        guess = drafts[: 1 + run_id % 3] if run_id % 2 == 0 else []
        step = Step(
            session_id=session.session_id,
            run_id=run_id,
            start_pos=start,
            token_ids=pending + guess,
            n_draft=len(guess),
            sampling=sampling,
        )
        session.check_step(step, None, span)
        session.accept(step)
        result = await scheduler.compute(session, QueuedRun(step, None))
        start += len(pending) + result.accepted
        committed += guess[: result.accepted] + [result.next_token]
        pending = [result.next_token]
    return committed[len(prompt) : len(prompt) + tokens]


def _through_scheduler(span, reference, rows: list[list[int]], tokens: int, cap: int, sampling=GREEDY):
    """Decodes of ``rows`` at once through a scheduler over ``span`` (head and tail in one), greedy
    or seeded; returns (each session's tokens, transformers' tokens, the scheduler)."""
    if sampling.do_sample:
        with single_torch_thread():
            truths = [reference_sample(reference, row, tokens, sampling) for row in rows]
    else:
        truths = [greedy_truth(reference, row, tokens) for row in rows]

    async def main():
        executor = ThreadPoolExecutor(1)
        scheduler = BatchScheduler(span, executor, max_batch_positions=cap)
        scheduler.start()
        try:
            sessions = [
                ServerSession(f"s{i}", 128, [Hop("p", 0, span.end)], 0, span.new_cache()) for i in range(len(rows))
            ]
            outputs = await asyncio.gather(
                *(
                    _decode(scheduler, span, session, row, tokens, truth[1:4], sampling)
                    for session, row, truth in zip(sessions, rows, truths)
                )
            )
        finally:
            scheduler.stop()
            executor.shutdown()
        return outputs, scheduler

    with single_torch_thread():
        outputs, scheduler = asyncio.run(main())
    return outputs, truths, scheduler


def test_sixteen_sessions_through_the_scheduler_each_get_what_transformers_gives(whole_span, tiny_reference):
    """16 sessions at once over a span that is head and tail: greedy with drafts, prefills longer
    than the cap cut into chunks, and every session's tokens equal local transformers'."""
    outputs, truths, scheduler = _through_scheduler(whole_span, tiny_reference, prompts(SESSIONS), 10, cap=12)
    assert outputs == truths
    assert scheduler.stats["max_batch_runs"] >= 4  # sessions were computed together...
    assert scheduler.stats["chunks"] > 0  # ...and the longer prompts went in chunks
    assert max(positions for _, positions in scheduler.batch_sizes) <= 12


@pytest.fixture(scope="module")
def tiny_v4_path(tmp_path_factory):
    """A tiny random DeepSeek-V4 checkpoint (tests/server/test_deepseek_v4.py)."""
    from tests.kit.checkpoints import build_tiny_deepseek_v4

    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("v4") / "v4")


@pytest.fixture(scope="module")
def tiny_v4(tiny_v4_path):
    """The tiny DeepSeek-V4's whole-model span and transformers."""
    from transformers import DeepseekV4ForCausalLM

    return _whole_span(tiny_v4_path), DeepseekV4ForCausalLM.from_pretrained(tiny_v4_path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=11)], ids=["greedy", "seeded"]
)
def test_deepseek_v4_sessions_are_computed_together_and_equal_transformers(tiny_v4, sampling, monkeypatch):
    """DeepSeek-V4 sessions through the scheduler, packed into one pass per batch
    (server/adapters/deepseek_v4_batch.py): drafts right and wrong, chunked prefills past the
    sliding window and across compression windows; every session's tokens equal transformers'
    (greedy) or the reference sampler's (seeded), and batches of several members were computed
    together, not one member at a time."""
    from server.adapters import deepseek_v4_batch

    span, reference = tiny_v4
    packed_members, layer = [], deepseek_v4_batch.decoder_layer

    def counting(layer_module, hidden, token_ids, packed, rotary):
        packed_members.append(len(packed.members))
        return layer(layer_module, hidden, token_ids, packed, rotary)

    monkeypatch.setattr(deepseek_v4_batch, "decoder_layer", counting)
    rows = [row * 2 for row in prompts(4, seed=3)]  # 6 to 24 ids: past the sliding window of 8
    outputs, truths, scheduler = _through_scheduler(span, reference, rows, 6, cap=8, sampling=sampling)
    assert outputs == truths
    assert scheduler.stats["max_batch_runs"] >= 2 and scheduler.stats["chunks"] > 0
    assert max(packed_members) >= 2


def test_a_run_cancelled_while_waiting_leaves_and_its_session_goes_on(whole_span, tiny_reference):
    """A cancelled run (waiting in line, part way through its chunks) raises SpanCancelled for its
    session only, keeps none of its positions, and the session's next run is exact."""
    row = prompts(1, seed=9)[0] * 3
    truth = greedy_truth(tiny_reference, row, 2)

    async def main():
        executor = ThreadPoolExecutor(1)
        scheduler = BatchScheduler(whole_span, executor, max_batch_positions=4)
        scheduler.start()
        session = ServerSession("c", 128, [Hop("p", 0, whole_span.end)], 0, whole_span.new_cache())
        try:
            first = Step(session_id="c", run_id=1, start_pos=0, token_ids=row, sampling=GREEDY)
            session.check_step(first, None, whole_span)
            session.accept(first)
            run = QueuedRun(first, None)
            waiting = asyncio.ensure_future(scheduler.compute(session, run))
            while not scheduler.stats["chunks"]:  # the first chunk is through; the rest waits in line
                await asyncio.sleep(0.001)
            run.cancelled = True
            with pytest.raises(SpanCancelled):
                await waiting
            assert whole_span.cache_length(session.cache) == 0
            again = Step(session_id="c", run_id=2, start_pos=0, token_ids=row, sampling=GREEDY)
            session.check_step(again, None, whole_span)
            session.accept(again)
            return await scheduler.compute(session, QueuedRun(again, None))
        finally:
            scheduler.stop()
            executor.shutdown()

    with single_torch_thread():
        result = asyncio.run(main())
    assert result.next_token == truth[0]


def test_the_gather_window_waits_for_other_open_sessions_only(whole_span):
    """With a long gather window, a session alone is computed at once; with two open sessions the
    first run waits for the second, both go through one pass, and the pass starts as soon as the
    second arrives, not at the window's end."""
    window = 30.0  # seconds: far longer than the test could wait

    def step(session: ServerSession) -> QueuedRun:
        run = Step(session_id=session.session_id, run_id=1, start_pos=0, token_ids=[5, 6, 7], sampling=GREEDY)
        session.check_step(run, None, whole_span)
        session.accept(run)
        return QueuedRun(run, None)

    async def main():
        executor = ThreadPoolExecutor(1)
        sessions: dict[str, ServerSession] = {}
        scheduler = BatchScheduler(whole_span, executor, gather_window=window, open_sessions=lambda: len(sessions))
        scheduler.start()
        try:
            sessions["a"] = ServerSession("a", 64, [Hop("p", 0, whole_span.end)], 0, whole_span.new_cache())
            await asyncio.wait_for(scheduler.compute(sessions["a"], step(sessions["a"])), 20)  # alone: no wait
            assert scheduler.stats["batches"] == 1
            del sessions["a"]  # closed (an idle open session would hold a pass for the whole window)
            sessions["b"] = ServerSession("b", 64, [Hop("p", 0, whole_span.end)], 0, whole_span.new_cache())
            sessions["c"] = ServerSession("c", 64, [Hop("p", 0, whole_span.end)], 0, whole_span.new_cache())
            first = asyncio.ensure_future(scheduler.compute(sessions["b"], step(sessions["b"])))
            await asyncio.sleep(0.3)
            assert not first.done()  # waits for "c", whose session is open
            second = scheduler.compute(sessions["c"], step(sessions["c"]))
            await asyncio.wait_for(asyncio.gather(first, second), 20)  # started on arrival, not after 30 s
            assert scheduler.stats["batches"] == 2 and scheduler.stats["max_batch_runs"] == 2
        finally:
            scheduler.stop()
            executor.shutdown()

    with single_torch_thread():
        asyncio.run(main())


# ---- 16 client sessions through two servers ---------------------------------------------------------


@pytest.fixture(scope="module")
def batching_swarm(tiny_llama_path):
    yield from inprocess_servers(tiny_llama_path)


MODES = {
    "greedy, no speculation": dict(speculation=None),
    "greedy, suffix drafts": dict(speculation="suffix"),
    "seeded, suffix drafts": dict(speculation="suffix", do_sample=True, temperature=0.8, top_k=40, seed=7),
    "greedy, token trees": dict(speculation="suffix", draft_tree=True),
    "greedy, async speculation": dict(speculation="suffix", async_speculation=True),
}
ALONE_TOO = {"greedy, suffix drafts", "seeded, suffix drafts"}
TOKENS = 12


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_sixteen_concurrent_sessions_each_equal_transformers_and_themselves_alone(batching_swarm, tiny_reference, mode):
    model, servers = batching_swarm
    kwargs = MODES[mode]
    rows = prompts(SESSIONS, seed=len(mode))
    if kwargs.get("do_sample"):
        params = SamplingParams(do_sample=True, temperature=0.8, top_k=40, seed=7)
        with single_torch_thread():
            expected = [reference_sample(tiny_reference, row, TOKENS, params) for row in rows]
    else:
        expected = [greedy_truth(tiny_reference, row, TOKENS) for row in rows]
    before = [
        server.handler.batches.stats["batched_runs"] - server.handler.batches.stats["batches"] for server in servers
    ]
    ids, mask = padded(rows)
    output = model.generate(ids, attention_mask=mask, max_new_tokens=TOKENS, **kwargs)
    got = [output[i, ids.shape[1] : ids.shape[1] + TOKENS].tolist() for i in range(SESSIONS)]
    assert got == expected
    # runs that rode in a batch beside another run: batching happened at every server
    after = [
        server.handler.batches.stats["batched_runs"] - server.handler.batches.stats["batches"] for server in servers
    ]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    if mode in ALONE_TOO:
        for row, want in zip(rows, expected):
            alone = model.generate(torch.tensor([row]), max_new_tokens=TOKENS, **kwargs)
            assert alone[0, len(row) :].tolist() == want


def test_the_memory_plan_keeps_room_for_the_largest_batch(tiny_llama_path):
    """The default cap is what the headroom holds, within [64, 1024]; a --max-batch-positions above
    it grows the plan's reserve by exactly the activations beyond the headroom."""
    from server.memory import HEADROOM_FRACTION, activation_bytes_per_position, batch_positions_that_fit, plan_blocks

    config = AutoConfig.from_pretrained(tiny_llama_path)
    per_position = activation_bytes_per_position(config, torch.float32)
    free = 20 * 100 * per_position  # a headroom of 100 positions
    default = plan_blocks(config, torch.float32, "cpu", 6, free_bytes=free)
    small = plan_blocks(config, torch.float32, "cpu", 6, free_bytes=free, batch_positions=16)
    large = plan_blocks(config, torch.float32, "cpu", 6, free_bytes=free, batch_positions=1024)
    assert default.headroom_bytes == small.headroom_bytes == int(free * HEADROOM_FRACTION)
    assert large.headroom_bytes - small.headroom_bytes == 1024 * per_position - int(free * HEADROOM_FRACTION)
    assert batch_positions_that_fit(config, torch.float32, 1 << 40) == 1024
    assert batch_positions_that_fit(config, torch.float32, 1 << 20) == 64
    assert batch_positions_that_fit(config, torch.float32, 400 * 20 * per_position) == 400
