"""Every request parameter the gateway cannot honour is refused with a 400 naming it, never dropped
(issue #38's audit): the ones no other test sends, checked at validation (no swarm, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from swarm.api.engine import ServedModel
from swarm.api.errors import APIError
from swarm.api.schemas import ChatRequest, CompletionRequest, chat_params, completion_params

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CHAT_REFUSED = [
    ("functions", dict(functions=[{"name": "f"}])),
    ("function_call", dict(function_call="auto")),
    ("modalities", dict(modalities=["text", "audio"])),
    ("audio", dict(audio={"voice": "alloy"})),
    ("tool_choice", dict(tool_choice={"type": "function", "function": {"name": "get_time"}})),  # no tools
    ("tool_choice", dict(tools=[TOOL], tool_choice="sometimes")),
    ("tools", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}], tool_choice="required")),
    ("tool_choice", dict(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"})),
    ("guided_choice", dict(response_format={"type": "json_object"}, guided_choice=["a"])),
    ("min_p", dict(min_p=1.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("logit_bias", dict(logit_bias={"10000000": 1})),  # outside the vocabulary
]


@pytest.fixture(scope="module")
def served():
    """A served model for validation only: SmolLM2's tokenizer, no swarm (loaded once for the module)."""
    from transformers import AutoTokenizer

    from tests.kit.checkpoints import ensure_smollm2_checkpoint

    smol_tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    config = SimpleNamespace(eos_token_id=smol_tokenizer.eos_token_id, vocab_size=len(smol_tokenizer))
    return ServedModel("m", SimpleNamespace(tokenizer=smol_tokenizer, config=config, context_length=2048))


@pytest.mark.parametrize("param, fields", CHAT_REFUSED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CHAT_REFUSED)])
def test_chat_parameters_refused_by_name(served, param, fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    with pytest.raises(APIError) as raised:
        chat_params(msgspec.convert(body, ChatRequest), served, 4)
    assert raised.value.status == 400 and raised.value.param == param, raised.value


def test_completion_suffix_refused_by_name(served):
    body = {"model": "m", "prompt": "def f():", "max_tokens": 4, "suffix": "return 1"}
    with pytest.raises(APIError) as raised:
        completion_params(msgspec.convert(body, CompletionRequest), served, 4)
    assert raised.value.param == "suffix"
