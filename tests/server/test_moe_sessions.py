"""Mixtures of experts under what the Llama family's tests hold sessions to, beyond
test_moe_families.py: concurrent sessions really computed in shared batched passes (the servers'
own counters, BatchScheduler.batch_sizes), ``verification="rejection"`` with a client draft model
(Mixtral, DeepSeek-V3), and a lossy activation codec between servers (Qwen3-MoE, Mixtral). In-process
servers are started once per family (and codec) and shared by the module's tests. Tiny random
checkpoints (tests/kit/checkpoints.py MOE_FAMILIES); exactness as the Llama tests define it for each mode.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.generation.test_rejection_sampling import seeded_rejection_runs
from tests.kit.batch_rows import greedy_truth, padded, prompts
from tests.kit.expert_calls import mlp_calls
from tests.kit.families import cli_swarm_model
from tests.kit.reference import PROMPT
from tests.kit.swarms import start_inprocess

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]
SPANS = [(0, 2), (2, 4)]


@pytest.fixture(scope="module")
def inprocess_swarms(family_paths):
    """model_type -> two in-process servers (SPANS) of its tiny checkpoint and a client, started on
    first use and shared by the module's tests (each server start costs seconds); stopped at its end."""
    started: dict = {}

    def get(model_type: str, **config):
        key = (model_type, tuple(sorted(config.items())))
        if key not in started:
            started[key] = start_inprocess(family_paths(model_type), spans=SPANS, **config)
        return started[key]

    yield get
    for swarm in started.values():
        swarm.stop()


# every family packs a pass's members' tokens through the experts together; mixtral's attention is packed too,
# deepseek_v3's (latent attention) and gpt_oss's (eager sinks) runs member by member
@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_eight_sessions_share_batched_passes_and_each_equals_itself_alone(inprocess_swarms, references, model_type):
    """Eight sessions in one generate call reach the servers together: every server computes some
    of its passes for several of them at once (its scheduler's own record of each pass), each
    block's experts once per pass over all of its members' positions (not once per member), and
    each session's tokens equal that session generated alone over the same servers, and transformers'."""
    reference, swarm = references(model_type), inprocess_swarms(model_type)
    rows = prompts(8, seed=3)
    ids, mask = padded(rows)
    before = [len(server.handler.batches.batch_sizes) for server in swarm.servers]
    with contextlib.ExitStack() as stack:
        calls = [stack.enter_context(mlp_calls(server.span)) for server in swarm.servers]
        output = swarm.model.generate(ids, attention_mask=mask, max_new_tokens=8, speculation=None)
    for server, first, server_calls in zip(swarm.servers, before, calls):
        passes = server.handler.batches.batch_sizes[first:]
        runs = [count for count, _ in passes]
        assert max(runs) >= 4, (model_type, server.span.start, passes)  # half the sessions in one pass at least
        assert sum(runs) > len(passes), (model_type, server.span.start, passes)
        # one call of each block's experts per pass, over every position of the pass
        assert all(layer == [positions for _, positions in passes] for layer in server_calls), (passes, server_calls)
    together = [output[i, ids.shape[1] :].tolist() for i in range(len(rows))]
    for row, got in zip(rows, together):
        alone = swarm.model.generate(torch.tensor([row]), max_new_tokens=8, speculation=None)
        assert got == alone[0, len(row) :].tolist() == greedy_truth(reference, row, 8), model_type


# ---- verification="rejection" with a client draft model (as tests/generation/test_rejection_sampling.py) --------


@pytest.fixture(scope="module")
def noisy_drafters(family_paths):
    """model_type -> its tiny checkpoint's own weights plus N(0, 0.005) noise: a draft model of the
    same vocabulary whose drafts are mostly but not always the target's."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(model_type: str):
        if model_type not in made:
            model = AutoModelForCausalLM.from_pretrained(family_paths(model_type), dtype=torch.float32).eval()
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for param in model.parameters():
                    if param.ndim >= 2:
                        param.add_(torch.randn(param.shape, generator=generator) * 0.005)
            made[model_type] = model
        return made[model_type]

    return get


def test_rejection_verification_over_servers_equals_the_in_process_exchange(
    family_paths, references, noisy_drafters, artifacts_dir
):
    """Mixtral over two CLI servers: each seed's tokens under ``verification="rejection"`` are those
    the in-process exchange (the tail's and client's own functions over transformers' rows)
    computes, with corrections drawn; greedy with the same draft model equals transformers."""
    reference, drafter, prompt = references("mixtral"), noisy_drafters("mixtral"), PROMPT[0]
    greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    with cli_swarm_model(family_paths("mixtral"), SPANS, artifacts_dir / "moe-mixtral-rejection") as model:
        output = model.generate(torch.tensor([prompt]), max_new_tokens=12, draft_model=drafter, num_draft_tokens=4)
        assert output.tolist() == greedy.tolist()
        assert model.last_generation_stats.accepted > 0
        assert seeded_rejection_runs(model, reference, drafter, (11, 12, 13)) > 0


def test_rejection_verification_on_deepseek_v3_equals_the_in_process_exchange(
    inprocess_swarms, references, noisy_drafters
):
    """The same exchange on a second family, DeepSeek-V3's (latent attention, shared and routed
    experts), over the in-process servers the batching test started: each seed's tokens equal the
    in-process exchange's, with corrections drawn."""
    swarm = inprocess_swarms("deepseek_v3")
    reference, drafter = references("deepseek_v3"), noisy_drafters("deepseek_v3")
    assert seeded_rejection_runs(swarm.model, reference, drafter, (11, 12, 13)) > 0


