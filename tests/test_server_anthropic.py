"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) against
`qinfer serve`, through the real `anthropic` client.

The server runs the planted Qwen3 (tests/planted_qwen3.py): greedy, it thinks "The answer"
and answers "Hello" after any chat prompt, so thinking blocks and text are known without a
trained model; tool uses and JSON come from grammars (`tool_choice` "any" or "tool",
`output_config.format`), whatever the random weights would write. Prompts are checked
against the chat completions endpoint, whose template rendering
tests/test_tool_call_formats.py checks against transformers.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from planted_qwen3 import PLANTED_ANSWER, PLANTED_REASONING, build_planted_qwen3
from servers import (
    assert_aborted_streams_free_their_requests,
    chat_usage,
    metric_values,
    serving,
    wait_until_idle,
)

from qinfer.server.anthropic.messages_request import MAX_MESSAGES

MODEL = "tiny"
KEY = "anthropic-key"
USER = [{"role": "user", "content": "Hello world"}]
NO_THINKING = {"type": "disabled"}
THINKING = {"type": "enabled", "budget_tokens": 1024}
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": FORECAST}
#: WEATHER as chat completions take it.
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": FORECAST},
}
ANY_ONE = {"type": "any", "disable_parallel_tool_use": True}
#: Room for a whole forced call (the tokenizer is small, JSON takes many tokens).
CALL_TOKENS = 400


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(anthropic client, openai client, httpx client) of `qinfer serve` on the planted
    Qwen3, with an API key."""
    folder = build_planted_qwen3(tmp_path_factory.mktemp("anthropic"), max_position_embeddings=4096)
    with serving(
        *("--model", str(folder), "--served-model-name", MODEL, "--max-model-len", "4096"),
        *("--api-key", KEY),
    ) as server:
        url = server.url
        client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        with httpx.Client(base_url=url, headers={"x-api-key": KEY}, timeout=120) as http:
            yield client, chat, http


@pytest.fixture(scope="module")
def client(served) -> anthropic.Anthropic:
    return served[0]


@pytest.fixture(scope="module")
def chat(served) -> openai.OpenAI:
    return served[1]


@pytest.fixture(scope="module")
def http(served) -> httpx.Client:
    return served[2]


#: Greedy decoding. The anthropic client has no `temperature` argument any more (newer
#: Claude models refuse it); the server still reads it, as older clients send it.
GREEDY = {"temperature": 0}


def create(client, messages=USER, **fields):
    fields.setdefault("thinking", NO_THINKING)
    fields.setdefault("max_tokens", 50)
    return client.messages.create(model=MODEL, messages=messages, extra_body=GREEDY, **fields)


def raw_stream(client, messages=USER, **fields) -> list:
    """Every raw event of a streamed message."""
    fields.setdefault("thinking", NO_THINKING)
    fields.setdefault("max_tokens", 50)
    return list(
        client.messages.create(
            model=MODEL, messages=messages, extra_body=GREEDY, stream=True, **fields
        )
    )


def final_streamed(client, messages=USER, **fields):
    """The message the client's stream helper puts together."""
    fields.setdefault("thinking", NO_THINKING)
    fields.setdefault("max_tokens", 50)
    with client.messages.stream(model=MODEL, messages=messages, extra_body=GREEDY, **fields) as s:
        return s.get_final_message()


def prompt_tokens(message) -> int:
    usage = message.usage
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def deltas_of(events: list, kind: str) -> str:
    """The text that a stream's deltas of one kind (text_delta, ...) add up to."""
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.delta.type == kind]
    field = {"text_delta": "text", "thinking_delta": "thinking"}.get(kind, "partial_json")
    return "".join(getattr(delta, field) for delta in deltas)


def blocks(message) -> list[tuple]:
    """Each content block as (type, its text or call)."""
    shown = []
    for block in message.content:
        if block.type == "text":
            shown.append(("text", block.text))
        elif block.type == "thinking":
            shown.append(("thinking", block.thinking))
        else:
            shown.append(("tool_use", block.name, block.input))
    return shown


