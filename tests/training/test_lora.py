"""LoRA adapters on servers (docs/fine_tuning.md, "LoRA adapters"; server/lora.py).

A PEFT LoRA adapter is made locally on the tiny random Llama (``LoraConfig(init_lora_weights=False)`` on the
attention's q/v/o and the MLP's gate/down projections, so it changes the outputs) and saved with
``save_pretrained``. Three servers are started with the CLI (``python -m swarm.server``): A (blocks 0:3) and B
(3:6) with ``--adapters``, C (0:6) without. With ``active_adapter`` the client must route over A and B only and
equal local ``PeftModel`` token for token (greedy and seeded sampling, every speculation mode's Step path), its
logits, loss and prompt gradients within float32 rounding (1e-4 relative); without it, the base model. Adapters
made for another model are refused with one line naming them; an unknown adapter name is a named error and the
server goes on serving.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
import torch

from client import _loop
from client._remote_session import RemoteSession
from client._training import TrainRow, train_row
from client.errors import RoutingError, ServerError
from protocol.dht import make_dht
from protocol.dht_records import fetch_servers
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Hop, OpenSession, SamplingParams
from protocol.records import ServerInfo
from protocol.route_errors import NoRouteError
from protocol.routing import with_adapter
from swarm import warm_start
from tests.kit.reference import PROMPT, reference_sample
from tests.kit.swarms import SERVER_ARGS

ADAPTER = "tiny-lora"  # the adapter's folder name: what servers announce and clients ask for
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
SPANS = {"A": ((0, 3), True), "B": ((3, 6), True), "C": ((0, 6), False)}  # name: (blocks, serves the adapter)
PRE_SEQ_LEN = 3


def make_adapter(base_path, folder, seed: int = 1, **config) -> None:
    """A random LoRA adapter of the model at ``base_path``, saved in PEFT's layout."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    options = dict(r=4, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False) | config
    get_peft_model(model, LoraConfig(**options)).save_pretrained(folder)