# ---- a lossy activation codec between the servers (as tests/network/test_compression.py) ----------------------

CODEC = "blockwise4"


def codec_greedy(path, prompt: list[int], new_tokens: int, codec) -> tuple[list[int], list[float]]:
    """The swarm's computation in process: the same spans, a prefill lap then one token per lap,
    ``codec`` applied where the first server hands off to the second; tokens and their log-probs."""
    from transformers import AutoConfig

    from protocol.compression import deserialize, serialize
    from server.adapters import load_span
    from server.weights import Checkpoint

    config, checkpoint = AutoConfig.from_pretrained(path), Checkpoint(str(path))
    spans = [load_span(config, checkpoint, start, end, torch.float32, "cpu") for start, end in SPANS]
    caches = [span.new_cache() for span in spans]
    tokens, new, logprobs = list(prompt), list(prompt), []
    for _ in range(new_tokens):
        ids, start_pos = torch.tensor([new]), len(tokens) - len(new)
        hidden = spans[0].forward(spans[0].embed(ids), ids, start_pos, caches[0], range(*SPANS[0]))
        if codec is not None:
            hidden = deserialize(serialize(hidden, codec), 1 << 40)
        hidden = spans[1].forward(hidden, ids, start_pos, caches[1], range(*SPANS[1]))
        logits = spans[1].logits(hidden)[-1]
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        tokens.append(token)
        new = [token]
    return tokens[len(prompt) :], logprobs


def test_a_lossy_codec_between_moe_servers_equals_the_in_process_run_with_it(family_paths, artifacts_dir):
    """Servers started with ``--compression blockwise4``: greedy tokens and log-probs equal the same
    spans run in process with the codec at the boundary (routing included: a perturbed hidden state
    may pick other experts, identically in both), and differ from the exact run's."""
    path = family_paths("qwen3_moe")
    prompt, new_tokens = PROMPT[0], 16
    expected, expected_logprobs = codec_greedy(path, prompt, new_tokens, CODEC)
    exact, _ = codec_greedy(path, prompt, new_tokens, None)
    assert expected != exact, "this codec does not change the tiny model's tokens: the test would prove nothing"
    log_dir = artifacts_dir / "moe-qwen3-moe-codec"
    with cli_swarm_model(path, SPANS, log_dir, ["--compression", CODEC]) as model:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, speculation=None, num_logprobs=1)
        got = out[0, len(prompt) :].tolist()
        got_logprobs = [entry.logprob for entry in model.last_logprobs]
    assert got == expected
    assert got_logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_a_lossy_codec_between_mixtral_servers_equals_the_in_process_run_with_it(family_paths, inprocess_swarms):
    """The codec on a second family, Mixtral, over in-process servers started with ``compression``
    blockwise4: greedy tokens and log-probs equal the spans run in process with the codec at the
    boundary, and differ from the exact run's."""
    path, prompt, new_tokens = family_paths("mixtral"), PROMPT[0], 16
    expected, expected_logprobs = codec_greedy(path, prompt, new_tokens, CODEC)
    exact, _ = codec_greedy(path, prompt, new_tokens, None)
    assert expected != exact, "this codec does not change the tiny model's tokens: the test would prove nothing"
    model = inprocess_swarms("mixtral", compression=CODEC).model
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, speculation=None, num_logprobs=1)
    assert out[0, len(prompt) :].tolist() == expected
    assert [entry.logprob for entry in model.last_logprobs] == pytest.approx(expected_logprobs, abs=1e-4)