# --- text and thinking -----------------------------------------------------------------


def test_a_message_is_answered_as_chat_completions_answer_it(client, chat):
    message = create(client)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    assert blocks(message) == [("text", PLANTED_ANSWER)]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    expected = chat_usage(chat, MODEL, USER)
    assert prompt_tokens(message) == expected.prompt_tokens
    assert message.usage.output_tokens == expected.completion_tokens


@pytest.mark.parametrize(
    ("system", "as_text"),
    [
        ("Be brief.", "Be brief."),
        ([{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}], "Be\nbrief."),
    ],
    ids=["text", "blocks"],
)
def test_system_is_a_system_message_and_count_tokens_agrees(client, chat, system, as_text):
    message = create(client, system=system)
    messages = [{"role": "system", "content": as_text}, *USER]
    expected = chat_usage(chat, MODEL, messages, max_tokens=1).prompt_tokens
    assert prompt_tokens(message) == expected
    counted = client.messages.count_tokens(
        model=MODEL, messages=USER, system=system, thinking=NO_THINKING
    )
    assert counted.input_tokens == expected


def test_thinking_enabled_returns_a_thinking_block_then_the_text(client):
    message = create(client, thinking=THINKING)
    assert blocks(message) == [("thinking", PLANTED_REASONING), ("text", PLANTED_ANSWER)]
    assert message.content[0].signature == ""


def test_stream_sends_the_documented_events_and_the_same_message(client):
    whole = create(client, thinking=THINKING)
    events = raw_stream(client, thinking=THINKING)
    kinds = [event.type for event in events]
    deltas = [i for i, kind in enumerate(kinds) if kind == "content_block_delta"]
    collapsed = [kind for i, kind in enumerate(kinds) if i - 1 not in deltas or i not in deltas]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert collapsed == ["message_start", *block, *block, "message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking, text = deltas_of(events, "thinking_delta"), deltas_of(events, "text_delta")
    assert (thinking, text) == (PLANTED_REASONING, PLANTED_ANSWER)
    assert prompt_tokens(events[0].message) == prompt_tokens(whole)
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    final = final_streamed(client, thinking=THINKING)
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason


def test_a_long_greedy_text_streams_as_it_is_whole(client):
    # Inside a JSON string the random model writes 60 tokens of its own, not the path.
    config = {"format": {"type": "json_schema", "schema": {"type": "string"}}}
    whole = create(client, output_config=config, max_tokens=60)
    events = raw_stream(client, output_config=config, max_tokens=60)
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 10 and deltas_of(events, "text_delta") == whole.content[0].text
    assert whole.usage.output_tokens == events[-2].usage.output_tokens == 60


def test_max_tokens_cuts_the_reply_streamed_alike(client):
    whole = create(client, thinking=THINKING, max_tokens=3)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 3
    [(kind, text)] = blocks(whole)
    assert kind == "thinking" and PLANTED_REASONING.startswith(text)
    final = final_streamed(client, thinking=THINKING, max_tokens=3)
    assert blocks(final) == blocks(whole) and final.stop_reason == "max_tokens"


def test_budget_tokens_closes_the_thinking_block_and_the_answer_follows(client):
    message = create(client, thinking={"type": "enabled", "budget_tokens": 1})
    [(kind, thought), answer] = blocks(message)
    # one token of "The answer", then </think> forced; the planted answer follows it
    assert kind == "thinking" and thought and PLANTED_REASONING.startswith(thought)
    assert thought != PLANTED_REASONING
    assert answer == ("text", PLANTED_ANSWER) and message.stop_reason == "end_turn"


def test_a_stop_sequence_cuts_the_text_and_is_named(client):
    cut = PLANTED_ANSWER[2:4]
    message = create(client, stop_sequences=["zzz", cut])
    assert blocks(message) == [("text", PLANTED_ANSWER[:2])]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", cut)
    final = final_streamed(client, stop_sequences=["zzz", cut])
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", cut)


def test_output_config_format_makes_json_that_validates(client):
    config = {"format": {"type": "json_schema", "schema": FORECAST}}
    message = create(client, output_config=config)
    jsonschema.validate(json.loads(message.content[0].text), FORECAST)
    assert message.stop_reason == "end_turn"


# --- tools -----------------------------------------------------------------------------


def test_tool_use_then_tool_result_round_trip(client, chat):
    first = create(client, tools=[WEATHER], tool_choice=ANY_ONE, max_tokens=CALL_TOKENS)
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, FORECAST)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18C, sunny"}
    conversation = [
        *USER,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = create(client, conversation, tools=[WEATHER])
    assert blocks(second) == [("text", PLANTED_ANSWER)] and second.stop_reason == "end_turn"
    call = {"name": use.name, "arguments": json.dumps(use.input)}
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": use.id, "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "18C, sunny"},
    ]
    expected = chat_usage(chat, MODEL, messages, max_tokens=1, tools=[CHAT_WEATHER]).prompt_tokens
    assert prompt_tokens(second) == expected


