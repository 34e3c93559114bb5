"""The OpenAI Responses API (`POST /v1/responses`) against `qinfer serve`, through the real
`openai` client's `responses.create` and `responses.stream`.

The server runs the planted Qwen3 (tests/planted_qwen3.py): greedy, it thinks "The answer"
and answers "Hello" after any chat prompt, so reasoning items and text are known without
a trained model; tool calls and JSON come from grammars (`tool_choice` "required",
`text.format`), whatever the random weights would write. Prompts are checked against the
chat completions endpoint, whose template rendering tests/test_tool_call_formats.py
checks against transformers.
"""

from __future__ import annotations

import json
import signal
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from planted_qwen3 import PLANTED_ANSWER, PLANTED_REASONING, build_planted_qwen3
from servers import assert_aborted_streams_free_their_requests, chat_usage, serving

import qinfer
from qinfer.server.openai.responses_request import MAX_INPUT_ITEMS

MODEL = "tiny"
KEY = "responses-key"
NO_THINKING = {"effort": "none"}
THINKING = {"effort": "high"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
FORECAST = WEATHER["parameters"]


class Forecast(pydantic.BaseModel):
    """FORECAST as a pydantic model, the client's `text_format`."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris", "Tokyo"]
    days: int = pydantic.Field(ge=1, le=7)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, httpx client, checkpoint folder) of `qinfer serve` on the planted
    Qwen3, with an API key."""
    folder = build_planted_qwen3(tmp_path_factory.mktemp("responses"), max_position_embeddings=4096)
    with serving(
        *("--model", str(folder), "--served-model-name", MODEL, "--max-model-len", "4096"),
        *("--api-key", KEY),
    ) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
            yield client, http, folder


@pytest.fixture(scope="module")
def tokenizer(served):
    return qinfer.load_tokenizer(served[2])


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served[0]


@pytest.fixture(scope="module")
def http(served) -> httpx.Client:
    return served[1]


def create(client, **fields):
    fields.setdefault("reasoning", NO_THINKING)
    return client.responses.create(model=MODEL, temperature=0, **fields)


def stream(client, **fields) -> tuple[list, object]:
    """(every event, the final response) of a streamed response."""
    fields.setdefault("reasoning", NO_THINKING)
    with client.responses.stream(model=MODEL, temperature=0, **fields) as events:
        seen = list(events)
    return seen, seen[-1].response


def shape(output) -> list[tuple]:
    """Each output item as (type, status, its text or call)."""
    shaped = []
    for item in output:
        if item.type == "reasoning":
            shaped.append((item.type, item.status, "".join(c.text for c in item.content)))
        elif item.type == "message":
            shaped.append((item.type, item.status, "".join(c.text for c in item.content)))
        else:
            shaped.append((item.type, item.status, item.name, item.arguments))
    return shaped


# --- text and reasoning ----------------------------------------------------------------


def test_text_input_is_answered_as_chat_completions_answer_it(client):
    response = create(client, input="Hello world")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.output_text == PLANTED_ANSWER
    assert shape(response.output) == [("message", "completed", PLANTED_ANSWER)]
    expected = chat_usage(client, MODEL, [{"role": "user", "content": "Hello world"}])
    assert response.usage.input_tokens == expected.prompt_tokens
    assert response.usage.output_tokens == expected.completion_tokens
    assert response.usage.total_tokens == expected.total_tokens


def test_instructions_are_a_system_message(client):
    response = create(client, instructions="Be brief.", input="Hello world")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world"},
    ]
    assert (
        response.usage.input_tokens
        == chat_usage(client, MODEL, messages, max_tokens=1).prompt_tokens
    )


def test_reasoning_effort_turns_thinking_on_and_returns_a_reasoning_item(client, tokenizer):
    response = create(client, input="Hello world", reasoning=THINKING)
    assert shape(response.output) == [
        ("reasoning", "completed", PLANTED_REASONING),
        ("message", "completed", PLANTED_ANSWER),
    ]
    assert response.output_text == PLANTED_ANSWER
    thought = len(tokenizer.encode(f"<think>{PLANTED_REASONING}</think>"))
    assert response.usage.output_tokens_details.reasoning_tokens == thought


