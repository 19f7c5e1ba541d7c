"""The OpenAI-compatible gateway, driven by the official ``openai`` client against a live swarm.

The gateway runs in this process (its own event loop thread, port 0 on 127.0.0.1) over the
session's SmolLM2 swarm of three server processes; one test starts it as ``python -m swarm.api``
through ``LocalSwarm.start_api`` instead.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import openai
import pytest
import torch

from protocol.dht_records import fetch_servers
from swarm.api import Gateway, GatewayConfig, start_server
from swarm.api.text import IncrementalDetokenizer, StopMatcher
from tests.kit.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY, OTHER_KEY = "key-one", "key-two"
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
PROMPT = "The three primary colours are"


class GatewayThread:
    """A gateway on its own event loop in a daemon thread, as a context manager; ``url`` is the base URL."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="api-gateway", daemon=True)
        self.url = ""

    def __enter__(self) -> "GatewayThread":
        self.thread.start()
        self.runner, self.url = self._run(start_server(self.gateway, "127.0.0.1", 0))
        return self

    def __exit__(self, *exc) -> None:
        self._run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)


@pytest.fixture(scope="module")
def no_route_model(smol_swarm):
    """SmolLM2's config, but looked up under a DHT name no server announces: every block is missing."""
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(
        MODEL, initial_peers=smol_swarm.initial_peers, dht_prefix="no-such-model"
    )
    model.swarm.max_route_attempts = 1
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def gateway(smol_model, no_route_model):
    config = GatewayConfig(api_keys=frozenset({KEY, OTHER_KEY}), max_concurrent_per_key=1)
    with GatewayThread(Gateway({MODEL: smol_model, "no-route": no_route_model}, config)) as served:
        yield served


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=240)