def test_a_streamed_tool_use_adds_up_to_the_whole_one(client):
    whole = create(client, tools=[WEATHER], tool_choice=ANY_ONE, max_tokens=CALL_TOKENS)
    events = raw_stream(client, tools=[WEATHER], tool_choice=ANY_ONE, max_tokens=CALL_TOKENS)
    partial = deltas_of(events, "input_json_delta")
    assert json.loads(partial) == whole.content[0].input
    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.input == {} and start.content_block.name == "get_weather"
    assert events[-2].delta.stop_reason == "tool_use"
    final = final_streamed(client, tools=[WEATHER], tool_choice=ANY_ONE, max_tokens=CALL_TOKENS)
    assert blocks(final) == blocks(whole)


def forced_message(client, streamed: bool, **fields):
    """A forced use of WEATHER, whole or as the client's stream puts it together
    (parallel tool use at its default unless `fields` say otherwise)."""
    fields = dict(tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=CALL_TOKENS) | fields
    return final_streamed(client, **fields) if streamed else create(client, **fields)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_use_ends_the_message_once_it_repeats(client, streamed):
    """Parallel tool use allowed, the planted model writes its call again: the message
    ends as soon as the repeat's input is complete, with the one tool use."""
    one = forced_message(client, streamed, tool_choice=ANY_ONE)
    assert one.stop_reason == "tool_use" and len(one.content) == 1
    repeated = forced_message(client, streamed)
    assert repeated.stop_reason == "tool_use" and blocks(repeated) == blocks(one)
    assert repeated.usage.output_tokens < 2 * one.usage.output_tokens


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_max_tokens_inside_a_second_tool_use_keeps_the_first(client, streamed):
    one = forced_message(client, streamed, tool_choice=ANY_ONE)
    max_tokens = one.usage.output_tokens * 7 // 4  # inside the repeat's arguments
    cut = forced_message(client, streamed, max_tokens=max_tokens)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", max_tokens)
    assert blocks(cut) == blocks(one)


