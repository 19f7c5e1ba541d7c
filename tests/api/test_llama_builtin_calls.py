"""Llama 3.1's built-in tool calls (swarm/api/llama_tools.py): a forced call constrained to the model's
own ``<|python_tag|>name.call(...)`` shape, several ``;``-separated calls read as several tool_calls,
and ``<|eom_id|>`` a stop token when built-in tools are on. The gateway tests use the real openai
client and a scripted model (SmolLM2's tokenizer with Llama 3.1's special tokens added); the grammar's
exactness runs on the tiny swarm against local transformers with xgrammar's own processor."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import openai
import pytest
import torch
import xgrammar

from client._calls import compiler_for
from client._token_stream import GeneratedChunk
from protocol.constraints import constraint_from_options
from swarm.api.app import Gateway, GatewayConfig
from swarm.api.engine import ServedModel
from swarm.api.errors import APIError
from swarm.api.llama_tools import EOM_ID, eom_token_id
from swarm.api.schemas import ChatRequest, chat_params
from swarm.api.tools import LLAMA3_FORMAT, builtin_call_grammar, tool_calls
from tests.api.test_api import GatewayThread
from tests.api.test_streamed_tool_calls import KEY, MODEL, TIME, ScriptedModel, recorded_prompts
from tests.api.test_tool_calls import LLAMA3_TEMPLATE, stream

BUILTINS = ("brave_search", "wolfram_alpha")
SEARCH, WOLFRAM = ({"type": "function", "function": {"name": n}} for n in BUILTINS)
CODE = {"type": "function", "function": {"name": "code_interpreter"}}
TWO = '<|python_tag|>brave_search.call(query="weather in Oslo"); wolfram_alpha.call(query="2+2")'
accepts = xgrammar.testing._is_grammar_accept_string


def accepts_ids(tokenizer, grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes ``text`` token by token (its ``<|eom_id|>`` the one special token, which
    the grammar names by id) to an end: the matcher then takes EOS or has ended."""
    compiled = compiler_for(tokenizer, len(tokenizer)).compile(constraint_from_options(guided_grammar=grammar))
    matcher = xgrammar.GrammarMatcher(compiled)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and (
        matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id)
    )


@pytest.fixture
def llama_tokenizer():
    """SmolLM2's tokenizer with the cut-down Llama 3.1 template and its two special tokens."""
    from transformers import AutoTokenizer

    from tests.kit.checkpoints import ensure_smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    tokenizer.chat_template = LLAMA3_TEMPLATE
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", EOM_ID]})
    return tokenizer


def chat_choice(tokenizer, tools, tool_choice, parallel=None):
    config = SimpleNamespace(eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))
    served = ServedModel("m", SimpleNamespace(tokenizer=tokenizer, config=config, context_length=2048))
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": tools}
    body.update(tool_choice=tool_choice, max_tokens=8)
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    (choice,), _ = chat_params(msgspec.convert(body, ChatRequest), served, 4)
    return choice