def make_llama(folder, **config) -> str:
    """A small random Llama (other shapes than the tiny one, or more layers) saved at ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    defaults = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6)
    LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **(defaults | config))).save_pretrained(
        folder
    )
    return str(folder)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora") / ADAPTER
    make_adapter(tiny_llama_path, folder)
    return folder


@pytest.fixture(scope="module")
def peft_reference(tiny_llama_path, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module")
def lora_swarm(tiny_llama_path, adapter_dir, artifacts_dir):
    """Servers A, B (``--adapters``) and C (none) started with the CLI; {name: record}, peers."""
    from swarm.local import LocalSwarm

    swarm = LocalSwarm(str(tiny_llama_path), spans=[], server_args=SERVER_ARGS, log_dir=str(artifacts_dir / "lora"))
    with swarm:
        for name, (blocks, with_lora) in SPANS.items():
            swarm.start_server(*blocks, name=name, extra=["--adapters", str(adapter_dir)] if with_lora else [])
        swarm.wait_ready()
        dht = make_dht(initial_peers=swarm.initial_peers, client_mode=True)
        try:
            records = {info.public_name: info for info in fetch_servers(dht, swarm.dht_name, 6)}
        finally:
            dht.shutdown()
        yield records, swarm.initial_peers


def distributed(tiny_llama_path, peers, **options):
    from swarm import AutoDistributedModelForCausalLM

    return AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=peers, **options)


@pytest.fixture(scope="module")
def adapted(lora_swarm, tiny_llama_path):
    model = distributed(tiny_llama_path, lora_swarm[1], active_adapter=ADAPTER)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def plain(lora_swarm, tiny_llama_path):
    model = distributed(tiny_llama_path, lora_swarm[1])
    yield model
    model.shutdown()


def route_names(model, servers) -> set[str]:
    by_peer = {s.peer_id: name for name, s in servers.items()}
    return {by_peer[peer_id] for peer_id, _, _ in model.last_generation_stats.route}


def test_servers_announce_their_adapters_and_the_dashboard_lists_them(lora_swarm):
    from swarm.dashboard.state import ServerEntry
    from swarm.dashboard.views import server_view

    servers, _ = lora_swarm
    assert [servers[n].adapters for n in "ABC"] == [[ADAPTER], [ADAPTER], []]
    view = server_view(ServerEntry(servers["A"], servers["A"].state, 0.0), None, 6, 0.0)
    assert view["adapters"] == [ADAPTER]


def test_a_span_holds_the_pairs_of_its_own_blocks_only(tiny_llama_path, adapter_dir):
    from safetensors.torch import load_file

    from server.lora import WEIGHTS_FILE, attach_to_span, open_adapters

    pairs = load_file(f"{adapter_dir}/{WEIGHTS_FILE}")
    held = []
    for start, end in [(0, 2), (2, 6)]:
        span = tiny_span(tiny_llama_path, start, end)
        attach_to_span(span, open_adapters([str(adapter_dir)], 6))
        assert span.lora.names == (ADAPTER,)
        ours = sum(
            t.numel() * 4 for k, t in pairs.items() if int(k.split(".layers.")[1].split(".")[0]) in range(start, end)
        )
        assert span.lora.bytes == ours > 0
        held.append(span.lora.bytes)
        assert type(span.layers[0].self_attn.q_proj).__name__ == "LoraLinear"
        assert type(span.layers[0].self_attn.k_proj).__name__ == "Linear"  # not a target: left alone
    assert sum(held) == sum(t.numel() * 4 for t in pairs.values())


def tiny_span(tiny_llama_path, start: int, end: int):
    from transformers import AutoConfig

    from server.adapters import load_span
    from server.weights import Checkpoint

    config = AutoConfig.from_pretrained(tiny_llama_path)
    return load_span(config, Checkpoint(str(tiny_llama_path)), start, end, torch.float32, "cpu")


MODES = {  # the Step path of each speculation mode: chains, looped runs (the default), trees, runs in flight
    "none": dict(speculation=None),
    "suffix": dict(speculation="suffix", draft_corpus=[PROMPT[0] * 2]),
    "tree": dict(speculation="suffix", draft_tree=True, draft_corpus=[PROMPT[0] * 2]),
    "async": dict(speculation="suffix", async_speculation=True, draft_corpus=[PROMPT[0] * 2]),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_generation_with_the_adapter_equals_local_peft(adapted, peft_reference, lora_swarm, mode):
    prompt = torch.tensor(PROMPT)
    expected = peft_reference.generate(prompt, max_new_tokens=16, do_sample=False)
    output = adapted.generate(prompt, max_new_tokens=16, **MODES[mode])
    assert output.tolist() == expected.tolist()
    assert route_names(adapted, lora_swarm[0]) == {"A", "B"}  # never C, which lacks the adapter


def test_seeded_sampling_with_the_adapter_equals_the_reference_sampler(adapted, peft_reference):
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=1234)
    expected = reference_sample(peft_reference, PROMPT[0], 16, params)
    output = adapted.generate(
        torch.tensor(PROMPT), max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, seed=1234
    )
    assert output[0, len(PROMPT[0]) :].tolist() == expected


def test_without_the_adapter_the_base_model_answers(plain, tiny_reference, peft_reference):
    prompt = torch.tensor(PROMPT)
    expected = tiny_reference.generate(prompt, max_new_tokens=16, do_sample=False)
    assert plain.generate(prompt, max_new_tokens=16, speculation=None).tolist() == expected.tolist()
    adapted = peft_reference.generate(prompt, max_new_tokens=16, do_sample=False)
    assert adapted.tolist() != expected.tolist()  # the adapter changes the answer: the tests above can fail


def test_concurrent_sessions_with_and_without_the_adapter_get_their_own(
    adapted, plain, lora_swarm, tiny_reference, peft_reference
):
    """Both through A and B at once: each pass holds runs of one adapter only (server/batching.py)."""
    servers = lora_swarm[0]
    plain.swarm.excluded.ban(servers["C"].peer_id)  # this client too routes over A and B
    prompt = PROMPT[0]

    async def collect(model):
        tokens = []
        async for chunk in model.agenerate_stream(prompt, max_new_tokens=12, speculation=None):
            tokens = tokens[: len(tokens) - chunk.retracted] + chunk.token_ids
        return tokens

    async def both():
        return await asyncio.gather(collect(adapted), collect(plain), collect(adapted))

    with_lora, without, again = asyncio.run(both())
    expected = peft_reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
    base = tiny_reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
    assert with_lora == again == expected.tolist()
    assert without == base.tolist()


def test_a_pass_never_mixes_adapters():
    from server.batching import BatchScheduler, Job

    def job(adapter: str) -> Job:
        session = SimpleNamespace(blocks=range(0, 3), adapter=adapter, closed=False)
        run = SimpleNamespace(step=SimpleNamespace(token_ids=[1, 2], parents=[]), cancelled=False)
        return Job(session, run, future=None)

    scheduler = BatchScheduler(span=None, executor=None)
    jobs = [job(ADAPTER), job(""), job(ADAPTER), job("other"), job("")]
    scheduler._waiting = list(jobs)
    passes = []
    while scheduler._waiting:
        passes.append([j for j, _ in scheduler._take()])
    assert passes == [[jobs[0], jobs[2]], [jobs[1], jobs[4]], [jobs[3]]]


def test_forward_logits_with_the_adapter_equal_local_peft(adapted, peft_reference):
    torch.manual_seed(2)
    input_ids = torch.randint(0, adapted.config.vocab_size, (2, 9))
    with torch.no_grad():
        ours = adapted(input_ids).logits
        theirs = peft_reference(input_ids).logits
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(theirs.abs().max())


def test_prompt_gradients_with_the_adapter_equal_local_peft(lora_swarm, tiny_llama_path, peft_reference):
    model = distributed(tiny_llama_path, lora_swarm[1], active_adapter=ADAPTER, tuning_mode="ptune", pre_seq_len=3)
    try:
        torch.manual_seed(3)
        input_ids = torch.randint(0, model.config.vocab_size, (2, 8))
        mask = torch.ones_like(input_ids)
        mask[1, :2] = 0  # left padding on the second row
        labels = input_ids.masked_fill(mask == 0, -100)
        loss = model(input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        ours = model.prompt_embeddings.weight.grad.clone()
        prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
    finally:
        model.shutdown()
    expected = peft_loss(peft_reference, prompts, input_ids, mask, labels)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-4 * abs(expected.item())
    assert float(ours.abs().max()) > 0
    assert float((ours - prompts.grad).abs().max()) <= 1e-4 * float(prompts.grad.abs().max())


def peft_loss(reference, prompts, input_ids, mask, labels):
    """Local PEFT with inputs_embeds = cat(prompts, embed(ids)) per row (its padding removed), and the mean
    cross-entropy of each next id over the batch (the swarm's training loss: docs/fine_tuning.md)."""
    total, count = 0.0, 0
    embed = reference.get_input_embeddings()
    for i in range(input_ids.shape[0]):
        keep = mask[i].bool()
        ids, row_labels = input_ids[i][keep], labels[i][keep]
        embeds = torch.cat([prompts, embed(ids)]).unsqueeze(0)
        logits = reference(inputs_embeds=embeds).logits[0, prompts.shape[0] :]
        targets = row_labels[1:]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    return total / count


def test_routing_names_the_blocks_no_server_with_the_adapter_holds():
    def record(peer: str, start: int, end: int, adapters: list[str]) -> ServerInfo:
        return ServerInfo(peer_id=peer, model="m", start_block=start, end_block=end, adapters=adapters)

    servers = [record("a", 0, 3, [ADAPTER]), record("c", 0, 6, [])]
    assert with_adapter(servers, "", 6) == servers
    with pytest.raises(NoRouteError, match=f"serves adapter '{ADAPTER}' holds blocks 3..5") as caught:
        with_adapter(servers, ADAPTER, 6)
    assert caught.value.missing_blocks == [3, 4, 5]
    assert with_adapter(servers + [record("b", 3, 6, [ADAPTER, "x"])], ADAPTER, 6) == [
        servers[0],
        record("b", 3, 6, [ADAPTER, "x"]),
    ]
    # records are bounded like every other field
    raw = record("a", 0, 3, [str(i) for i in range(17)]).to_dict()
    with pytest.raises(msgspec.ValidationError):
        ServerInfo.from_dict(raw, 6)


def test_a_client_asking_for_an_adapter_nobody_serves_gets_a_routing_error(lora_swarm, tiny_llama_path):
    model = distributed(tiny_llama_path, lora_swarm[1], active_adapter="no-such-adapter")
    model.swarm.max_route_attempts = 1
    try:
        with pytest.raises(RoutingError, match="serves adapter 'no-such-adapter' holds blocks 0..5"):
            model.generate(torch.tensor(PROMPT), max_new_tokens=2)
    finally:
        model.shutdown()


def test_unknown_adapter_is_a_named_error_and_the_server_keeps_serving(plain, lora_swarm, tiny_reference):
    servers = lora_swarm[0]
    swarm = plain.swarm
    route = [Hop(servers["A"].peer_id, 0, 3), Hop(servers["B"].peer_id, 3, 6)]

    async def open_with(adapter: str, hops):
        session = RemoteSession(swarm.p2p, hops, 32, timeout=30, adapter=adapter)
        try:
            await session.open()
        finally:
            await session.close()

    with pytest.raises(ServerError, match="unknown adapter 'nope': it serves \\['tiny-lora'\\]") as caught:
        _loop.run(open_with("nope", route))
    assert caught.value.code == ErrorCode.UNKNOWN_ADAPTER
    with pytest.raises(ServerError, match=f"unknown adapter '{ADAPTER}': it serves no adapters"):
        _loop.run(open_with(ADAPTER, [Hop(servers["C"].peer_id, 0, 6)]))

    async def train_with(adapter: str):
        swarm.active_adapter = adapter
        try:
            row = TrainRow(token_ids=PROMPT[0], targets=PROMPT[0][1:] + [-100])
            return await train_row(swarm, [Hop(servers["C"].peer_id, 0, 6)], torch.zeros(0, 64), row, 30)
        finally:
            swarm.active_adapter = ""

    with pytest.raises(ServerError, match=f"unknown adapter '{ADAPTER}'"):
        _loop.run(train_with(ADAPTER))
    expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False)
    assert plain.generate(torch.tensor(PROMPT), max_new_tokens=6, speculation=None).tolist() == expected.tolist()


