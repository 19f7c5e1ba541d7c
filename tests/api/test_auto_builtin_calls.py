"""Llama 3.1 built-in calls under ``tool_choice="auto"`` stream like forced ones: the text before
``<|python_tag|>`` goes out as content as it comes, and each call after the tag in its own
``tool_calls`` delta as soon as the ``;`` (or newline) after it has come; the streamed reply reassembles
to the non-streamed response. Through the real openai client, with a scripted model that writes each
next piece only once the client has what the previous one completed (a gateway that held the text or
the first call to the end would leave it waiting)."""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from client import GenerationStats
from client._token_stream import GeneratedChunk
from swarm.api.app import Gateway, GatewayConfig
from tests.api.test_api import GatewayThread
from tests.api.test_llama_builtin_calls import BUILTINS, SEARCH, WOLFRAM, llama_tokenizer  # noqa: F401 (fixture)
from tests.api.test_streamed_tool_calls import KEY, MODEL, TIME, WAIT_S
from tests.api.test_tool_calls import stream

PREFIX = "Let me look both up. "
FIRST = '<|python_tag|>brave_search.call(query="rain; Oslo"); '  # a ";" inside the string is no separator
SECOND = 'wolfram_alpha.call(query="2+2")<|eom_id|>'
EXPECTED = [("brave_search", {"query": "rain; Oslo"}), ("wolfram_alpha", {"query": "2+2"})]


class GatedModel:
    """Stands in for the swarm model: one lap per piece, then EOS; before piece i (i >= 1) it waits,
    at most WAIT_S, for ``gates[i - 1]``; ``waited`` records whether each gate was open in time."""

    def __init__(self, tokenizer, pieces: list[str]):
        self.tokenizer, self.pieces = tokenizer, pieces
        self.config = type("Config", (), {"eos_token_id": tokenizer.eos_token_id, "vocab_size": len(tokenizer)})()
        self.context_length = 2048
        self.gates = [threading.Event() for _ in pieces[1:]]
        self.waited: list[bool] = []

    async def agenerate_stream(self, prompt_ids, max_new_tokens, eos_token_id=None, num_logprobs=0, **sampling):
        for i, piece in enumerate(self.pieces):
            if i:
                for _ in range(int(WAIT_S / 0.05)):
                    if self.gates[i - 1].is_set():
                        break
                    await asyncio.sleep(0.05)
                self.waited.append(self.gates[i - 1].is_set())
            yield GeneratedChunk(self.tokenizer.encode(piece, add_special_tokens=False), [], GenerationStats())
        yield GeneratedChunk([self.tokenizer.eos_token_id], [], GenerationStats())


def test_auto_builtin_calls_stream_each_once_complete(llama_tokenizer):  # noqa: F811
    """ "auto" (no constraint): the text before the tag arrives before the tag is written, the first
    call (its ";" come) before the second is written; the calls (index 0, 1, distinct ids), the content
    and finish_reason "tool_calls" equal the non-streamed response's."""
    model = GatedModel(llama_tokenizer, [PREFIX, FIRST, SECOND])
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig(api_keys=frozenset({KEY})))) as served:
        client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=240)
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "rain in Oslo, and 2+2?"}], max_tokens=60)
        kwargs.update(tools=[SEARCH, WOLFRAM, TIME], tool_choice="auto", parallel_tool_calls=True)
        chunks = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                chunks.append(chunk.choices[0])
                if chunk.choices[0].delta.content:
                    model.gates[0].set()  # the text is here: the script may write the tag and the first call
                if chunk.choices[0].delta.tool_calls:
                    model.gates[1].set()  # the first call is here: the script may write the second
        for gate in model.gates:
            gate.set()
        answer = client.chat.completions.create(**kwargs).choices[0]
    assert model.waited[:2] == [True, True], "the text or the first call was not streamed before the next piece"
    streamed = [(i, d) for i, c in enumerate(chunks) for d in c.delta.tool_calls or []]
    assert [d.index for _, d in streamed] == [0, 1] and streamed[0][0] < len(chunks) - 1
    assert [(d.function.name, json.loads(d.function.arguments)) for _, d in streamed] == EXPECTED
    assert len({d.id for _, d in streamed}) == 2
    calls = answer.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED
    assert "".join(c.delta.content or "" for c in chunks) == answer.message.content == PREFIX
    assert chunks[-1].finish_reason == answer.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "pieces, content, calls",
    [
        # the tag spelled in pieces (a vocabulary without it as one token): its start is held back
        (["Sure. <|py", 'thon_tag|>brave_search.call(query="a")'], "Sure. ", [("brave_search", {"query": "a"})]),
        (["Sure. <|py", "x|> no tag"], "Sure. <|pyx|> no tag", []),
        # newline-separated calls after text
        (["Two:", '<|python_tag|>brave_search.call(query="a")\n', 'wolfram_alpha.call(query="b")'], "Two:",
         [("brave_search", {"query": "a"}), ("wolfram_alpha", {"query": "b"})]),
        # after the tag, no call: the whole reply is text
        (["Here: ", "<|python_tag|>print(1)"], "Here: <|python_tag|>print(1)", []),
    ],
)  # fmt: skip
def test_text_before_the_tag_is_content_streamed_and_not(pieces, content, calls):
    chunks, whole = stream("auto", pieces, fmt="llama3", names=BUILTINS)
    deltas = chunks[:-1] + [chunks[-1]["delta"]]
    streamed = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for d in deltas for c in d.get("tool_calls", [])
    ]
    assert "".join(d.get("content") or "" for d in deltas) == (whole["message"]["content"] or "") == content
    assert (
        streamed
        == calls
        == [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["message"].get("tool_calls") or []
        ]
    )
    assert whole["finish_reason"] == chunks[-1]["finish_reason"] == ("tool_calls" if calls else "stop")
    assert deltas[0]["content"] == pieces[0].split("<|")[0]  # the text before the tag went out with its lap