# ---- several calls after the tag -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "forced"])
def test_semicolon_separated_builtin_calls_are_several_tool_calls(mode):
    chunks, whole = stream(mode, [TWO[:30], TWO[30:70], TWO[70:] + EOM_ID], fmt="llama3", names=BUILTINS)
    expected = [("brave_search", {"query": "weather in Oslo"}), ("wolfram_alpha", {"query": "2+2"})]
    streamed = [c for chunk in chunks[:-1] for c in chunk.get("tool_calls", [])] + chunks[-1]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == [
        (i, *call) for i, call in enumerate(expected)
    ]
    assert chunks[-1]["finish_reason"] == "tool_calls" and not chunks[-1]["delta"].get("content")
    calls = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert len({c["id"] for c in calls}) == 2 and whole["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "rest",
    [
        ' rm_rf.call(path="/")',  # a piece that calls no listed tool
        " brave_search.call(query=input())",  # a piece whose value is no literal
        " brave_search.call(",  # a cut piece
        " print(1)",
    ],
)
def test_a_piece_that_is_no_call_ends_the_calls_and_is_text(rest):
    """Each complete call stands (streamed once its ";" has come, it cannot be taken back), and the
    first piece that is no call ends the calls: it and all after it are the reply's content, streamed
    and not alike, finish_reason "tool_calls"; a first piece that is no call leaves the whole reply text."""
    expected = [("brave_search", {"query": "weather in Oslo"}), ("wolfram_alpha", {"query": "2+2"})]
    reply = TWO + ";" + rest
    chunks, whole = stream("auto", [reply[:30], reply[30:70], reply[70:]], fmt="llama3", names=BUILTINS)
    deltas = chunks[:-1] + [chunks[-1]["delta"]]
    streamed = [
        (c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for d in deltas
        for c in d.get("tool_calls", [])
    ]
    assert streamed == [(i, *call) for i, call in enumerate(expected)] and "tool_calls" in deltas[0]
    assert "".join(d.get("content") or "" for d in deltas) == whole["message"]["content"] == rest
    calls = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert whole["finish_reason"] == chunks[-1]["finish_reason"] == "tool_calls"
    assert tool_calls(reply, BUILTINS, LLAMA3_FORMAT, True) is None  # the whole body is no list of calls
    first_wrong = "<|python_tag|>" + rest.strip() + '; brave_search.call(query="x")'
    chunks, whole = stream("auto", [first_wrong], fmt="llama3", names=BUILTINS)
    assert whole["message"] == {"role": "assistant", "content": first_wrong} and whole["finish_reason"] == "stop"
    assert chunks[-1]["delta"] == {"content": first_wrong}


def test_several_calls_with_code_interpreter_listed_are_still_calls_and_other_code_is_code():
    names = (*BUILTINS, "code_interpreter")
    assert [c["function"]["name"] for c in tool_calls(TWO, names, LLAMA3_FORMAT, True)] == list(BUILTINS)
    (code,) = tool_calls("<|python_tag|>x = 1; print(x)\n<|eom_id|>", names, LLAMA3_FORMAT, True)
    assert json.loads(code["function"]["arguments"]) == {"code": "x = 1; print(x)"}


def test_parallel_tool_calls_false_keeps_several_calls_as_text():
    assert tool_calls(TWO, BUILTINS, LLAMA3_FORMAT, False) is None
    _, whole = stream("auto", [TWO], fmt="llama3", names=BUILTINS, parallel=False)
    assert whole["message"]["content"] == TWO


# ---- the forced grammar and <|eom_id|> -------------------------------------------------------------


def test_a_named_builtin_is_forced_into_its_own_shape_ending_with_eom(llama_tokenizer):
    choice = chat_choice(
        llama_tokenizer, [SEARCH, WOLFRAM, TIME], {"type": "function", "function": {"name": "brave_search"}}
    )
    eom = llama_tokenizer.convert_tokens_to_ids(EOM_ID)
    assert choice.stop_token_ids == (eom,) == (eom_token_id(llama_tokenizer),)
    grammar = choice.sampling["guided_grammar"]
    assert "guided_json" not in choice.sampling and grammar.rstrip().splitlines()[1].endswith(f"Token({eom})")
    assert accepts_ids(llama_tokenizer, grammar, '<|python_tag|>brave_search.call(query="rain \\"today\\"")<|eom_id|>')
    for wrong in (
        '{"name": "brave_search", "parameters": {"query": "rain"}}',  # the JSON shape of custom tools
        '<|python_tag|>wolfram_alpha.call(query="rain")<|eom_id|>',  # not the named tool
        '<|python_tag|>brave_search.call(query="rain")',  # no <|eom_id|>
        '<|python_tag|>brave_search.call(query="rain")<|eo',  # <|eom_id|> spelled in pieces is not the token
        '<|python_tag|>brave_search.call(query="a"); brave_search.call(query="b")<|eom_id|>',  # one call by default
        "<|python_tag|>brave_search.call(query=rain)<|eom_id|>",  # no literal
    ):
        assert not accepts_ids(llama_tokenizer, grammar, wrong), wrong
    several = chat_choice(llama_tokenizer, [SEARCH, WOLFRAM], "required", parallel=True)
    assert accepts_ids(llama_tokenizer, several.sampling["guided_grammar"], TWO + EOM_ID)


def test_required_with_builtins_and_custom_tools_takes_either_shape(llama_tokenizer):
    choice = chat_choice(llama_tokenizer, [SEARCH, CODE, TIME], "required")
    grammar = choice.sampling["guided_grammar"]
    assert accepts_ids(llama_tokenizer, grammar, '<|python_tag|>brave_search.call(query="x")<|eom_id|>')
    code = "<|python_tag|>import math\nprint(math.pi)<|eom_id|>"  # code_interpreter: free code
    assert accepts_ids(llama_tokenizer, grammar, code)
    assert accepts_ids(llama_tokenizer, grammar, '{"name": "get_time", "parameters": {}}')  # a custom tool: its JSON
    assert not accepts_ids(llama_tokenizer, grammar, '{"name": "brave_search", "parameters": {}}')


def test_typed_arguments_and_no_eom_without_the_token(llama_tokenizer):
    tools = {"wolfram_alpha": {"parameters": {"properties": {"query": {"type": "string"}, "n": {"type": "integer"}}}}}
    grammar = xgrammar.Grammar.from_ebnf(builtin_call_grammar(tools, ["wolfram_alpha"], ["wolfram_alpha"], False, None))
    assert accepts(grammar, '<|python_tag|>wolfram_alpha.call(query="pi", n=-3)')
    assert not accepts(grammar, '<|python_tag|>wolfram_alpha.call(query="pi", n="3")')
    flags = {"properties": {"city": {"enum": ["Oslo", 'a "b"']}, "fast": {"type": "boolean"}}, "required": ["city"]}
    grammar = xgrammar.Grammar.from_ebnf(
        builtin_call_grammar({"brave_search": {"parameters": flags}}, ["brave_search"], ["brave_search"], False, None)
    )
    assert accepts(grammar, '<|python_tag|>brave_search.call(city="a \\"b\\"")')  # only the required keyword
    assert not accepts(grammar, '<|python_tag|>brave_search.call(city="Rome")')
    llama_tokenizer.chat_template = LLAMA3_TEMPLATE
    plain = chat_choice(llama_tokenizer, [TIME], "auto")
    from transformers import AutoTokenizer

    from tests.kit.checkpoints import ensure_smollm2_checkpoint

    assert eom_token_id(AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())) is None  # a vocabulary without it
    assert plain.stop_token_ids == ()  # no built-in tools: <|eom_id|> is no stop
    bad = {"type": "function", "function": {"name": "brave_search", "parameters": {"properties": {"a b": {}}}}}
    with pytest.raises(APIError, match="no Python keyword") as raised:
        chat_choice(llama_tokenizer, [bad], "required")
    assert raised.value.param == "tools"