def test_check_adapter_is_a_protocol_error():
    from server.lora import ServerAdapters, check_adapter

    assert check_adapter("", None) == ""
    assert check_adapter(ADAPTER, ServerAdapters([ADAPTER])) == ADAPTER
    with pytest.raises(ProtocolError) as caught:
        check_adapter("x", ServerAdapters([ADAPTER]))
    assert caught.value.code == ErrorCode.UNKNOWN_ADAPTER
    assert OpenSession(session_id="s", max_length=1, route=[], hop_index=0).active_adapter == ""


def test_adapters_made_for_another_model_are_refused(tiny_llama_path, tmp_path):
    from server.lora import AdapterError, attach_to_span, open_adapters

    narrow = tmp_path / "narrow-lora"  # hidden size 32: every pair has other shapes
    make_adapter(make_llama(tmp_path / "narrow", hidden_size=32, intermediate_size=64), narrow)
    deep = tmp_path / "deep-lora"  # the same shapes, but 8 layers
    make_adapter(make_llama(tmp_path / "deep", num_hidden_layers=8), deep)
    span = tiny_span(tiny_llama_path, 0, 2)
    with pytest.raises(
        AdapterError, match=r"adapter 'narrow-lora': layers\.0\.\S+ has lora_A \(4, \d+\) .*another base model"
    ):
        attach_to_span(span, open_adapters([str(narrow)], 6))
    with pytest.raises(AdapterError, match="adapter 'deep-lora' adapts layer 7, but this model has 6 layers"):
        open_adapters([str(deep)], 6)
    with pytest.raises(AdapterError, match="no such folder"):
        open_adapters([str(tmp_path / "missing-lora")], 6)
    dora = tmp_path / "dora-lora"
    make_adapter(tiny_llama_path, dora, use_dora=True)
    with pytest.raises(AdapterError, match="adapter 'dora-lora' sets use_dora=True"):
        open_adapters([str(dora)], 6)