def test_stream_sends_the_documented_events_and_the_same_response(client):
    whole = create(client, input="Hello world", reasoning=THINKING)
    events, final = stream(client, input="Hello world", reasoning=THINKING)
    kinds = [event.type for event in events]
    deltas = [i for i, kind in enumerate(kinds) if kind.endswith(".delta")]
    # Each run of deltas shown once: the order of the events, not how many deltas.
    collapsed = [kind for i, kind in enumerate(kinds) if i - 1 not in deltas or i not in deltas]
    item = ["response.output_item.added", "response.content_part.added"]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        *item,
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *item,
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (PLANTED_REASONING, PLANTED_ANSWER)
    assert shape(final.output) == shape(whole.output)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert len({event.response.id for event in events if hasattr(event, "response")}) == 1


def test_a_long_greedy_text_streams_as_it_is_whole(client):
    # Inside a JSON string the random model writes 60 tokens of its own, not the path.
    text = {"format": {"type": "json_schema", "name": "s", "schema": {"type": "string"}}}
    fields = dict(input="Hello world", text=text, max_output_tokens=60)
    whole = create(client, **fields)
    events, final = stream(client, **fields)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 10 and "".join(deltas) == final.output_text == whole.output_text
    assert whole.usage.output_tokens == final.usage.output_tokens == 60


def test_max_output_tokens_ends_incomplete_streamed_alike(client):
    fields = dict(input="Hello world", reasoning=THINKING, max_output_tokens=3)
    whole = create(client, **fields)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3
    [(kind, status, text)] = shape(whole.output)  # cut inside the think block
    assert (kind, status) == ("reasoning", "incomplete") and PLANTED_REASONING.startswith(text)
    events, final = stream(client, **fields)
    assert events[-1].type == "response.incomplete"
    assert shape(final.output) == shape(whole.output)


# --- JSON ------------------------------------------------------------------------------


def test_json_schema_format_makes_json_that_validates_streamed_alike(client):
    text = {"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST}}
    whole = create(client, input="Weather?", text=text)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), FORECAST)
    # The client's own schema from a pydantic model, parsed by the client, whole and streamed.
    fields = dict(model=MODEL, input="Weather?", temperature=0, reasoning=NO_THINKING)
    parsed = client.responses.parse(text_format=Forecast, **fields)
    with client.responses.stream(text_format=Forecast, **fields) as events:
        final = events.get_final_response()
    assert isinstance(parsed.output_parsed, Forecast)
    assert final.output_text == parsed.output_text
    assert final.output_parsed == parsed.output_parsed


def test_json_object_format_starts_an_object(client):
    # Unbounded keys let the random model write one for ever: the start shows the format.
    fields = dict(input="Weather?", text={"format": {"type": "json_object"}}, max_output_tokens=4)
    assert create(client, **fields).output_text.startswith("{")


# --- tools -----------------------------------------------------------------------------


def test_function_call_round_trip_by_previous_response_id_or_by_items(client, http):
    first = create(
        client,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), FORECAST)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}
    by_id = create(client, previous_response_id=first.id, input=[result], tools=[WEATHER])
    assert by_id.output_text == PLANTED_ANSWER and by_id.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18C, sunny"},
    ]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    expected = chat_usage(client, MODEL, messages, max_tokens=1, tools=chat_tools).prompt_tokens
    assert by_id.usage.input_tokens == expected
    # The same turn with the items sent back by the client, nothing stored.
    unstored = create(
        client,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        store=False,
    )
    items = [{"role": "user", "content": "Weather in Paris?"}, *first.output, result]
    by_items = create(client, input=items, tools=[WEATHER])
    assert by_items.usage.input_tokens == expected
    body = {"model": MODEL, "input": [result], "previous_response_id": unstored.id}
    error = http.post("/v1/responses", json=body).json()["error"]
    assert error["param"] == "previous_response_id" and unstored.id in error["message"]


