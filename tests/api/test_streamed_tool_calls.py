"""A streamed reply with several tool calls sends each call as soon as it is complete, seen through the
real openai client: the gateway serves a scripted model that writes the first call, then waits until
the client has received that call before it writes the second (a gateway that held calls to the end
would leave it waiting). No swarm: the model's reply is a script of SmolLM2 token ids."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import openai
import pytest

from client import GenerationStats
from client._token_stream import GeneratedChunk
from swarm.api.app import Gateway, GatewayConfig
from tests.api.test_api import GatewayThread

KEY, MODEL = "key", "scripted"
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
FIRST = '{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
SECOND = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
WAIT_S = 2  # the most the script waits for the client (it then goes on, and the test fails)


class ScriptedModel:
    """Stands in for the swarm model: replies with ``pieces`` (one lap each, then EOS), waiting before
    every piece after the first until ``go_on`` is set; ``waited`` records whether it was."""

    def __init__(self, tokenizer, pieces: list[str]):
        self.tokenizer, self.pieces = tokenizer, pieces
        self.config = SimpleNamespace(eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))
        self.context_length = 2048
        self.go_on = threading.Event()
        self.waited: list[bool] = []

    async def agenerate_stream(self, prompt_ids, max_new_tokens, eos_token_id=None, num_logprobs=0, **sampling):
        for i, piece in enumerate(self.pieces):
            if i:
                for _ in range(int(WAIT_S / 0.05)):
                    if self.go_on.is_set():
                        break
                    await asyncio.sleep(0.05)
                self.waited.append(self.go_on.is_set())
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            yield GeneratedChunk(ids, [], GenerationStats())
        yield GeneratedChunk([self.tokenizer.eos_token_id], [], GenerationStats())


@pytest.fixture
def scripted(smol_tokenizer):
    model = ScriptedModel(smol_tokenizer, [FIRST, SECOND])
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig(api_keys=frozenset({KEY})))) as served:
        yield model, openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=240)


@pytest.fixture
def smol_tokenizer():
    from transformers import AutoTokenizer

    from tests.kit.checkpoints import ensure_smollm2_checkpoint

    return AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())


def recorded_prompts(model, tokenizer) -> list[str]:
    """The prompts ``model`` is asked to continue, decoded, appended as the gateway sends them."""
    prompts = []
    replay = model.agenerate_stream

    def recording(prompt_ids, *args, **kwargs):
        prompts.append(tokenizer.decode(prompt_ids))
        return replay(prompt_ids, *args, **kwargs)

    model.agenerate_stream = recording
    return prompts


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_each_streamed_call_arrives_once_complete(scripted, tool_choice):
    model, client = scripted
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "time and weather?"}],
        tools=[TIME, WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=True,
        max_tokens=100,
        stream=True,
    )
    calls, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            calls.append(call)
            model.go_on.set()  # the first call is here: the script may write the second
        assert not chunk.choices[0].delta.content
        finish = chunk.choices[0].finish_reason or finish
    assert model.waited == [True], "the first call was not streamed before the second was written"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_time", {"zone": "UTC"}),
        (1, "get_weather", {"city": "Oslo"}),
    ]
    assert calls[0].id != calls[1].id and finish == "tool_calls"


def test_a_llama3_template_through_the_openai_client(smol_tokenizer):
    """A Llama-3.1-style template: the scripted model answers in its shape ({"name", "parameters"}),
    the openai client gets tool_calls (streamed and not), and the next turn's tool result reaches the
    model through the template as an ipython turn."""
    from tests.api.test_tool_calls import LLAMA3_CALL, LLAMA3_TEMPLATE

    smol_tokenizer.chat_template = LLAMA3_TEMPLATE
    model = ScriptedModel(smol_tokenizer, [LLAMA3_CALL])
    prompts = recorded_prompts(model, smol_tokenizer)
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig(api_keys=frozenset({KEY})))) as served:
        client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=240)
        ask = [{"role": "user", "content": "time?"}]
        kwargs = dict(model=MODEL, tools=[TIME, WEATHER], tool_choice="required", max_tokens=40)
        reply = client.chat.completions.create(messages=ask, **kwargs).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
        (call,) = reply.message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
        streamed = [
            d for c in client.chat.completions.create(messages=ask, stream=True, **kwargs) if c.choices
            for d in c.choices[0].delta.tool_calls or []
        ]  # fmt: skip
        assert [(d.function.name, json.loads(d.function.arguments)) for d in streamed] == [
            ("get_time", {"zone": "UTC"})
        ]
        turn = ask + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "noon"},
        ]
        client.chat.completions.create(messages=turn, **{**kwargs, "tool_choice": "auto"})
    assert "Respond in the format" in prompts[0] and '"name": "get_weather"' in prompts[0]
    assert (
        LLAMA3_CALL + "<|eot_id|>" in prompts[-1]
        and "<|start_header_id|>ipython<|end_header_id|>\n\nnoon" in prompts[-1]
    )


def test_a_llama3_builtin_call_through_the_openai_client(smol_tokenizer):
    """Llama 3.1's built-in tools through the real openai client: tools named brave_search and
    wolfram_alpha go to the template as built-ins; the scripted model replies
    ``<|python_tag|>brave_search.call(query=...)`` with <|python_tag|> one special token (as in Llama
    3.1's vocabulary, which skip_special_tokens would drop); the client gets the call (streamed and
    not), and the next turn renders it after the tag and its result as an ipython turn."""
    from tests.api.test_tool_calls import LLAMA3_TEMPLATE

    smol_tokenizer.chat_template = LLAMA3_TEMPLATE
    smol_tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    reply = '<|python_tag|>brave_search.call(query="weather in Oslo")'
    model = ScriptedModel(smol_tokenizer, [reply[:20], reply[20:]])
    model.go_on.set()
    prompts = recorded_prompts(model, smol_tokenizer)
    search, wolfram = ({"type": "function", "function": {"name": n}} for n in ("brave_search", "wolfram_alpha"))
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig(api_keys=frozenset({KEY})))) as served:
        client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=240)
        ask = [{"role": "user", "content": "weather in Oslo?"}]
        kwargs = dict(model=MODEL, tools=[search, wolfram, TIME], max_tokens=40)
        answer = client.chat.completions.create(messages=ask, **kwargs).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        (call,) = answer.message.tool_calls
        assert call.function.name == "brave_search" and json.loads(call.function.arguments) == {
            "query": "weather in Oslo"
        }
        chunks = [
            c.choices[0] for c in client.chat.completions.create(messages=ask, stream=True, **kwargs) if c.choices
        ]
        streamed = [d for c in chunks for d in c.delta.tool_calls or []]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in streamed] == [
            ("brave_search", {"query": "weather in Oslo"})
        ]
        assert chunks[-1].finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)
        turn = ask + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "rain, 9 C"},
        ]
        client.chat.completions.create(messages=turn, **kwargs)
    assert "Environment: ipython\nTools: brave_search, wolfram_alpha" in prompts[0]
    assert '"name": "get_time"' in prompts[0] and '"name": "brave_search"' not in prompts[0]
    assert '<|python_tag|>brave_search.call(query="weather in Oslo")<|eom_id|>' in prompts[-1]
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nrain, 9 C<|eot_id|>" in prompts[-1]