class StoppingModel(ScriptedModel):
    """A scripted model that stops after a token in ``eos_token_id`` (what the client does) and
    records the sampling arguments (the constraint) and stop ids it was asked with."""

    asked: list = []

    async def agenerate_stream(self, prompt_ids, max_new_tokens, eos_token_id=None, num_logprobs=0, **sampling):
        self.asked.append((eos_token_id, sampling))
        stops = [self.tokenizer.eos_token_id] if eos_token_id is None else eos_token_id
        for piece in self.pieces:
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
            yield GeneratedChunk(ids[:cut], [], self.stats)
            if cut is not None:
                return
        yield GeneratedChunk([self.tokenizer.eos_token_id], [], self.stats)

    @property
    def stats(self):
        from client import GenerationStats

        return GenerationStats()


def test_forced_builtin_calls_through_the_openai_client(llama_tokenizer):
    """A forced call of two built-ins (parallel_tool_calls true): the gateway sends the built-in grammar
    and <|eom_id|> among the stop ids; the scripted reply (which that grammar accepts token by token)
    ends at <|eom_id|> (the text after it is never produced) and comes back as two tool_calls with
    finish_reason "tool_calls", streamed and not; the next turn renders the call after the tag."""
    model = StoppingModel(llama_tokenizer, [TWO[:40], TWO[40:] + EOM_ID, " and then some text"])
    model.asked = []
    prompts = recorded_prompts(model, llama_tokenizer)
    eom = llama_tokenizer.convert_tokens_to_ids(EOM_ID)
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig(api_keys=frozenset({KEY})))) as served:
        client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=240)
        ask = [{"role": "user", "content": "weather in Oslo, and 2+2?"}]
        kwargs = dict(model=MODEL, tools=[SEARCH, WOLFRAM, TIME], tool_choice="required", max_tokens=60)
        answer = client.chat.completions.create(messages=ask, parallel_tool_calls=True, **kwargs).choices[0]
        expected = [("brave_search", {"query": "weather in Oslo"}), ("wolfram_alpha", {"query": "2+2"})]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        calls = answer.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
        chunks = [
            c.choices[0]
            for c in client.chat.completions.create(messages=ask, parallel_tool_calls=True, stream=True, **kwargs)
            if c.choices
        ]
        streamed = [d for c in chunks for d in c.delta.tool_calls or []]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in streamed] == [
            (i, *call) for i, call in enumerate(expected)
        ]
        assert chunks[-1].finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)
        turn = ask + [
            {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "rain"},
        ]
        client.chat.completions.create(messages=turn, **{**kwargs, "tool_choice": "auto"})
    (stops, sampling), _, (auto_stops, auto_sampling) = model.asked
    assert eom in stops and llama_tokenizer.eos_token_id in stops and eom in auto_stops
    assert "guided_grammar" not in auto_sampling
    compiled = compiler_for(llama_tokenizer, len(llama_tokenizer)).compile(
        constraint_from_options(guided_grammar=sampling["guided_grammar"])
    )
    matcher = xgrammar.GrammarMatcher(compiled)
    reply = llama_tokenizer.encode(TWO + EOM_ID, add_special_tokens=False)
    assert reply[0] == llama_tokenizer.convert_tokens_to_ids("<|python_tag|>") and reply[-1] == eom
    assert all(matcher.accept_token(t) for t in reply)  # the scripted reply is one the constraint allows
    assert '<|python_tag|>brave_search.call(query="weather in Oslo")<|eom_id|>' in prompts[-1]


