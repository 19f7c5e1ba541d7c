"""A constrained reply that ends at a stop token where its constraint cannot end says so: the tail
allows only the stop token at a dead end (a mask with no id left, protocol/constraints.py
``Guide.apply``; tests/generation/test_constraints.py, ``test_a_dead_end_allows_only_the_stop_token``),
and the gateway reads the reply with its own matcher, so ``finish_reason`` is ``constraint_dead_end``
instead of ``stop``, streamed and not, through the real openai client. A scripted model stands in for
the swarm at the dead end: it writes part of the only choice, then EOS."""

from __future__ import annotations

import openai
import pytest

from swarm.api.app import Gateway, GatewayConfig
from swarm.api.engine import DEAD_END
from tests.api.test_api import GatewayThread
from tests.api.test_streamed_tool_calls import KEY, MODEL, ScriptedModel, smol_tokenizer  # noqa: F401 (fixture)


@pytest.mark.parametrize("pieces, finish", [(["yes"], DEAD_END), (["yes", " please"], "stop")])
def test_a_dead_end_is_named_in_finish_reason(smol_tokenizer, pieces, finish):  # noqa: F811
    model = ScriptedModel(smol_tokenizer, pieces)
    model.go_on.set()
    with GatewayThread(Gateway({MODEL: model}, GatewayConfig(api_keys=frozenset({KEY})))) as served:
        client = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=240)
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "ok?"}], max_tokens=8)
        kwargs["extra_body"] = {"guided_choice": ["yes please"]}
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        text = client.completions.create(model=MODEL, prompt="ok?", max_tokens=8, extra_body=kwargs["extra_body"])
    assert whole.message.content == "".join(pieces) == "".join(c.delta.content or "" for c in chunks)
    assert whole.finish_reason == chunks[-1].finish_reason == text.choices[0].finish_reason == finish