def test_the_memory_plan_counts_the_adapters(tiny_llama_path, adapter_dir):
    from transformers import AutoConfig

    from server.lora import block_bytes, open_adapters
    from server.memory import plan_blocks

    config = AutoConfig.from_pretrained(tiny_llama_path)
    per_block = block_bytes(open_adapters([str(adapter_dir)], 6), 6, torch.float32)
    r, h, inner = 4, config.hidden_size, config.intermediate_size
    q, v = r * (h + 4 * 16), r * (h + 2 * 16)  # 4 heads of 16 (q, o); 2 key-value heads (v)
    assert per_block == 4 * (q + v + r * (h + h) + r * (h + inner) + r * (inner + h))
    free = 2**30
    base = plan_blocks(config, torch.float32, "cpu", 6, free_bytes=free)
    with_lora = plan_blocks(config, torch.float32, "cpu", 6, free_bytes=free, adapter_bytes=per_block)
    assert with_lora.bytes_per_block == base.bytes_per_block + per_block


def test_the_cli_refuses_an_adapter_of_another_model_in_one_line(tiny_llama_path, tmp_path):
    narrow = tmp_path / "narrow-lora"
    make_adapter(make_llama(tmp_path / "narrow", num_hidden_layers=7), narrow)
    args = ["--model", str(tiny_llama_path), "--new-swarm", "--host", "127.0.0.1", "--adapters", str(narrow)]
    done = warm_start.run("swarm.server", args, timeout=300)  # python -m swarm.server, forked warm
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "adapter 'narrow-lora' adapts layer 6, but this model has 6 layers" in errors[0]


