"""The tail's drafter (server/tail_drafter.py): its drafts flow to the client and never change
the output; its own cache rolls back like the main one; bad head files and requests are refused."""

from __future__ import annotations

import pytest
import torch

from client.drafting import Drafter, TailDrafts
from protocol.errors import ProtocolError
from protocol.messages import Hop, SamplingParams, Step
from tests.kit.checkpoints import build_random_drafter
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.swarms import tail_drafter_swarm


@pytest.fixture(scope="session")
def tiny_drafter_path(tiny_llama_path, tmp_path_factory):
    return build_random_drafter(tiny_llama_path, tmp_path_factory.mktemp("tail") / "tiny-head.safetensors")


@pytest.fixture(scope="session")
def tiny_drafter_model(request, tiny_llama_path, tiny_drafter_path, artifacts_dir):
    """Two servers of the tiny model (0:3, 3:6); the tail drafts with a random head."""
    yield from tail_drafter_swarm(request, tiny_llama_path, tiny_drafter_path, artifacts_dir / "tiny-head-swarm")


def _tail_span(tiny_llama_path, tiny_drafter_path):
    from transformers import AutoConfig

    from server.adapters import load_span
    from server.tail_drafter import build_tail_drafter
    from server.weights import Checkpoint

    config = AutoConfig.from_pretrained(tiny_llama_path)
    checkpoint = Checkpoint(str(tiny_llama_path))
    span = load_span(config, checkpoint, 0, config.num_hidden_layers, torch.float32, "cpu")
    span.drafter = build_tail_drafter(span, config, checkpoint, tiny_drafter_path, max_drafts=4)
    return span


def test_drafter_cache_rolls_back_exactly(tiny_llama_path, tiny_drafter_path):
    """Drafts after a sequence of runs (drafts rejected, a rollback to an earlier position, a
    different token where the last run ended) equal the drafts of a fresh head over the same
    committed text in one pass: the head's cache keeps exactly the committed positions."""
    span = _tail_span(tiny_llama_path, tiny_drafter_path)
    drafter = span.drafter
    text = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 657, 506, 88, 901, 77, 5, 4102, 33, 250, 61, 7000]

    def fresh_drafts(committed: list[int], next_token: int) -> list[int]:
        cache = span.new_cache()
        hidden = span.forward(span.embed(torch.tensor([committed])), None, 0, cache, range(span.start, span.end))
        return drafter.draft(drafter.new_session(), hidden, committed, 0, len(committed), next_token, 4)

    cache, state = span.new_cache(), drafter.new_session()
    # (start_pos, token ids, ids of them committed after the verdict, next token)
    runs = [
        (0, text[:8], 8, text[8]),
        (8, text[8:12], 2, 999),
        (10, [999, 5, 6], 1, 42),
        (11, [42, 7], 2, 43),
        (5, text[5:9], 4, 1234),
        (9, [77, 78, 79, 80], 4, 81),
    ]
    history: list[int] = []
    for start_pos, ids, committed, next_token in runs:
        span.trim_cache(cache, start_pos)
        hidden = span.forward(span.embed(torch.tensor([ids])), None, start_pos, cache, range(span.start, span.end))
        drafts = drafter.draft(state, hidden, ids, start_pos, committed, next_token, 4)
        history = history[:start_pos] + ids[:committed]
        span.trim_cache(cache, start_pos + committed)
        assert drafts == fresh_drafts(history, next_token), (start_pos, ids)
        assert len(drafts) == 4 and state.end == len(history)


class _Fixed(Drafter):
    """A retrieval stand-in that always proposes the same ids."""

    def __init__(self, ids):
        self.ids = ids

    def reset(self, context):
        pass

    def extend(self, new_tokens):
        pass

    def draft(self, max_tokens, after=()):
        return self.ids[:max_tokens]

    def observe(self, drafted, accepted):
        pass

    def finish(self):
        pass


def test_tail_drafts_merge_by_measured_acceptance():
    drafter = TailDrafts(_Fixed([7, 8, 9]))
    drafter.reset([1, 2, 3])
    drafter.offer(3, [4, 5, 6, 10])
    assert drafter.fresh and drafter.draft(4) == [4, 5, 6, 10]  # no evidence yet: the tail's
    assert drafter.draft(4, after=[4, 5]) == [6, 10]  # past runs in flight that follow the tail's ids
    assert drafter.draft(4, after=[4, 9]) == [7, 8, 9]  # the tail's ids no longer continue the text
    drafter.extend([4, 5, 6, 11])  # the verdict: the tail got 3 right, retrieval none
    assert drafter.sources == {"tail": [1, 4, 3], "retrieval": [1, 3, 0]}
    for _ in range(4):  # then retrieval is right and the tail wrong, lap after lap
        position = len(drafter._context)
        drafter.offer(position, [99, 99])
        drafter.draft(3)
        drafter.extend([7, 8, 9])
    assert drafter.draft(3) == [7, 8, 9]  # measured better now (the tail's ids are stale here anyway)
    drafter.offer(len(drafter._context), [99])
    assert drafter.draft(3) == [7, 8, 9] and drafter.chosen["retrieval"] >= 2
    assert drafter.sources["tail"][2] == 3 and drafter.sources["retrieval"][2] == 12