# ---- exactness on the tiny swarm -------------------------------------------------------------------


FREE = {"type": "object"}  # no parameters: brave_search.call(query="<any string>")
CITIES = {"type": "object", "properties": {"query": {"enum": ["Oslo", "Paris"]}, "days": {"type": "integer"}}}


@pytest.mark.parametrize("parameters", [FREE, CITIES], ids=["free query", "enum"])
def test_the_builtin_grammar_on_the_swarm_equals_transformers(tiny_model, tiny_reference, parameters):
    """The forced built-in grammar is one more constraint at the tail: the swarm's greedy tokens equal
    local transformers with xgrammar's processor. The tiny random model writes a free query until
    max_tokens; with an enum it finishes, and the reply parses into the forced call. SmolLM2's vocabulary
    has no <|eom_id|>, so EOS ends the call (the token's own ending: the next test)."""
    from tests.generation.test_constraints import transformers_greedy
    from tests.kit.routes import ROUTES, pinned

    tools = {"brave_search": {"parameters": parameters}, "get_time": {"parameters": FREE}}
    kwargs = dict(guided_grammar=builtin_call_grammar(tools, ["brave_search"], ["brave_search"], False, None))
    prompt = tiny_model.tokenizer("Search the weather:", add_special_tokens=False).input_ids
    expected = transformers_greedy(tiny_reference, tiny_model, kwargs, prompt, 56)
    with pinned(tiny_model, ROUTES["three servers, uneven"]):
        output = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=56, **kwargs)
    assert output[0, len(prompt) :].tolist() == expected
    text = tiny_model.tokenizer.decode(expected, skip_special_tokens=True)
    assert text.startswith('<|python_tag|>brave_search.call(query="')
    if parameters is CITIES:
        assert expected[-1] == tiny_model.config.eos_token_id and text.endswith(")")
        (call,) = tool_calls(text, tuple(tools), LLAMA3_FORMAT, True)
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "brave_search" and arguments["query"] in ("Oslo", "Paris")
        assert isinstance(arguments["days"], int)