def test_streamed_call_arguments_add_up_to_the_whole_call(client):
    fields = dict(
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    whole = create(client, **fields)
    events, final = stream(client, **fields)
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == whole.output[0].arguments
    assert shape(final.output) == shape(whole.output)
    assert events[-1].type == "response.completed"


def forced_response(client, streamed: bool, **fields):
    """The response to a forced call of WEATHER, whole or the stream's final one (parallel
    calls at their default unless `fields` say otherwise)."""
    fields = dict(input="Weather in Paris?", tools=[WEATHER], tool_choice="required") | fields
    if not streamed:
        return create(client, **fields)
    events, final = stream(client, **fields)
    assert events[-1].type == f"response.{final.status}"
    return final


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_ends_the_response_once_it_repeats(client, streamed):
    """Parallel calls allowed, the planted model writes its call again: the response ends
    as soon as the repeat's arguments are complete, with the one call."""
    one = forced_response(client, streamed, parallel_tool_calls=False)
    assert one.status == "completed" and len(one.output) == 1
    repeated = forced_response(client, streamed)
    assert repeated.status == "completed" and shape(repeated.output) == shape(one.output)
    assert repeated.usage.output_tokens < 2 * one.usage.output_tokens


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_max_output_tokens_inside_a_call_keeps_the_whole_calls(client, streamed):
    """Cut inside its first call, the response has no call; inside the second, the first:
    incomplete, never a server error (a cut call's arguments are not JSON)."""
    one = forced_response(client, streamed, parallel_tool_calls=False)
    inside = one.usage.output_tokens * 3 // 4  # past a call's header, inside its arguments
    for max_output_tokens, kept in (
        (inside, []),
        (one.usage.output_tokens + inside, shape(one.output)),
    ):
        cut = forced_response(client, streamed, max_output_tokens=max_output_tokens)
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
        assert shape(cut.output) == kept and cut.usage.output_tokens == max_output_tokens
        # Stored as it was answered: the conversation goes on from it.
        follow_up = create(client, previous_response_id=cut.id, input="Go on.", max_output_tokens=1)
        assert follow_up.previous_response_id == cut.id


def test_thinking_then_a_forced_call(client):
    response = create(
        client,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        reasoning=THINKING,
    )
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == PLANTED_REASONING


def test_a_named_function_is_called(client):
    choice = {"type": "function", "name": "get_weather"}
    response = create(client, input="Weather?", tools=[WEATHER], tool_choice=choice)
    assert [item.name for item in response.output] == ["get_weather"]


def test_tool_choice_none_shows_no_tools(client):
    with_none = create(client, input="Weather?", tools=[WEATHER], tool_choice="none")
    without = create(client, input="Weather?")
    assert with_none.usage.input_tokens == without.usage.input_tokens
    assert with_none.output_text == PLANTED_ANSWER


# --- bad requests and aborted streams ---------------------------------------------------

BAD_SCHEMA = {"type": "object", "dependentSchemas": {"a": {}}}


@pytest.mark.parametrize(
    ("fields", "status", "param", "message"),
    [
        ({"input": 5}, 400, "input", "Invalid value for 'input'"),
        ({"input": ""}, 400, "input", "input must not be empty"),
        ({"input": []}, 400, "input", "input must not be empty"),
        ({"model": "nope"}, 404, "model", "The model 'nope' does not exist"),
        ({"temperature": "hot"}, 400, "temperature", "Invalid value for 'temperature'"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens", "greater than or equal to 1"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input.0.content.0.image_url",
            "this model takes no images",  # a text-only model (tests/test_server_vision.py)
        ),
        (
            {"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{"}]},
            400,
            "input.0.arguments",
            "not valid JSON",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            400,
            None,
            "json_schema is invalid",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
            400,
            None,
            "Unimplemented keys",
        ),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "nope"}}]},
            400,
            "tools.0.parameters",
            "not a JSON schema qinfer can follow",
        ),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type", "Input should be 'function'"),
        ({"tool_choice": "required"}, 400, "tool_choice", "a forced tool call needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            400,
            "tool_choice",
            "'nope' is not one of the tools",
        ),
        ({"previous_response_id": "resp_nope"}, 400, "previous_response_id", "not found"),
        (
            {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]},
            400,
            "input",
            "it holds no message to answer",
        ),
        ({"background": True}, 400, "background", "an OpenAI-hosted feature"),
        (
            {"input": [{"role": "user", "content": "hi"}] * (MAX_INPUT_ITEMS + 1)},
            400,
            "input",
            f"at most {MAX_INPUT_ITEMS} items",
        ),
    ],
    ids=[
        "input-not-text",
        "empty-text",
        "no-items",
        "unknown-model",
        "temperature-not-a-number",
        "no-output-tokens",
        "image-input",
        "call-arguments-not-json",
        "invalid-schema",
        "schema-llguidance-cannot-compile",
        "tool-schema-invalid",
        "hosted-tool",
        "required-without-tools",
        "unknown-named-tool",
        "unknown-previous-response",
        "only-reasoning",
        "background",
        "too-many-items",
    ],
)
def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(
    client, http, fields, status, param, message
):
    body = {"model": MODEL, "input": "Hello world", **fields}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert create(client, input="Hello world", max_output_tokens=1).usage.output_tokens == 1