def test_max_tokens_inside_the_only_tool_use_leaves_it_out(client):
    one = forced_message(client, False, tool_choice=ANY_ONE)
    cut = forced_message(client, False, max_tokens=one.usage.output_tokens * 3 // 4)
    assert (cut.stop_reason, cut.content) == ("max_tokens", [])


def test_thinking_then_a_forced_tool_use(client):
    message = create(
        client, tools=[WEATHER], tool_choice=ANY_ONE, max_tokens=CALL_TOKENS, thinking=THINKING
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.stop_reason == "tool_use"


def test_a_named_tool_is_used(client):
    choice = {"type": "tool", "name": "get_weather"}
    message = create(client, tools=[WEATHER], tool_choice=choice, max_tokens=CALL_TOKENS)
    assert [block.name for block in message.content] == ["get_weather"]
    assert message.stop_reason == "tool_use"


def test_tool_choice_none_shows_no_tools(client):
    none = create(client, tools=[WEATHER], tool_choice={"type": "none"})
    assert prompt_tokens(none) == prompt_tokens(create(client))
    counted = client.messages.count_tokens(model=MODEL, messages=USER, tools=[WEATHER])
    assert counted.input_tokens > prompt_tokens(none)


# --- errors, keys, aborted streams ---------------------------------------------------


#: An image block (of no image: a text-only model refuses it before reading it).
IMAGE = {"type": "base64", "media_type": "image/png", "data": "AAAA"}


@pytest.mark.parametrize(
    ("fields", "status", "kind", "message"),
    [
        ({"max_tokens": "many"}, 400, "invalid_request_error", "Invalid value for 'max_tokens'"),
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": []}, 400, "invalid_request_error", "Invalid value for 'messages'"),
        ({"model": "nope"}, 404, "not_found_error", "The model 'nope' does not exist"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "less than or equal to 1"),
        # Past int64 it would fail the engine step, and every request batched in it.
        ({"top_k": 2**63}, 400, "invalid_request_error", "Invalid value for 'top_k'"),
        (
            {"messages": [{"role": "assistant", "content": "Hel"}]},
            400,
            "invalid_request_error",
            "Invalid value for 'messages': a prefill",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": "Hel"}], "thinking": THINKING},
            400,
            "invalid_request_error",
            "with thinking enabled",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": "Hel "}]},
            400,
            "invalid_request_error",
            "cannot end with trailing whitespace",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    },
                ]
            },
            400,
            "invalid_request_error",
            "text blocks only",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    }
                ]
            },
            400,
            "invalid_request_error",
            "a user message cannot hold a tool_use block",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": IMAGE}]}]},
            400,
            "invalid_request_error",
            "'messages.0.content.0.source.data': this model takes no images",  # text-only
        ),
        (
            {"tools": [{**WEATHER, "input_schema": {"type": "nope"}}]},
            400,
            "invalid_request_error",
            "Invalid value for 'tools.0.input_schema'",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            "tools.0",
        ),
        (
            {"tool_choice": {"type": "any"}},
            400,
            "invalid_request_error",
            "a forced tool call needs tools",
        ),
        (
            {
                "output_config": {
                    "format": {
                        "type": "json_schema",
                        "schema": {"type": "object", "dependentSchemas": {"a": {}}},
                    }
                }
            },
            400,
            "invalid_request_error",
            "Unimplemented keys",
        ),
        ({"messages": USER * (MAX_MESSAGES + 1)}, 400, "invalid_request_error", "at most"),
        (
            {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
            400,
            "invalid_request_error",
            "mcp_servers is an Anthropic-hosted feature",
        ),
    ],
    ids=[
        "max-tokens-not-a-number",
        "max-tokens-missing",
        "no-messages",
        "unknown-model",
        "temperature-above-one",
        "top-k-past-int64",
        "a-lone-prefill",
        "prefill-while-thinking",
        "prefill-trailing-space",
        "prefill-tool-use",
        "tool-use-from-the-user",
        "image",
        "tool-schema-invalid",
        "server-tool",
        "any-without-tools",
        "schema-llguidance-cannot-compile",
        "too-many-messages",
        "mcp-servers",
    ],
)
def test_bad_requests_are_anthropic_errors_and_the_server_keeps_serving(
    client, http, fields, status, kind, message
):
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, **fields}
    body = {name: value for name, value in body.items() if value is not None}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert message in error["error"]["message"]
    assert create(client, max_tokens=1).usage.output_tokens == 1


