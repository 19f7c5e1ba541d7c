"""The gateway's tool-call responses without a swarm: what "auto" and forced calls hold back while
streaming, and what they return (swarm/api/responses.py, swarm/api/tools.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from client import GenerationStats
from swarm.api.engine import Delta, GenerationParams
from swarm.api.errors import APIError
from swarm.api.responses import ChatFormat
from swarm.api.tools import (
    HERMES_FORMAT,
    JSON_FORMAT,
    LLAMA3_FORMAT,
    call_grammar,
    call_schema,
    checked_tools,
    template_tool_format,
)

NAMES = ("get_time", "get_weather")


def stream(mode: str, pieces: list[str], finish: str = "stop", fmt: str = "json", parallel: bool = True, names=NAMES):
    """The chunks ChatFormat sends for one choice whose deltas carry ``pieces``, and its response."""
    params = GenerationParams(
        prompt_ids=[1], max_tokens=8, tool_call=mode, tool_names=names, tool_format=fmt, parallel_tool_calls=parallel
    )
    generation = SimpleNamespace(params=params, finish_reason=finish, stats=GenerationStats(), completion_tokens=3)
    fmt = ChatFormat(SimpleNamespace(name="m"), [generation], -1)
    deltas = [Delta(text=p, token_ids=[1], logprobs=[None]) for p in pieces]
    chunks = [fmt.chunk(0, d)["choices"][0]["delta"] for d in deltas if fmt.wants_chunk(0, d)]
    chunks.append(fmt.closing_chunk(0)["choices"][0])
    whole = ChatFormat(SimpleNamespace(name="m"), [generation], -1).response([deltas])["choices"][0]
    return chunks, whole


CALL = ['{"name": "get_time", ', '"arguments": {"zone": "UTC"}}']


@pytest.mark.parametrize("mode", ["auto", "forced"])
def test_a_call_is_held_and_sent_whole(mode):
    chunks, whole = stream(mode, CALL)
    assert len(chunks) == 1 and chunks[0]["finish_reason"] == "tool_calls"
    (call,) = chunks[0]["delta"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": json.dumps({"zone": "UTC"})} and call["index"] == 0
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert whole["message"]["tool_calls"][0]["function"] == call["function"]


def test_auto_text_streams_once_it_cannot_be_a_call():
    chunks, whole = stream("auto", [" ", "It is ", "noon."])
    assert [c.get("content") for c in chunks[:-1]] == [" It is ", "noon."]  # the held space goes with the first
    assert chunks[-1]["delta"] == {} and chunks[-1]["finish_reason"] == "stop"
    assert whole["message"] == {"role": "assistant", "content": " It is noon."}


def test_auto_json_that_is_no_call_of_a_listed_tool_is_text():
    for pieces in (['{"name": "rm_rf", "arguments": {}}'], ['{"a": 1', "}"], ["{not json"]):
        chunks, whole = stream("auto", pieces)
        assert chunks == [
            {"index": 0, "delta": {"content": "".join(pieces)}, "logprobs": None, "finish_reason": "stop"}
        ]
        assert whole["message"]["content"] == "".join(pieces) and whole["finish_reason"] == "stop"


def test_a_call_cut_by_max_tokens_is_text_with_finish_reason_length():
    chunks, whole = stream("forced", CALL[:1], finish="length")
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["delta"] == {"content": CALL[0]}
    assert whole["finish_reason"] == "length" and whole["message"]["content"] == CALL[0]


def test_call_schemas_and_bad_tools():
    tools = checked_tools([{"type": "function", "function": {"name": n}} for n in NAMES])
    assert call_schema(tools, "none") is None and call_schema(tools, "auto") is None
    assert len(call_schema(tools, "required")["anyOf"]) == 2
    named = call_schema(tools, {"type": "function", "function": {"name": "get_time"}})
    assert named["properties"]["name"] == {"const": "get_time"}
    one = [{"type": "function", "function": {"name": "a"}}]
    for tools_arg, choice, param in [
        ([{"type": "function", "function": {}}], "required", "tools"),
        ([{"type": "code"}], "required", "tools"),
        (one, {"type": "function", "function": {"name": "b"}}, "tool_choice"),
        (one, "sometimes", "tool_choice"),
    ]:
        with pytest.raises(APIError) as e:
            call_schema(checked_tools(tools_arg), choice)
        assert e.value.param == param


TWO = ['{"name": "get_time", "arguments": {"zone": "UTC"}}\n', '{"name": "get_weather", "arguments": {}}']
HERMES_TWO = ["<tool_call>\n" + TWO[0].strip() + "\n</tool_call>\n", "<tool_call>\n" + TWO[1] + "\n</tool_call>"]


@pytest.mark.parametrize("mode", ["auto", "forced"])
@pytest.mark.parametrize("fmt,pieces", [("json", TWO), ("hermes", HERMES_TWO)])
def test_parallel_calls_are_each_sent_once_complete_with_distinct_ids(fmt, pieces, mode):
    """The first call goes out with the delta that completes it (its newline, its closing tag), not
    with the choice's last chunk; the calls streamed equal the whole response's."""
    chunks, whole = stream(mode, pieces, fmt=fmt)
    deltas = chunks[:-1] + [chunks[-1]["delta"]]  # stream() gives the last chunk's whole choice
    assert len(deltas) >= 2 and list(deltas[0]) == ["tool_calls"] and deltas[0]["tool_calls"][0]["index"] == 0
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and chunks[-1]["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert len({c["id"] for c in calls}) == 2 and not any("content" in d for d in deltas)
    assert [c["function"] for c in whole["message"]["tool_calls"]] == [c["function"] for c in calls]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None


def test_a_call_then_text_sends_the_call_then_the_text():
    """ "auto": a complete call, then prose: the call is sent when complete, the prose as content after
    it; the whole response holds both, finish_reason "tool_calls"."""
    chunks, whole = stream("auto", [TWO[0], "That is ", "all."])
    deltas = chunks[:-1] + [chunks[-1]["delta"]]
    assert [c["function"]["name"] for c in deltas[0]["tool_calls"]] == ["get_time"]
    assert "".join(d.get("content") or "" for d in deltas) == "That is all."
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "That is all." and len(whole["message"]["tool_calls"]) == 1
    assert whole["finish_reason"] == "tool_calls"
    # cut by max_tokens after one complete call: that call, the rest as text, finish_reason "length"
    chunks, whole = stream("forced", [TWO[0], CALL[0]], finish="length")
    assert chunks[0]["tool_calls"][0]["function"]["name"] == "get_time"
    assert chunks[-1]["delta"] == {"content": CALL[0]} and chunks[-1]["finish_reason"] == "length"
    assert whole["message"]["content"] == CALL[0] and whole["finish_reason"] == "length"


def test_two_calls_without_parallel_tool_calls_are_text():
    chunks, whole = stream("auto", TWO, parallel=False)
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] == "".join(TWO)
    assert chunks[-1]["delta"] == {"content": "".join(TWO)}


def test_hermes_text_answer_streams_once_it_cannot_be_a_call():
    chunks, whole = stream("auto", ["<tool", "s are fun"], fmt="hermes")
    assert whole["message"]["content"] == "<tools are fun"
    assert "".join(c.get("content") or c.get("delta", {}).get("content", "") for c in chunks) == "<tools are fun"


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call a function as <tool_call>\\n{...}\\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_template_decides_the_format_and_the_grammar_follows_it(smol_tokenizer):
    import xgrammar

    assert template_tool_format(smol_tokenizer) is JSON_FORMAT  # SmolLM2's template ignores tools
    smol_tokenizer.chat_template = HERMES_TEMPLATE
    assert template_tool_format(smol_tokenizer) is HERMES_FORMAT
    schema = call_schema(checked_tools([{"type": "function", "function": {"name": n}} for n in NAMES]), "required")
    accepts = xgrammar.testing._is_grammar_accept_string
    for fmt, parallel, text, ok in [
        (HERMES_FORMAT, True, "".join(HERMES_TWO), True),
        (HERMES_FORMAT, False, "".join(HERMES_TWO), False),
        (HERMES_FORMAT, False, HERMES_TWO[1], True),
        (HERMES_FORMAT, True, TWO[1], False),
        (JSON_FORMAT, True, "".join(TWO), True),
        (JSON_FORMAT, True, '{"name": "rm", "arguments": {}}', False),
    ]:
        assert accepts(call_grammar(schema, fmt, parallel), text) is ok, (fmt.name, parallel, text)


@pytest.fixture
def smol_tokenizer():
    from transformers import AutoTokenizer

    from tests.kit.checkpoints import ensure_smollm2_checkpoint

    return AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())


def test_a_hermes_template_gets_the_tools_and_earlier_calls_through_itself(smol_tokenizer):
    import msgspec

    from swarm.api.engine import ServedModel
    from swarm.api.schemas import ChatRequest, chat_params

    smol_tokenizer.chat_template = HERMES_TEMPLATE
    config = SimpleNamespace(eos_token_id=2, vocab_size=len(smol_tokenizer), context_length=2048)
    model = SimpleNamespace(tokenizer=smol_tokenizer, config=config, context_length=2048)
    served = ServedModel("m", model)
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    body = {"model": "m", "messages": messages, "tools": tools, "tool_choice": "required", "max_tokens": 8}
    (choice,), _ = chat_params(msgspec.convert(body, ChatRequest), served, 4)
    prompt = smol_tokenizer.decode(choice.prompt_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nnoon" in prompt
    assert choice.tool_format == "hermes" and choice.parallel_tool_calls
    assert choice.sampling["guided_grammar"].startswith('root ::= tool_call_one\ntool_call_one ::= "<tool_call>')


# A Llama-3.1-style template, cut down from Meta's: the tools as JSON in the first user message with the
# instruction to reply {"name": ..., "parameters": ...}, one call per assistant turn, results as ipython;
# built-in tools (builtin_tools) named in the system message, and their earlier calls written after
# <|python_tag|> as name.call(arg="value") ending with <|eom_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if builtin_tools is defined %}Environment: ipython\n"
    "Tools: {{ builtin_tools | reject('equalto', 'code_interpreter') | join(', ') }}\n\n{% endif %}"
    "Cutting Knowledge Date: December 2023<|eot_id|>"
    "{%- set first = namespace(done=false) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' and tools and not first.done %}{%- set first.done = true %}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\n"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
    "Do not use variables.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}"
    "{%- if m.tool_calls | length != 1 %}{{ raise_exception('This template only supports single tool-calls') }}"
    "{%- endif %}{%- set call = m.tool_calls[0].function %}"
    "{%- if builtin_tools is defined and call.name in builtin_tools %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>{{ call.name }}.call("
    '{%- for k, v in call.arguments | items %}{{ k }}="{{ v }}"{% if not loop.last %}, {% endif %}{% endfor %})'
    "<|eom_id|>{%- else %}"
    '<|start_header_id|>assistant<|end_header_id|>\n\n{{ \'{"name": "\' + call.name + \'", "parameters": \' }}'
    "{{- call.arguments | tojson }}}<|eot_id|>{%- endif %}"
    "{%- elif m.role == 'tool' or m.role == 'ipython' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
LLAMA3_CALL = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


def llama3_chat(smol_tokenizer, tool_choice, parallel=None):
    import msgspec

    from swarm.api.engine import ServedModel
    from swarm.api.schemas import ChatRequest, chat_params

    smol_tokenizer.chat_template = LLAMA3_TEMPLATE
    config = SimpleNamespace(eos_token_id=2, vocab_size=len(smol_tokenizer), context_length=2048)
    served = ServedModel("m", SimpleNamespace(tokenizer=smol_tokenizer, config=config, context_length=2048))
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    body = {"model": "m", "messages": messages, "tools": tools, "tool_choice": tool_choice, "max_tokens": 8}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    (choice,), _ = chat_params(msgspec.convert(body, ChatRequest), served, 4)
    return choice


@pytest.mark.parametrize("parallel", [None, True])
def test_a_llama3_template_gets_the_tools_and_its_call_shape(smol_tokenizer, parallel):
    """Tools, the earlier call and its result through the template; the forced reply is one bare
    {"name", "parameters"} object (the template holds one call per turn, so even with
    parallel_tool_calls true), which validates and parses into tool_calls."""
    import xgrammar

    choice = llama3_chat(smol_tokenizer, "required", parallel)
    prompt = smol_tokenizer.decode(choice.prompt_ids)
    assert '"name": "get_weather"' in prompt and "Respond in the format" in prompt
    earlier = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n" + earlier + "<|eot_id|>" in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nnoon" in prompt
    assert "You can call these functions" not in prompt  # no system message of the documented format
    # the request's parallel_tool_calls (default true: Llama 3.1's built-in calls may come several after
    # <|python_tag|>); the format itself holds one JSON call per reply
    assert choice.tool_format == "llama3" and choice.parallel_tool_calls and not LLAMA3_FORMAT.parallel
    schema = choice.sampling["guided_json"]
    assert [o["required"] for o in schema["anyOf"]] == [["name", "parameters"]] * 2
    compiled = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    accepts = xgrammar.testing._is_grammar_accept_string
    assert accepts(compiled, LLAMA3_CALL)
    assert not accepts(compiled, CALL[0] + CALL[1])  # "arguments": the documented format's key
    assert not accepts(compiled, LLAMA3_CALL + "\n" + LLAMA3_CALL)


def test_llama3_replies_parse_into_tool_calls(smol_tokenizer):
    assert template_tool_format(smol_tokenizer) is JSON_FORMAT
    smol_tokenizer.chat_template = LLAMA3_TEMPLATE
    assert template_tool_format(smol_tokenizer) is LLAMA3_FORMAT
    for mode in ("auto", "forced"):
        chunks, whole = stream(mode, [LLAMA3_CALL[:20], LLAMA3_CALL[20:]], fmt="llama3")
        (call,) = chunks[-1]["delta"]["tool_calls"]
        assert call["function"] == {"name": "get_time", "arguments": json.dumps({"zone": "UTC"})}
        assert (
            whole["finish_reason"] == "tool_calls" and whole["message"]["tool_calls"][0]["function"] == call["function"]
        )
    # the documented format's key is text here, and so are two calls (one call per reply)
    for pieces in ([CALL[0] + CALL[1]], [LLAMA3_CALL + "\n", LLAMA3_CALL]):
        _, whole = stream("auto", pieces, fmt="llama3")
        assert whole["finish_reason"] == "stop" and whole["message"]["content"] == "".join(pieces)
    assert llama3_chat(smol_tokenizer, "auto").tool_format == "llama3"
    named = llama3_chat(smol_tokenizer, {"type": "function", "function": {"name": "get_weather"}})
    assert named.sampling["guided_json"]["properties"]["name"] == {"const": "get_weather"}


# ---- Llama 3.1's <|python_tag|> replies (swarm/api/llama_tools.py) --------------------------------

BUILTIN_NAMES = ("brave_search", "wolfram_alpha", "code_interpreter", "get_time")


@pytest.mark.parametrize(
    "reply, expected",
    [
        ('<|python_tag|>brave_search.call(query="weather in Oslo")', ("brave_search", {"query": "weather in Oslo"})),
        (
            "<|python_tag|>wolfram_alpha.call(query='100th decimal of pi')",
            ("wolfram_alpha", {"query": "100th decimal of pi"}),
        ),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', ("get_time", {"zone": "UTC"})),
        ('<|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}', ("get_time", {"zone": "UTC"})),
        (
            "<|python_tag|>def f(n):\n    return n + 1\nprint(f(1))",
            ("code_interpreter", {"code": "def f(n):\n    return n + 1\nprint(f(1))"}),
        ),
    ],
    ids=["brave_search", "wolfram_alpha", "json-parameters", "json-arguments", "code"],
)
def test_a_python_tag_reply_is_a_tool_call(reply, expected):
    from swarm.api.tools import tool_calls

    (call,) = tool_calls(reply, BUILTIN_NAMES, LLAMA3_FORMAT, parallel=False)
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == expected
    assert call["type"] == "function" and call["id"].startswith("call_")


@pytest.mark.parametrize(
    "reply, names",
    [
        ('<|python_tag|>rm_rf.call(path="/")', ("brave_search",)),  # not a listed tool
        ('<|python_tag|>brave_search.call(query=open("x").read())', ("brave_search",)),  # no literal value
        ('<|python_tag|>brave_search.call("positional")', ("brave_search",)),
        ("<|python_tag|>print(1)", ("brave_search",)),  # code without code_interpreter among the tools
        ('<|python_tag|>{"name": "rm_rf", "parameters": {}}', BUILTIN_NAMES),  # a JSON call of no listed tool
        ("<|python_tag|>", BUILTIN_NAMES),
        ('brave_search.call(query="x")', BUILTIN_NAMES),  # no tag: text
    ],
)
def test_a_python_tag_reply_that_is_no_call_of_a_listed_tool_is_text(reply, names):
    from swarm.api.tools import tool_calls

    assert tool_calls(reply, names, LLAMA3_FORMAT, parallel=False) is None
    chunks, whole = stream("auto", [reply[:9], reply[9:]], fmt="llama3", names=names)
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] == reply


def test_a_python_tag_call_streams_as_one_call():
    """ "auto": text is held while it may still be <|python_tag|> (the tag comes in pieces), then the
    call goes out whole with finish_reason "tool_calls"."""
    from swarm.api.tools import may_be_call

    assert may_be_call("<|py", LLAMA3_FORMAT) and may_be_call(" <|python_tag|>brave", LLAMA3_FORMAT)
    assert not may_be_call("<|pyx", LLAMA3_FORMAT) and not may_be_call("<|py", JSON_FORMAT)
    pieces = ["<|py", "thon_tag|>brave_search", '.call(query="Oslo")']
    chunks, whole = stream("auto", pieces, fmt="llama3", names=BUILTIN_NAMES)
    assert len(chunks) == 1 and chunks[0]["finish_reason"] == "tool_calls"
    (call,) = chunks[0]["delta"]["tool_calls"]
    assert call["function"] == {"name": "brave_search", "arguments": json.dumps({"query": "Oslo"})}
    assert whole["message"]["tool_calls"][0]["function"] == call["function"] and whole["message"]["content"] is None


def test_builtin_tools_go_to_the_template_as_builtin_tools(smol_tokenizer):
    """Tools named like Llama 3.1's built-ins are the template's builtin_tools (the system message's
    "Environment: ipython" and "Tools: ..."), the others its custom tools; an earlier built-in call is
    rendered by the template after <|python_tag|>, its result as an ipython turn."""
    import msgspec

    from swarm.api.engine import ServedModel
    from swarm.api.schemas import ChatRequest, chat_params

    smol_tokenizer.chat_template = LLAMA3_TEMPLATE
    config = SimpleNamespace(eos_token_id=2, vocab_size=len(smol_tokenizer), context_length=2048)
    served = ServedModel("m", SimpleNamespace(tokenizer=smol_tokenizer, config=config, context_length=2048))
    names = ("brave_search", "wolfram_alpha", "code_interpreter", "get_time")
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]
    search = {"id": "c1", "type": "function", "function": {"name": "brave_search", "arguments": '{"query": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [search]},
        {"role": "ipython", "tool_call_id": "c1", "content": "rain"},  # Llama 3.1's name for role "tool"
    ]
    body = {"model": "m", "messages": messages, "tools": tools, "tool_choice": "auto", "max_tokens": 8}
    (choice,), _ = chat_params(msgspec.convert(body, ChatRequest), served, 4)
    prompt = smol_tokenizer.decode(choice.prompt_ids)
    assert "Environment: ipython\nTools: brave_search, wolfram_alpha\n\n" in prompt
    assert '"name": "get_time"' in prompt and '"name": "brave_search"' not in prompt  # custom tools only
    assert '<|python_tag|>brave_search.call(query="Oslo")<|eom_id|>' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nrain<|eot_id|>" in prompt
    assert choice.tool_format == "llama3" and choice.tool_call == "auto" and choice.kept_tokens == ("<|python_tag|>",)
    # built-ins alone: no custom-tools block at all; without tools the template is as before
    alone = {**body, "tools": tools[:2]}
    (choice,), _ = chat_params(msgspec.convert(alone, ChatRequest), served, 4)
    prompt = smol_tokenizer.decode(choice.prompt_ids)
    assert "Tools: brave_search, wolfram_alpha" in prompt and "Respond in the format" not in prompt
    plain = {"model": "m", "messages": messages[:1], "max_tokens": 8}
    (choice,), _ = chat_params(msgspec.convert(plain, ChatRequest), served, 4)
    prompt = smol_tokenizer.decode(choice.prompt_ids)
    assert "Environment: ipython" not in prompt and "system<|end_header_id|>\n\nCutting Knowledge" in prompt
    assert choice.kept_tokens == ()


def test_the_detokenizer_keeps_the_python_tag_where_it_is_a_special_token(smol_tokenizer):
    """In Llama 3.1's vocabulary <|python_tag|> is a special token, which skip_special_tokens drops: a
    tool request's text keeps it (only it), so the reply can be read as a call."""
    from swarm.api.text import IncrementalDetokenizer

    smol_tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    ids = smol_tokenizer.encode('<|python_tag|>brave_search.call(query="x")<|im_end|>', add_special_tokens=False)
    assert ids[0] == smol_tokenizer.convert_tokens_to_ids("<|python_tag|>")

    def text(keep):
        detokenizer = IncrementalDetokenizer(smol_tokenizer, [1, 2], keep)
        return "".join(detokenizer.push(i) for i in ids) + detokenizer.flush()

    assert text(("<|python_tag|>",)) == '<|python_tag|>brave_search.call(query="x")'  # <|im_end|> still dropped
    assert text(()) == 'brave_search.call(query="x")'


def test_the_ipython_role_is_a_tool_result():
    import msgspec

    from swarm.api.schemas import ChatMessage, chat_messages

    given = msgspec.convert(
        [{"role": "ipython", "content": "rain"}, {"role": "developer", "content": "be brief"}], list[ChatMessage]
    )
    assert chat_messages(given) == [{"role": "tool", "content": "rain"}, {"role": "system", "content": "be brief"}]
