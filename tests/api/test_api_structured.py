"""Structured outputs through the gateway with the official openai client: response_format
json_object / json_schema and vLLM's guided_* extras on chat and completions, exact against
generate() with the same constraint; bad constraints are 400s naming the parameter."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.test_api import KEY, MESSAGES, MODEL, PROMPT, gateway, no_route_model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

COLOUR = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "orange", "yellow", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "bright": {"type": "boolean"},
    },
    "required": ["colour", "count", "bright"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR, "strict": True}}


@pytest.fixture
def client(gateway) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=240)


def test_json_schema_chat_validates_and_repeats_at_temperature_0(client, smol_model):
    replies = [
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, response_format=SCHEMA_FORMAT
        )
        for _ in range(2)
    ]
    texts = [r.choices[0].message.content for r in replies]
    jsonschema.validate(json.loads(texts[0]), COLOUR)
    assert texts[0] == texts[1] and replies[0].choices[0].finish_reason == "stop"
    prompt = smol_model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    ids = prompt["input_ids"]
    out = smol_model.generate([ids], max_new_tokens=40, guided_json=COLOUR)
    assert smol_model.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True) == texts[0]


def test_streamed_json_object_equals_non_streamed(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.7, seed=5)
    kwargs["response_format"] = {"type": "json_object"}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and whole.lstrip().startswith("{")


def test_guided_extras_on_completions_and_chat(client):
    choice = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"guided_choice": ["red", "blue green"]}
    )
    assert choice.choices[0].text in ("red", "blue green") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"guided_regex": r" [a-z]+, [a-z]+\."}
    )
    assert regex.choices[0].text.endswith(".") and regex.choices[0].text.count(",") == 1
    schema = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"guided_json": COLOUR}
    )
    jsonschema.validate(json.loads(schema.choices[0].text), COLOUR)
    grammar = 'root ::= " " ("red" | "blue") " and " ("green" | "yellow") "."'
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"guided_grammar": grammar}
    )
    words = chat.choices[0].message.content.removesuffix(".").split(" and ")
    assert words[0].strip() in ("red", "blue") and words[1] in ("green", "yellow")
    assert chat.choices[0].finish_reason == "stop"


def test_bad_constraints_are_400s_naming_the_parameter(client):
    bad = [
        ("response_format", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 3}})),
        (
            "response_format",
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}},
                }
            ),
        ),
        ("guided_regex", dict(extra_body={"guided_regex": "[unclosed"})),
        ("guided_choice", dict(extra_body={"guided_choice": []})),
        ("guided_grammar", dict(extra_body={"guided_grammar": "root ::= missing"})),
        ("guided_regex", dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})),
    ]
    for param, kwargs in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
        assert e.value.param == param, (param, e.value.message)
    assert "does not compile" in str(e.value.message) or "one constraint" in str(e.value.message)


def test_penalties_and_logit_bias_equal_generate(client, smol_model):
    prompt = smol_model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    ids = prompt["input_ids"]
    plain = smol_model.generate([ids], max_new_tokens=16)[0, len(ids) :].tolist()
    rules = dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={plain[0]: -100.0})
    expected = smol_model.generate([ids], max_new_tokens=16, **rules)[0, len(ids) :].tolist()
    assert expected[0] != plain[0]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={str(plain[0]): -100},
    )
    assert reply.choices[0].message.content == smol_model.tokenizer.decode(expected, skip_special_tokens=True)
    for param, kwargs in [("presence_penalty", dict(presence_penalty=3)), ("logit_bias", dict(logit_bias={"1": 101}))]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
        assert e.value.param == param, (param, e.value.message)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_named_and_required_tool_calls_validate_and_stream_the_same(client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=40, temperature=0
        )
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if choice != "required":
            assert call.function.name == "get_weather"
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=40, temperature=0,
                stream=True,
            )
        )  # fmt: skip
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [
            (call.function.name, call.function.arguments)
        ]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_two_turn_tool_conversation(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=40, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3, "sky": "snow"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=turn, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_bad_tools_are_400s_naming_the_field(client):
    nameless = {"type": "function", "function": {"parameters": {"type": "object"}}}
    bad = [
        ("tools", dict(tools=[nameless], tool_choice="required")),
        ("tool_choice", dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})),
    ]
    for param, kwargs in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
        assert e.value.param == param, (param, e.value.message)


def test_auto_tool_choice_gives_a_call_or_text_and_streams_the_same(client):
    """ "auto" (also OpenAI's default with tools) leaves the reply free: a reply that is exactly a call
    of a listed tool comes back as tool_calls, any other as text; streamed or not, the same."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=48, temperature=0)
    for choice in ({}, {"tool_choice": "auto"}):
        reply = client.chat.completions.create(**kwargs, **choice).choices[0]
        chunks = [c for c in client.chat.completions.create(**kwargs, **choice, stream=True) if c.choices]
        if reply.message.tool_calls:
            assert reply.finish_reason == "tool_calls" and reply.message.tool_calls[0].function.name in (
                "get_weather",
                "get_time",
            )
            streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            assert streamed[0].function.arguments == reply.message.tool_calls[0].function.arguments
        else:
            assert reply.message.content == "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == reply.finish_reason


def test_parallel_tool_calls_true_gives_valid_calls_with_distinct_ids(client):
    """parallel_tool_calls: true lets a forced reply hold several calls (one per line); each validates,
    ids differ, and the stream carries the same calls, each sent once complete. A reply cut by
    max_tokens keeps its complete calls as tool_calls and the cut one as text (finish_reason "length")."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0)
    reply = client.chat.completions.create(**kwargs, parallel_tool_calls=True, max_tokens=120).choices[0]
    chunks = [
        c
        for c in client.chat.completions.create(**kwargs, parallel_tool_calls=True, max_tokens=120, stream=True)
        if c.choices
    ]
    calls = reply.message.tool_calls or []
    assert len({c.id for c in calls}) == len(calls) >= 1
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.arguments) for d in streamed] == [
        (i, c.function.arguments) for i, c in enumerate(calls)
    ]
    if reply.finish_reason == "length":
        assert reply.message.content.startswith('{"name": ')  # the call max_tokens cut
    else:
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
    one = client.chat.completions.create(**kwargs, parallel_tool_calls=False, max_tokens=40).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