@pytest.mark.parametrize(
    "thread",
    [{"type": "create"}, {"type": "continue", "previous_message_id": "msg_0"}],
    ids=["create", "continue"],
)
def test_a_thread_is_refused_in_the_words_the_client_goes_on_without_one(client, thread):
    """The client's tool runner asks for a server-held thread, then sends only each turn's
    new messages. Ignored, that would lose the history and the tools; refused with
    `error.details.error_code` "thread_unsupported_request", the runner sends the whole
    conversation again without a thread (tests/test_agent_loops.py)."""
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.beta.messages.create(model=MODEL, max_tokens=1, messages=USER, thread=thread)
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error" and "thread" in error["message"]
    assert error["details"] == {"error_code": "thread_unsupported_request"}
    assert create(client, max_tokens=1).usage.output_tokens == 1


def test_the_client_raises_its_own_error_types(client):
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="nope", max_tokens=1, messages=USER)
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        create(client, [*USER, {"role": "assistant", "content": "Hi"}], thinking=THINKING)


def test_a_prefilled_reply_continues_its_text(client, http):
    """The reply to a last assistant message is what the model writes after the opened
    reply and that text: the same tokens as a greedy completion of that very prompt."""
    tokenize = {
        "model": MODEL,
        "messages": USER,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    opened = http.post("/tokenize", json=tokenize).json()["tokens"]
    prefill = "Sure, here"
    text = {"model": MODEL, "prompt": prefill, "add_special_tokens": False}
    prompt = opened + http.post("/tokenize", json=text).json()["tokens"]
    completion = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0},
    ).json()
    messages = [*USER, {"role": "assistant", "content": prefill}]
    reply = create(client, messages, max_tokens=12)
    assert reply.content[0].text == completion["choices"][0]["text"]
    assert not reply.content[0].text.startswith(prefill)
    assert prompt_tokens(reply) == len(prompt)
    counted = client.messages.count_tokens(model=MODEL, messages=messages, thinking=NO_THINKING)
    assert counted.input_tokens == len(prompt)
    assert final_streamed(client, messages, max_tokens=12).content[0].text == reply.content[0].text


@pytest.mark.parametrize(
    "headers",
    [{"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {}],
    ids=["wrong-x-api-key", "wrong-bearer", "none"],
)
def test_a_missing_or_wrong_key_is_an_authentication_error(served, headers):
    url = str(served[2].base_url).rstrip("/")
    response = httpx.post(f"{url}/v1/messages", json={}, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_a_bearer_token_is_accepted_as_the_key(served):
    url = str(served[2].base_url).rstrip("/")
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, api_key=None, max_retries=0)
    assert create(bearer).content[0].text == PLANTED_ANSWER


def test_aborted_streams_free_their_requests(http):
    body = {
        "model": MODEL,
        "max_tokens": 2000,
        "messages": USER,
        "stream": True,
        "temperature": 0,  # the random model loops inside the string: never ends
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "string"}}},
        "thinking": NO_THINKING,
    }
    assert_aborted_streams_free_their_requests(http, "/v1/messages", body, "event: message_start")


def test_a_client_leaving_before_its_whole_message_aborts_it(http):
    body = {
        "model": MODEL,
        "max_tokens": 2000,
        "messages": USER,
        "temperature": 0,  # the random model loops inside the string: never ends
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "string"}}},
        "thinking": NO_THINKING,
    }
    aborted = metric_values(http)["qinfer_requests_aborted_total"]
    with pytest.raises(httpx.ReadTimeout):
        # 0.5 s: a fraction of the time 2000 tokens take, however fast the machine
        http.post("/v1/messages", json=body, timeout=0.5)
    values = wait_until_idle(http)
    assert values["qinfer_requests_running"] == 0 and values["qinfer_kv_blocks_used"] == 0
    assert values["qinfer_requests_aborted_total"] == aborted + 1