def post_raw(url: str, body: bytes, key: Optional[str] = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def open_sessions(model) -> dict[str, int]:
    servers = fetch_servers(model.swarm.dht, model.swarm.model, model.config.num_hidden_layers)
    return {s.public_name: s.open_sessions for s in servers}


# ---- text pieces (no swarm) ------------------------------------------------------------------


def test_detokenizer_rebuilds_text_token_by_token():
    from transformers import AutoTokenizer

    from protocol.models import ensure_smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    text = " Héllo wörld 😀 — ナイス  double  spaces\n\nnew line 🇫🇷 end"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    assert "".join(detokenizer.push(i) for i in ids) + detokenizer.flush() == tokenizer.decode(ids)


def test_stop_matcher_holds_back_possible_prefixes_and_cuts_exactly():
    matcher = StopMatcher(["o wor", "zzz"])
    assert [matcher.feed(piece) for piece in ["Hel", "lo w", "o", "rld"]] == ["Hel", "l", "", ""]
    assert matcher.stopped and matcher.text == "Hell"
    matcher = StopMatcher(["abc"])
    assert [matcher.feed(piece) for piece in ["xa", "b", "x"]] == ["x", "", "abx"]
    assert matcher.finish() == "" and not matcher.stopped


# ---- the happy paths -------------------------------------------------------------------------


def test_lists_models(client):
    assert sorted(m.id for m in client.models.list()) == sorted([MODEL, "no-route"])
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion_equals_generate(client, smol_model):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    completion = raw.parse()
    prompt = smol_model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    expected = smol_model.generate([prompt], max_new_tokens=16)[0, len(prompt) :].tolist()
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == smol_model.tokenizer.decode(expected, skip_special_tokens=True)
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == len(expected)
    assert completion.usage.total_tokens == len(prompt) + len(expected)
    assert choice.finish_reason == ("stop" if expected[-1] == smol_model.config.eos_token_id else "length")
    assert int(raw.headers["x-specswarm-laps"]) == completion.model_extra["specswarm"]["laps"] >= 1
    assert float(raw.headers["x-specswarm-accepted-per-lap"]) >= 1.0


def test_streamed_chat_equals_non_streamed_for_the_same_seed(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(deltas) == whole.choices[0].message.content
    assert len([d for d in deltas if d]) >= 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert chunks[-2].model_extra["specswarm"]["laps"] >= 1
    assert len({c.id for c in chunks}) == 1


def test_completion_stops_exactly_before_a_multi_token_stop_string(client, smol_model):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    start = len(text) // 2
    stop = text[start : start + 9]  # starts mid-text, so it spans tokens
    assert len(smol_model.tokenizer.encode(stop, add_special_tokens=False)) >= 2
    expected = text[: text.index(stop)]

    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=["never", stop])
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_logprobs_when_asked(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy takes the likeliest
        assert entry.top_logprobs[0].token == entry.token
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


# ---- prompt log-probs, batches, n ---------------------------------------------------------


def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """Local transformers, float32: log-softmax over the vocabulary at every position."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_scores_the_prompt_exactly_as_local_transformers(client, smol_model, smol_reference):
    ids = smol_model.tokenizer.encode(PROMPT)
    expected = reference_logprobs(smol_reference, ids)
    scored = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [smol_model.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(expected[t - 1, ids[t]].item(), abs=1e-4)
        top = expected[t - 1].topk(3)
        want = {smol_model.tokenizer.decode([i]): v for i, v in zip(top.indices.tolist(), top.values.tolist())}
        assert set(want) <= set(lp.top_logprobs[t]) and len(lp.top_logprobs[t]) <= 4  # K and the token itself
        for token, value in want.items():
            assert lp.top_logprobs[t][token] == pytest.approx(value, abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:t])) for t in range(len(ids))]

    # ids in, and generated tokens after the prompt's (the harness's max_tokens=1 request)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=1)
    both = client.completions.create(model=MODEL, prompt=[ids], max_tokens=3, temperature=0, logprobs=1, echo=True)
    lp = both.choices[0].logprobs
    assert both.choices[0].text == smol_model.tokenizer.decode(ids) + plain.choices[0].text
    assert len(lp.tokens) == len(ids) + plain.usage.completion_tokens
    assert lp.token_logprobs[len(ids) :] == plain.choices[0].logprobs.token_logprobs
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(
        expected[torch.arange(len(ids) - 1), ids[1:]].tolist(), abs=1e-4
    )
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain.choices[0].text


def test_a_batch_of_prompts_gives_one_choice_per_prompt_in_order(client, smol_model):
    prompts = [PROMPT, "def add(a, b):", "Once upon a time"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [smol_model.tokenizer.encode(p) for p in prompts]
    assert [
        c.text for c in client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0).choices
    ] == [a.choices[0].text for a in alone]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompts,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", "", ""]
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [a.choices[0].text for a in alone] and chunks[-1].usage == batch.usage
    assert sorted(c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason) == [0, 1, 2]


def test_n_samples_with_seed_plus_index(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.95)
    three = client.chat.completions.create(**kwargs, n=3, seed=77)
    alone = [client.chat.completions.create(**kwargs, seed=77 + j) for j in range(3)]
    each = [a.choices[0].message.content for a in alone]
    assert [c.message.content for c in three.choices] == each and [c.index for c in three.choices] == [0, 1, 2]
    assert len(set(each)) > 1  # distinct seeds, distinct samples
    assert three.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens  # one prompt, counted once


def test_what_evaluation_and_load_tools_send(gateway, client, smol_model):
    card = client.models.retrieve(MODEL)
    assert card.model_extra["max_model_len"] == smol_model.context_length and card.created > 0
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, user="someone", stop=["\n\n", "###"], seed=3
    )
    assert reply.usage.completion_tokens <= 2
    text, root = "Hello there, general", gateway.url.removesuffix("/v1")
    status, body = post_raw(f"{root}/tokenize", json.dumps({"prompt": text}).encode())
    assert status == 400 and body["error"]["param"] == "model"  # this gateway serves two models: name one
    status, body = post_raw(f"{root}/tokenize", json.dumps({"model": MODEL, "prompt": text}).encode())
    assert (
        status == 200 and body["tokens"] == smol_model.tokenizer.encode(text) and body["count"] == len(body["tokens"])
    )
    status, body = post_raw(f"{root}/detokenize", json.dumps({"model": MODEL, "tokens": body["tokens"]}).encode())
    assert status == 200 and body["prompt"] == text
    status, body = post_raw(f"{root}/tokenize", json.dumps({"model": MODEL, "prompt": text}).encode(), key=None)
    assert status == 401
    refused = [
        ("logit_bias", dict(logit_bias={"42": 500})),  # biases are in [-100, 100]
        ("response_format", dict(extra_body={"response_format": {"type": "xml"}})),  # json_* are served
        ("stream_options", dict(stream_options={"include_usage": True})),
        ("max_tokens", dict(max_tokens=0)),  # 0 only with echo
        ("best_of", dict(best_of=3)),
    ]
    for param, kwargs in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
        assert e.value.param == param, param
    for param, kwargs in [
        ("guided_regex", dict(extra_body={"guided_regex": "(unclosed"})),
        ("tool_choice", dict(tool_choice="required")),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert e.value.param == param, param
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[PROMPT] * 33, max_tokens=1)
    assert e.value.param == "prompt" and e.value.code == "too_many_choices"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[PROMPT, [1, 2]], max_tokens=1)
    assert e.value.param == "prompt"


# ---- errors ----------------------------------------------------------------------------------


def test_errors_have_openai_shape_while_a_good_request_is_served(gateway, client, smol_model):
    good_client = openai.OpenAI(base_url=gateway.url, api_key=OTHER_KEY, max_retries=0, timeout=240)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(
            lambda: "".join(
                c.choices[0].delta.content or "" for c in good_client.chat.completions.create(**kwargs, stream=True)
            )
        )

        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="no-such-model", messages=MESSAGES)
        assert e.value.code == "model_not_found" and e.value.param == "model"

        status, body = post_raw(f"{gateway.url}/chat/completions", b'{"model": "smollm2-135m", "messages": [')
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_json"
        status, body = post_raw(f"{gateway.url}/completions", json.dumps({"model": MODEL, "prompt": 5}).encode())
        assert status == 400 and body["error"]["param"] == "prompt"

        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)
        assert e.value.param == "max_tokens"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, n=1000)
        assert e.value.param == "n" and e.value.code == "too_many_choices"
        for param, value in (("top_p", 1.5), ("top_p", 0.0)):  # the range check shared with client and tail
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.7, **{param: value})
            assert e.value.param == param and "(0, 1]" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="colour " * (smol_model.context_length + 10))
        assert e.value.code == "context_length_exceeded"

        wrong = openai.OpenAI(base_url=gateway.url, api_key="wrong-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        status, body = post_raw(f"{gateway.url}/completions", b"{}", key=None)
        assert status == 401 and "error" in body

        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="no-route", messages=MESSAGES, max_tokens=4)
        assert e.value.status_code == 503 and e.value.code == "no_route"
        assert "0-29" in e.value.message  # the missing blocks are named

        text = good.result(timeout=240)
    expected = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text == expected and text


def test_timeout_is_504(smol_model):
    with GatewayThread(Gateway({MODEL: smol_model}, GatewayConfig(request_timeout=0.001))) as served:
        status, body = post_raw(f"{served.url}/completions", json.dumps({"model": MODEL, "prompt": PROMPT}).encode())
        assert status == 504 and body["error"]["code"] == "timeout"
        wait_until(lambda: served.gateway.requests_in_flight == 0, "the timed-out request is gone", timeout=30)


def test_per_key_concurrency_limit_is_429(gateway, client):
    long = dict(model=MODEL, prompt=PROMPT, max_tokens=4000, temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(**long, stream=True)
    try:
        next(iter(stream))  # the first request now holds KEY's only slot
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 429
        other = openai.OpenAI(base_url=gateway.url, api_key=OTHER_KEY, max_retries=0, timeout=240)
        assert other.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        stream.close()
    wait_until(lambda: gateway.gateway.requests_in_flight == 0, "the abandoned stream is cancelled", timeout=60)


def test_a_client_that_disconnects_frees_the_session_on_every_server(gateway, client, smol_model):
    # records refresh every 2 s (SMOL_SERVER_ARGS): see every server idle, then holding the session, then idle again
    wait_until(lambda: max(open_sessions(smol_model).values()) == 0, "no server holds a session", timeout=90)
    # max_tokens: long enough to be still generating when cut (the gateway caps an unset one at 1024)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, temperature=0, max_tokens=4000, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    wait_until(lambda: min(open_sessions(smol_model).values()) >= 1, "every server holds the session", timeout=90)
    next(chunks)  # still generating
    stream.close()
    wait_until(lambda: gateway.gateway.requests_in_flight == 0, "the gateway cancels the generation", timeout=60)
    wait_until(lambda: max(open_sessions(smol_model).values()) == 0, "every server closes the session", timeout=90)
    assert len(open_sessions(smol_model)) == 3


# ---- the command-line gateway ----------------------------------------------------------------


def test_local_swarm_starts_a_gateway_process(smol_swarm):
    url = smol_swarm.start_api(0)
    try:
        api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=240)
        assert [m.id for m in api.models.list()] == [MODEL]
        completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        assert completion.usage.completion_tokens == 3 and completion.choices[0].finish_reason == "length"
    finally:
        smol_swarm.stop_api()


class RetractingModel:
    """smol_model, but its stream yields a spot-check's retraction: 6 tokens, then 4 of them replaced."""

    def __init__(self, model, first: list[int], replacement: list[int]):
        self.model, self.first, self.replacement = model, first, replacement

    def __getattr__(self, name):
        return getattr(self.model, name)

    async def agenerate_stream(self, prompt_ids, **kwargs):
        from client import GenerationStats
        from client.model import GeneratedChunk

        yield GeneratedChunk(self.first, [], GenerationStats())
        yield GeneratedChunk(self.replacement, [], GenerationStats(), retracted=4)


def test_retracted_tokens_rebuild_a_response_and_end_a_stream_with_an_error(smol_model):
    """A spot-check that replaces tokens (docs/reliability.md): a non-streamed response holds only
    the tokens that stand; a stream, which cannot take text back, ends with a named error."""
    tokenizer = smol_model.tokenizer
    first, replacement = tokenizer.encode(" red, green, and then blue")[:6], tokenizer.encode(" yellow and cyan")
    assert len(first) == 6
    model = RetractingModel(smol_model, first, replacement)
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig())) as served:
        client = openai.OpenAI(base_url=served.url, api_key="x", max_retries=0, timeout=60)
        done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32)
        assert done.choices[0].text == tokenizer.decode(first[:2] + replacement)
        assert done.usage.completion_tokens == 2 + len(replacement)
        request = urllib.request.Request(
            f"{served.url}/completions",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"model": MODEL, "prompt": PROMPT, "stream": True}).encode(),
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read().decode()
    assert "tokens_retracted" in body and "retry the request" in body
    assert tokenizer.decode(first) in "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in body.splitlines()
        if line.startswith("data: {") and '"choices"' in line
    )
