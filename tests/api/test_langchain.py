"""LangChain's ``with_structured_output`` against the gateway, as an agent framework calls it: its
default method (OpenAI's ``response_format`` ``json_schema``) and ``function_calling`` (a named
``tool_choice``) both come back as the pydantic object, parsed and validated by LangChain itself.
No network at run time: ChatOpenAI imports tiktoken but needs its encodings only to count tokens
locally, which ``invoke`` does not."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.api.test_api import KEY, MODEL, gateway, no_route_model  # noqa: F401 (fixtures)

langchain_openai = pytest.importorskip("langchain_openai")  # in the dev extra (setup.cfg)


class City(BaseModel):
    """A city and its country (bounded, so that a small model's answer ends)."""

    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_object(gateway, method):  # noqa: F811
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=gateway.url, api_key=KEY, temperature=0, max_tokens=60, max_retries=0, timeout=240
    )
    structured = llm.with_structured_output(City, method=method)
    first = structured.invoke("Which city is the capital of Norway? Answer with the city and its country.")
    assert isinstance(first, City) and 0 < len(first.name) <= 12 and 0 < len(first.country) <= 12
    assert structured.invoke("Which city is the capital of Norway? Answer with the city and its country.") == first