# ---- <|eom_id|> as one token: the tail's matcher and the client stop at it together ----------------


@pytest.fixture(scope="module")
def eom_swarm(tmp_path_factory):
    """Two in-process servers of a tiny Llama whose tokenizer has Llama 3.1's <|python_tag|> and
    <|eom_id|> as single special tokens and the cut-down Llama 3.1 template (the tail loads its
    constraint tokenizer from this checkpoint), and the same model locally in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.kit.checkpoints import build_tiny_llama, ensure_smollm2_checkpoint
    from tests.kit.swarms import start_inprocess

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    tokenizer.chat_template = LLAMA3_TEMPLATE
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", EOM_ID]})
    path = build_tiny_llama(tmp_path_factory.mktemp("eom") / "tiny-llama-eom", tokenizer=tokenizer)
    swarm = start_inprocess(path)
    try:
        yield swarm.model, AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    finally:
        swarm.stop()


def eom_reference(reference, tokenizer, grammar, prompt, stops, sample):
    """transformers generating with xgrammar's own processor over a TokenizerInfo whose stop ids are
    ``stops`` (EOS and <|eom_id|>): greedy, or drawn with the (seed, position) generator of the exact rule."""
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper
    from xgrammar.contrib.hf import LogitsProcessor

    from protocol.seeded_draws import seeded_choice

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=stops)
    processors = [LogitsProcessor(xgrammar.GrammarCompiler(info).compile_grammar(grammar))]
    if sample:
        processors.append(TemperatureLogitsWarper(sample["temperature"]))
    processors, tokens = LogitsProcessorList(processors), list(prompt)
    while len(tokens) < len(prompt) + 40 and tokens[-1] not in stops:
        with torch.no_grad():
            scores = processors(torch.tensor([tokens]), reference(torch.tensor([tokens])).logits[:, -1].float())
        if sample:
            drawn = seeded_choice(torch.softmax(scores[0], -1), sample["seed"], len(tokens))
            tokens.append(int(drawn))
        else:
            tokens.append(int(scores[0].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("sample", [None, dict(do_sample=True, temperature=1.5, seed=7)], ids=["greedy", "sampled"])
def test_a_forced_builtin_call_ends_at_the_eom_token_on_the_swarm(eom_swarm, sample, monkeypatch):
    """Where <|eom_id|> is one token, the gateway's forced built-in grammar ends with that token (never
    its text in pieces) and makes it a stop id of the call; the client sends it as a stop id of the
    constraint, so the tail's matcher takes it as a stop. The swarm's tokens (grammar drafts on, the
    matcher's forced tokens drafted) equal transformers with xgrammar's processor whose stop ids are EOS
    and <|eom_id|>; the output ends exactly at <|eom_id|> (once, last), the tail's matcher terminated
    there in an accepting state, and the reply parses into the forced call."""
    from server.constraints import TailConstraints

    model, reference = eom_swarm
    tail_guides = []  # the Guides the tail (an in-process server) made for this generation's session
    made = TailConstraints.guide

    def recorded(self, constraint, start, requester=None):
        tail_guides.append(made(self, constraint, start, requester))
        return tail_guides[-1]

    monkeypatch.setattr(TailConstraints, "guide", recorded)
    tokenizer = model.tokenizer
    eom, eos = tokenizer.convert_tokens_to_ids(EOM_ID), tokenizer.eos_token_id
    parameters = {"type": "object", "properties": {"query": {"enum": ["Oslo", "Paris"]}, "fast": {"type": "boolean"}}}
    tools = [{"type": "function", "function": {"name": "brave_search", "parameters": parameters}}, TIME]
    choice = chat_choice(tokenizer, tools, {"type": "function", "function": {"name": "brave_search"}})
    grammar, stops = choice.sampling["guided_grammar"], sorted({eos, *choice.stop_token_ids})
    assert choice.stop_token_ids == (eom,) and f"Token({eom})" in grammar
    expected = eom_reference(reference, tokenizer, grammar, choice.prompt_ids, stops, sample)
    kwargs = dict(sample or {})
    output = model.generate(
        torch.tensor([choice.prompt_ids]), max_new_tokens=40, eos_token_id=stops, guided_grammar=grammar, **kwargs
    )[0, len(choice.prompt_ids) :].tolist()
    assert output == expected and output[-1] == eom and output.count(eom) == 1 and eos not in output
    (tail_guide,) = tail_guides
    assert tail_guide.constraint.stop_token_ids == (eom,)  # what the client sent the tail
    context = choice.prompt_ids + output
    assert not tail_guide.ended(context[:-1]) and tail_guide.ended(context)  # it ends at <|eom_id|>, not before
    text = tokenizer.decode(output, skip_special_tokens=False)
    (call,) = tool_calls(text, ("brave_search", "get_time"), LLAMA3_FORMAT, True)
    assert call["function"]["name"] == "brave_search"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["query"] in ("Oslo", "Paris") and isinstance(arguments["fast"], bool)


# ---- a forced reply's built-in calls stream one by one ----------------------------------------------


def test_forced_builtin_calls_stream_each_once_complete(llama_tokenizer):
    """A forced reply of several built-in calls (parallel_tool_calls true): the scripted model writes the
    first call and its ";" (a ";" inside its string is no separator), then waits until the client has
    received that call before it writes the second; the stream's tool_calls deltas (index 0, 1) arrive
    before its last chunk and hold what the non-streamed response holds."""
    first, second = '<|python_tag|>brave_search.call(query="rain; Oslo"); ', 'wolfram_alpha.call(query="2+2")' + EOM_ID
    model = ScriptedModel(llama_tokenizer, [first, second])
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig(api_keys=frozenset({KEY})))) as served:
        client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=240)
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "rain in Oslo, and 2+2?"}], max_tokens=60)
        kwargs.update(tools=[SEARCH, WOLFRAM], tool_choice="required", parallel_tool_calls=True)
        chunks = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                chunks.append(chunk.choices[0])
                if chunk.choices[0].delta.tool_calls:
                    model.go_on.set()  # the first call is here: the script may write the second
        model.go_on.set()
        answer = client.chat.completions.create(**kwargs).choices[0]
    assert model.waited == [True, True], "the first call was not streamed before the second was written"
    streamed = [(i, d) for i, c in enumerate(chunks) for d in c.delta.tool_calls or []]
    assert [d.index for _, d in streamed] == [0, 1] and streamed[0][0] < len(chunks) - 1
    expected = [("brave_search", {"query": "rain; Oslo"}), ("wolfram_alpha", {"query": "2+2"})]
    assert [(d.function.name, json.loads(d.function.arguments)) for _, d in streamed] == expected
    assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls] == expected
    assert chunks[-1].finish_reason == answer.finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)
    assert answer.message.content is None