@pytest.mark.parametrize(("max_output_tokens", "status"), [(None, "completed"), (3, "incomplete")])
def test_each_status_ends_the_stream_with_the_event_clients_expect(
    client, max_output_tokens, status
):
    """The `openai` client's stream helper reads the response's end from its last event:
    response.completed, or response.incomplete with the reason."""
    fields = dict(input="Hello world", reasoning=THINKING, max_output_tokens=max_output_tokens)
    events, final = stream(client, **fields)
    assert [event.type for event in events].count(f"response.{status}") == 1
    assert events[-1].type == f"response.{status}" and final.status == status
    assert final.error is None
    reason = None if status == "completed" else "max_output_tokens"
    assert (final.incomplete_details and final.incomplete_details.reason) == reason


def test_a_stream_the_stopping_server_cuts_ends_with_response_failed(served, serve):
    """Ctrl-C on `qinfer serve` aborts every request: an open stream ends with
    response.failed (a server_error), not as if the model had finished."""
    stopping = serve("--model", str(served[2]), "--served-model-name", MODEL)
    client = openai.OpenAI(base_url=f"{stopping.url}/v1", api_key="none", max_retries=0, timeout=60)
    endless = {"format": {"type": "json_schema", "name": "s", "schema": {"type": "string"}}}
    try:
        with client.responses.stream(
            model=MODEL, input="Hello world", text=endless, max_output_tokens=2000, temperature=0
        ) as stream:
            events, deltas = [], 0
            for event in stream:
                events.append(event)
                deltas += event.type == "response.output_text.delta"
                if deltas == 3 and event.type == "response.output_text.delta":
                    stopping.process.send_signal(signal.SIGINT)  # once, mid-reply
    finally:
        stopping.process.wait(timeout=30)
    final = events[-1]
    assert final.type == "response.failed" and final.response.status == "failed"
    assert final.response.error.code == "server_error"
    assert [e.type for e in events].count("response.completed") == 0
    *_, cut = final.response.output  # the reply so far, its last item cut
    assert cut.status == "incomplete" and cut.content[0].text


def test_a_wrong_api_key_is_a_401(http):
    headers = {"Authorization": "Bearer wrong"}
    response = http.post("/v1/responses", json={"input": "hi"}, headers=headers)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_aborted_streams_free_their_requests(http):
    body = {
        "model": MODEL,
        "input": "Hello world",
        "stream": True,
        "temperature": 0,  # the random model loops inside the string: never ends
        "max_output_tokens": 2000,
        "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "string"}}},
        "reasoning": NO_THINKING,
    }
    assert_aborted_streams_free_their_requests(
        http, "/v1/responses", body, "event: response.created"
    )


# --- stored responses ---------------------------------------------------------------------


def test_a_stored_response_is_retrieved_then_deleted(client):
    created = create(client, input="Hello world")
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
    _, streamed = stream(client, input="Hello world")
    retrieved = client.responses.retrieve(streamed.id)  # the stream's final one has `parsed`
    assert shape(retrieved.output) == shape(streamed.output)
    assert [i.id for i in retrieved.output] == [i.id for i in streamed.output]
    assert retrieved.usage == streamed.usage
    assert client.responses.delete(created.id) is None
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError, match=f"No response found with id '{created.id}'"):
            call(created.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        create(client, input="Again", previous_response_id=created.id)
    create(client, input="Again", previous_response_id=streamed.id)  # the other one stays


def test_a_response_sent_with_store_false_is_not_kept(client, http):
    unstored = create(client, input="Hello world", store=False)
    response = http.get(f"/v1/responses/{unstored.id}")
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "response_id"
    assert (
        http.get(f"/v1/responses/{unstored.id}", headers={"Authorization": "Bearer x"}).status_code
        == 401
    )