def test_a_span_loaded_by_a_move_gets_the_adapters_again(tiny_llama_path, adapter_dir):
    """server/moves.py attaches the --adapters' pairs of the new blocks to the span it loads."""
    from server.moves import SpanMoves

    span = tiny_span(tiny_llama_path, 1, 4)
    SpanMoves._attach_adapters(SimpleNamespace(config=SimpleNamespace(adapters=(str(adapter_dir),))), span)
    assert span.lora.names == (ADAPTER,)
    assert type(span.layers[0].self_attn.q_proj).__name__ == "LoraLinear"


# ---- active_adapter per call (client/_adapters.py) ----


def test_generate_with_active_adapter_overrides_the_models_for_that_call(
    plain, adapted, peft_reference, tiny_reference, lora_swarm
):
    prompt = torch.tensor(PROMPT)
    with_lora = peft_reference.generate(prompt, max_new_tokens=12, do_sample=False).tolist()
    base = tiny_reference.generate(prompt, max_new_tokens=12, do_sample=False).tolist()
    for mode in ("none", "suffix"):
        assert plain.generate(prompt, max_new_tokens=12, active_adapter=ADAPTER, **MODES[mode]).tolist() == with_lora
        assert route_names(plain, lora_swarm[0]) == {"A", "B"}  # only servers that announce it
        assert plain.generate(prompt, max_new_tokens=12, **MODES[mode]).tolist() == base  # the model's again
    assert adapted.generate(prompt, max_new_tokens=12, speculation=None, active_adapter="").tolist() == base
    assert plain.swarm.active_adapter == "" and adapted.swarm.active_adapter == ADAPTER  # nothing left behind
    attempts, plain.swarm.max_route_attempts = plain.swarm.max_route_attempts, 1  # no 1+2+4+8 s of retries
    try:
        with pytest.raises(RoutingError, match="serves adapter 'missing' holds blocks 0..5") as caught:
            plain.generate(prompt, max_new_tokens=4, active_adapter="missing")
    finally:
        plain.swarm.max_route_attempts = attempts
    assert caught.value.missing_blocks == list(range(6))
    with pytest.raises(ValueError, match="active_adapter must be an adapter's name"):
        plain.generate(prompt, max_new_tokens=4, active_adapter=3)


