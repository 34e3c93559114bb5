"""Structured output as agent frameworks ask for it, against `qinfer serve` on the
embedded SmolLM2 (whose template knows no tools: the generic tool format).

LangChain's `with_structured_output(Model, method="function_calling")` sends the pydantic
model's JSON schema as a forced tool's `parameters`, without `additionalProperties` (and
nested models as `$defs`). Left open, the 135M model invents keys until max_tokens and the
framework gets an unparsable call (None); closed by default, it returns the object.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from gguf_files import smollm2_path
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from servers import serving

from qinfer.server.app import served_name


class City(BaseModel):
    """A city and its country."""

    name: str = Field(description="the city's name")
    country: str


class Trip(BaseModel):
    """A trip: where to, and for how many days."""

    destination: City
    days: int


@pytest.fixture(scope="module")
def served():
    """(base URL, model name) of `qinfer serve` with no model: the embedded SmolLM2."""
    model_name = served_name(smollm2_path())
    with serving() as server:
        yield server.url, model_name


@pytest.fixture(scope="module")
def llm(served) -> ChatOpenAI:
    url, model_name = served
    return ChatOpenAI(
        base_url=f"{url}/v1", api_key="none", model=model_name, temperature=0, max_retries=0
    )


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("schema", [City, Trip], ids=["flat", "nested"])
def test_langchain_function_calling_returns_the_parsed_object(llm, schema):
    structured = llm.with_structured_output(schema, method="function_calling", include_raw=True)
    out = structured.invoke("Tell me about a trip to Paris, France.")
    assert out["parsing_error"] is None and not out["raw"].invalid_tool_calls
    assert isinstance(out["parsed"], schema)
    city = out["parsed"] if schema is City else out["parsed"].destination
    assert isinstance(city, City) and city.name


def test_langchain_json_schema_output_returns_the_nested_object(llm):
    structured = llm.with_structured_output(Trip, method="json_schema")
    assert isinstance(structured.invoke("Plan a trip to Tokyo, Japan.").destination, City)


def test_a_forced_call_cut_by_max_tokens_is_no_tool_call(client, served):
    tool = {
        "type": "function",
        "function": {"name": "City", "parameters": City.model_json_schema()},
    }
    reply = client.chat.completions.create(
        model=served[1],
        messages=[{"role": "user", "content": "Tell me about Paris."}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "City"}},
        max_tokens=8,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "def f(", "suffix": "\n    return x"}, "suffix"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "high"},
            "reasoning_effort",
        ),
    ],
    ids=["suffix-without-fim-tokens", "reasoning-effort-without-thinking"],
)
def test_what_this_model_cannot_do_is_a_400_naming_the_field(served, path, body, param):
    url, model_name = served
    response = httpx.post(f"{url}{path}", json={"model": model_name, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # and the server keeps serving