def test_drafter_file_for_another_model_is_refused(tiny_drafter_path):
    from transformers import AutoConfig

    from protocol.models import ensure_smollm2_checkpoint
    from server.tail_drafter import load_drafter

    with pytest.raises(ValueError, match="trained for another model"):
        load_drafter(tiny_drafter_path, AutoConfig.from_pretrained(ensure_smollm2_checkpoint()))
    with pytest.raises(ValueError, match="cannot read tail drafter"):
        load_drafter(
            tiny_drafter_path.parent / "missing.safetensors", AutoConfig.from_pretrained(ensure_smollm2_checkpoint())
        )


def test_the_memory_plan_counts_the_committed_drafter_at_the_tail():
    """What a tail's drafter takes beyond its blocks (the head, its copy of the draft vocabulary's
    LM-head rows) is what the memory plan keeps room for (server.memory.MemoryPlan.tail_blocks)."""
    from transformers import AutoConfig

    from protocol.models import ensure_smollm2_checkpoint
    from server.adapters import load_span
    from server.drafter_attach import drafter_bytes
    from server.quantization import Quant, resident_bytes
    from server.server_config import ServerConfig
    from server.tail_drafter import build_tail_drafter, committed_drafter, drafter_file_bytes, load_drafter
    from server.weights import Checkpoint

    path = ensure_smollm2_checkpoint()
    config, checkpoint = AutoConfig.from_pretrained(path), Checkpoint(str(path))
    span = load_span(config, checkpoint, 29, 30, torch.float32, "cpu")
    drafter = build_tail_drafter(span, config, checkpoint, committed_drafter(config))
    assert drafter.embed_weight is span.lm_head.weight and drafter.rows is not span.lm_head.weight
    loaded = resident_bytes(drafter.net) + drafter.rows.numel() * drafter.rows.element_size()
    assert drafter_file_bytes(committed_drafter(config), config, torch.float32, tied=True) == loaded
    head, vocab = load_drafter(committed_drafter(config), config, dtype=torch.bfloat16)  # buffers are cast too
    loaded_bf16 = resident_bytes(head) + len(vocab) * config.hidden_size * 2
    assert drafter_file_bytes(committed_drafter(config), config, torch.bfloat16, tied=True) == loaded_bf16
    assert drafter_bytes(ServerConfig(model=str(path)), config, checkpoint, torch.float32, Quant.NONE) == loaded
    assert (
        drafter_bytes(ServerConfig(model=str(path), drafter="none"), config, checkpoint, torch.float32, Quant.NONE) == 0
    )


def test_tail_drafts_out_of_range_are_refused(tiny_llama_path, tiny_drafter_path):
    from server.session import ServerSession

    span = _tail_span(tiny_llama_path, tiny_drafter_path)
    session = ServerSession("s", 64, [Hop("me", 0, 6)], 0, span.new_cache())
    with pytest.raises(ProtocolError, match="tail_drafts must be in"):
        session.check_step(Step(session_id="s", run_id=0, start_pos=0, token_ids=[1, 2], tail_drafts=99), None, span)


@pytest.mark.parametrize("speculation", ["tail", "suffix+tail"])
def test_tail_drafts_leave_greedy_output_unchanged(tiny_drafter_model, tiny_reference, speculation):
    expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=24, do_sample=False)
    tiny_drafter_model.reset_draft_store()
    output = tiny_drafter_model.generate(  # laps priced so that no draft is cut: every lap may carry them
        torch.tensor(PROMPT), max_new_tokens=24, speculation=speculation, loop_runs=False, draft_lap_costs=(1.0, 0.0)
    )
    assert output.tolist() == expected.tolist()  # runs from the client: the tail's ids merged per lap
    stats = tiny_drafter_model.last_generation_stats
    proposals, proposed, _ = stats.drafter_sources["tail"]
    assert proposals >= 20 and proposed >= 3 * proposals  # the tail's drafts reached the client every lap
    assert stats.drafter_choices["tail"] + stats.drafter_choices["retrieval"] >= 20  # laps carrying drafts
    tiny_drafter_model.reset_draft_store()
    started = tiny_drafter_model.generate(torch.tensor(PROMPT), max_new_tokens=24, speculation=speculation)
    assert started.tolist() == expected.tolist()  # the default: tail drafts in runs the tail starts
    assert (
        tiny_drafter_model.last_generation_stats.looped_runs > 0
        and tiny_drafter_model.last_generation_stats.drafted > 0
    )


def test_tail_drafts_leave_seeded_sampling_unchanged(tiny_drafter_model, tiny_reference):
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    expected = reference_sample(tiny_reference, PROMPT[0], 20, params)
    output = tiny_drafter_model.generate(
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
    assert tiny_drafter_model.last_generation_stats.drafter_sources["tail"][0] >= 15


def test_smollm2_trained_tail_drafts_are_accepted(smol_model, smol_reference):
    """The committed head (server/drafters/, picked by --drafter auto) drafts for smollm2-135m: its
    drafts are accepted at a positive rate and the output equals transformers'."""
    messages = [{"role": "user", "content": "Explain how a bicycle works."}]  # no benchmark's, no training prompt
    ids = smol_model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    expected = smol_reference.generate(ids, max_new_tokens=48, do_sample=False)
    output = smol_model.generate(  # laps priced so that the cost model cuts no draft (it prices them elsewhere)
        ids, max_new_tokens=48, speculation="tail", loop_runs=False, draft_lap_costs=(1.0, 0.0)
    )
    assert output.tolist() == expected.tolist()
    stats = smol_model.last_generation_stats
    assert stats.drafter_choices["tail"] >= 10  # tail drafts only: every accepted draft is the tail drafter's
    assert stats.accepted > 0 and stats.drafter_sources["tail"][2] > 0