def test_an_inference_session_keeps_its_adapter(plain, peft_reference):
    prompt = PROMPT[0]
    expected = peft_reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0].tolist()
    with plain.inference_session(max_length=64, active_adapter=ADAPTER) as session:
        first = plain.generate(torch.tensor([prompt]), max_new_tokens=5, speculation=None)
        second = plain.generate(first, max_new_tokens=5, speculation=None, active_adapter=ADAPTER)
        assert session.remote.adapter == ADAPTER
        with pytest.raises(ValueError, match="inside an inference session opened with active_adapter='tiny-lora'"):
            plain.generate(second, max_new_tokens=2, active_adapter="")
    assert second[0].tolist() == expected
    assert plain.swarm.active_adapter == ""


def test_streams_at_once_each_get_their_own_adapter(plain, lora_swarm, tiny_reference, peft_reference):
    plain.swarm.excluded.ban(lora_swarm[0]["C"].peer_id)  # every stream through A and B, passes shared
    prompt = PROMPT[0]

    async def collect(**options):
        tokens = []
        async for chunk in plain.agenerate_stream(prompt, max_new_tokens=10, speculation=None, **options):
            tokens = tokens[: len(tokens) - chunk.retracted] + chunk.token_ids
        return tokens

    async def all_three():
        return await asyncio.gather(collect(active_adapter=ADAPTER), collect(), collect(active_adapter=ADAPTER))

    with_lora, without, again = asyncio.run(all_three())
    expected = peft_reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :]
    base = tiny_reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :]
    assert with_lora == again == expected.tolist() and without == base.tolist()


def test_forward_and_a_training_step_with_active_adapter_equal_local_peft(lora_swarm, tiny_llama_path, peft_reference):
    model = distributed(tiny_llama_path, lora_swarm[1], tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN)
    try:
        torch.manual_seed(6)
        input_ids = torch.randint(0, model.config.vocab_size, (2, 8))
        mask = torch.ones_like(input_ids)
        labels = input_ids.clone()
        prompts = model.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        with torch.no_grad():
            logits = model(input_ids, active_adapter=ADAPTER).logits
            embeds = torch.cat([prompts.detach(), peft_reference.get_input_embeddings()(input_ids[0])]).unsqueeze(0)
            expected_logits = peft_reference(inputs_embeds=embeds).logits[0, PRE_SEQ_LEN:]
        assert float((logits[0] - expected_logits).abs().max()) <= 1e-4 * float(expected_logits.abs().max())
        loss = model(input_ids, attention_mask=mask, labels=labels, active_adapter=ADAPTER).loss
        loss.backward()
        ours = model.prompt_embeddings.weight.grad.clone()
        route = {hop.peer_id for hop in model.last_training_stats.route}
        assert route == {lora_swarm[0][n].peer_id for n in "AB"}
    finally:
        model.shutdown()
    expected = peft_loss(peft_reference, prompts, input_ids, mask, labels)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-4 * abs(expected.item())
    assert float((ours - prompts.grad).abs().max()) <= 1e-4 * float(prompts.grad.abs().max())
