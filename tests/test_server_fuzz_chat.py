"""The chat routes' JSON bodies, fuzzed (issue 30: no 5xx anywhere), and their cut points.

Hypothesis writes bodies for chat completions, completions, Responses, Anthropic's Messages
(and its token count), tokenize, detokenize and inspect: valid ones (tools, forced calls,
JSON formats, reasoning, streams), then mutations of them and bodies that are no JSON object
at all, each held to tests/server_fuzzing.py's property. The app runs in this process over
the planted Qwen3 (tests/planted_qwen3.py: a thinking model with Qwen3's tool format).

The cut-point tests end a forced tool call, a JSON-schema reply and a reasoning block at
every token budget: always a 200, with the finish reason or status of a cut reply.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from planted_qwen3 import build_planted_qwen3
from server_fuzzing import (
    ARGUMENTS,
    FUZZ,
    MODEL,
    STREAM_CHECKS,
    InProcess,
    batches,
    budgets,
    check,
    optional,
    schemas,
    serve,
    small_ints,
    texts,
)
from test_server_anthropic import FORECAST

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_app(tmp_path_factory) -> Iterator[InProcess]:
    """The planted Qwen3 (a thinking model, Qwen3's tool calls)."""
    folder = build_planted_qwen3(tmp_path_factory.mktemp("fuzz-chat"), max_position_embeddings=1024)
    yield from serve(folder)


# -- chat completions and completions

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": FORECAST},
}
chat_messages = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": texts}),
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": st.lists(st.just({"type": "text", "text": "hi"}))}
        ),
        st.just(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ARGUMENTS},
                    }
                ],
            }
        ),
        st.fixed_dictionaries(
            {"role": st.just("assistant"), "content": texts}, optional={"reasoning_content": texts}
        ),
        st.fixed_dictionaries(
            {"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": texts}
        ),
    ),
    min_size=1,
    max_size=3,
)
tool_choices = st.sampled_from(
    ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
response_formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.builds(
        lambda schema, strict: {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": schema, "strict": strict},
        },
        schemas,
        st.sampled_from([True, False, None]),
    ),
)
sampling = dict(
    temperature=st.sampled_from([0, 0.5, 1.0, 2.0]),
    top_p=st.sampled_from([0.5, 1.0]),
    top_k=st.sampled_from([0, 1, 5, 1000]),
    min_p=st.sampled_from([0, 0.1]),
    presence_penalty=st.sampled_from([-2, 0, 1.5]),
    frequency_penalty=st.sampled_from([-2, 0, 1.5]),
    repetition_penalty=st.sampled_from([0.5, 1.0, 1.3]),
    seed=st.integers(0, 2**62),
    stop=st.sampled_from(["\n", ["a", "Hello"], []]),
    logit_bias=st.sampled_from([{"5": 10}, {"0": -100}, {}]),
    user=texts,
    metadata=st.just({"k": "v"}),
)
chat_bodies = st.builds(
    lambda messages, budget, fields: {"model": MODEL, "messages": messages, **budget, **fields},
    chat_messages,
    st.sampled_from(["max_tokens", "max_completion_tokens"]).flatmap(
        lambda name: st.fixed_dictionaries({name: budgets})
    ),
    optional(
        **sampling,
        n=st.integers(1, 2),
        stream=st.booleans(),
        stream_options=st.just({"include_usage": True}),
        logprobs=st.booleans(),
        top_logprobs=st.integers(0, 3),
        tools=st.just([WEATHER]),
        tool_choice=tool_choices,
        parallel_tool_calls=st.booleans(),
        response_format=response_formats,
        reasoning_effort=st.sampled_from(["none", "low", "high"]),
        chat_template_kwargs=st.sampled_from([{"enable_thinking": True}, {"x": 1}]),
        guided_regex=st.sampled_from(["[a-z]{2}", "[a-"]),
        guided_choice=st.sampled_from([["up", "down"], []]),
        guided_json=schemas,
    ),
)
prompts = st.one_of(
    texts,
    st.lists(st.integers(0, 300), min_size=1, max_size=4),
    st.lists(texts, min_size=1, max_size=2),
    st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=3), min_size=1, max_size=2),
)
completion_bodies = st.builds(
    lambda prompt, budget, fields: {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": budget,
        **fields,
    },
    prompts,
    small_ints,
    optional(
        **sampling,
        n=st.integers(1, 2),
        best_of=st.integers(1, 3),
        stream=st.booleans(),
        stream_options=st.just({"include_usage": True}),
        echo=st.booleans(),
        logprobs=st.integers(0, 5),
        suffix=texts,
        guided_choice=st.sampled_from([["up", "down"], []]),
    ),
)


# -- Responses

RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": FORECAST}
input_items = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": texts}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.just("user"),
            "content": st.lists(st.builds(lambda t: {"type": "input_text", "text": t}, texts)),
        }
    ),
    st.just(
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi", "annotations": []}],
        }
    ),
    st.just(
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": ARGUMENTS,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.just("call_1"),
            "output": texts | st.just([{"type": "input_text", "text": "18C"}]),
        }
    ),
    st.just({"type": "reasoning", "summary": [{"type": "summary_text", "text": "Think"}]}),
)
text_formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.builds(lambda schema: {"type": "json_schema", "name": "reply", "schema": schema}, schemas),
)


def responses_bodies(earlier_id: str) -> st.SearchStrategy[dict[str, Any]]:
    """Responses bodies; `earlier_id` is a stored response's, which some continue."""
    return st.builds(
        lambda input_, budget, fields: {
            "model": MODEL,
            "input": input_,
            "max_output_tokens": budget,
            **fields,
        },
        texts | st.lists(input_items, min_size=1, max_size=4),
        budgets,
        optional(
            previous_response_id=st.sampled_from([earlier_id, "resp_unknown", ""]),
            instructions=texts,
            temperature=st.sampled_from([0, 1.0]),
            top_p=st.sampled_from([0.5, 1.0]),
            tools=st.just([RESPONSES_WEATHER]),
            tool_choice=st.sampled_from(
                ["none", "auto", "required", {"type": "function", "name": "get_weather"}]
            ),
            parallel_tool_calls=st.booleans(),
            text=st.builds(lambda f: {"format": f}, text_formats),
            reasoning=st.sampled_from([{"effort": "none"}, {"effort": "high"}, {}]),
            store=st.booleans(),
            stream=st.booleans(),
            metadata=st.just({"k": "v"}),
            truncation=st.just("disabled"),
            include=st.just(["reasoning.encrypted_content"]),
        ),
    )


# -- Anthropic Messages

ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Weather", "input_schema": FORECAST}
user_blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.just("toolu_1"),
            "content": texts | st.just([{"type": "text", "text": "18C"}]),
        },
        optional={"is_error": st.booleans()},
    ),
)
assistant_blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.just(
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    ),
    st.just({"type": "thinking", "thinking": "Hmm", "signature": ""}),
)
anthropic_turns = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": texts | st.lists(user_blocks, max_size=2)}
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": texts | st.lists(assistant_blocks, max_size=2),
            }
        ),
    ),
    max_size=3,
).map(lambda turns: [*turns, {"role": "user", "content": "Weather in Paris?"}])
messages_bodies = st.builds(
    lambda messages, budget, fields: {
        "model": MODEL,
        "messages": messages,
        "max_tokens": budget,
        **fields,
    },
    anthropic_turns,
    budgets,
    optional(
        system=texts | st.just([{"type": "text", "text": "Be brief."}]),
        tools=st.just([ANTHROPIC_WEATHER]),
        tool_choice=st.sampled_from(
            [
                {"type": "auto"},
                {"type": "any", "disable_parallel_tool_use": True},
                {"type": "tool", "name": "get_weather"},
                {"type": "none"},
            ]
        ),
        thinking=st.sampled_from(
            [{"type": "enabled", "budget_tokens": 2}, {"type": "disabled"}, {"type": "adaptive"}]
        ),
        stop_sequences=st.sampled_from([["Hello"], []]),
        temperature=st.sampled_from([0, 1]),
        top_p=st.sampled_from([0.5, 1.0]),
        top_k=st.sampled_from([0, 5]),
        output_config=st.builds(
            lambda schema: {"format": {"type": "json_schema", "schema": schema}}, schemas
        ),
        stream=st.booleans(),
        metadata=st.just({"user_id": "u"}),
    ),
)


# -- tokens, inspection

tokenize_bodies = st.one_of(
    st.builds(
        lambda prompt, fields: {"model": MODEL, "prompt": prompt, **fields},
        texts,
        optional(add_special_tokens=st.booleans()),
    ),
    st.builds(
        lambda messages, fields: {"model": MODEL, "messages": messages, **fields},
        chat_messages,
        optional(
            add_generation_prompt=st.booleans(),
            tools=st.just([WEATHER]),
            chat_template_kwargs=st.just({"enable_thinking": False}),
        ),
    ),
)
detokenize_bodies = st.builds(
    lambda tokens: {"model": MODEL, "tokens": tokens}, st.lists(st.integers(0, 404), max_size=6)
)
inspect_bodies = st.builds(
    lambda prompt, fields: {"model": MODEL, "prompt": prompt, **fields},
    texts | st.lists(st.integers(0, 404), max_size=4) | chat_messages,
    optional(
        layers=st.lists(st.integers(0, 2), max_size=2),
        heads=st.lists(st.integers(0, 4), max_size=2),
        top_k=st.integers(0, 21),
    ),
)


# --- the fuzz ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def earlier_response(chat_app) -> str:
    """The id of a stored response that made a forced call, for `previous_response_id`."""
    body = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "tools": [RESPONSES_WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
        "reasoning": {"effort": "none"},
        "temperature": 0,
    }
    response = chat_app.post_json("/v1/responses", body)
    assert response.status_code == 200, response.text
    return response.json()["id"]


@FUZZ
@given(requests=batches(chat_bodies))
def test_chat_completions_never_fail_with_a_5xx(chat_app, requests):
    check(chat_app, "/v1/chat/completions", requests, ("messages",))


@FUZZ
@given(requests=batches(completion_bodies))
def test_completions_never_fail_with_a_5xx(chat_app, requests):
    check(chat_app, "/v1/completions", requests, ("prompt",))


@FUZZ
@given(data=st.data())
def test_responses_never_fail_with_a_5xx(chat_app, earlier_response, data):
    requests = data.draw(batches(responses_bodies(earlier_response)))
    check(chat_app, "/v1/responses", requests, ("input",))


@FUZZ
@given(requests=batches(messages_bodies))
def test_messages_and_their_token_counts_never_fail_with_a_5xx(chat_app, requests):
    required = ("model", "messages", "max_tokens")
    check(chat_app, "/v1/messages", requests, required)
    check(chat_app, "/v1/messages/count_tokens", requests, required[:2])


@FUZZ
@given(tokenize=batches(tokenize_bodies), detokenize=batches(detokenize_bodies))
def test_tokenize_and_detokenize_never_fail_with_a_5xx(chat_app, tokenize, detokenize):
    check(chat_app, "/tokenize", tokenize, ("prompt", "messages"))
    check(chat_app, "/detokenize", detokenize, ("tokens",))


@FUZZ
@given(requests=batches(inspect_bodies))
def test_inspect_never_fails_with_a_5xx(chat_app, requests):
    # A prompt of chat messages: template errors name the message as `messages[i]`.
    check(chat_app, "/v1/inspect", requests, ("prompt", "messages"))


# --- cut points ----------------------------------------------------------------------------

#: What each case asks, per API: a forced call, JSON under a schema, thinking first.
CHAT_CASES = {
    "forced call": {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
    "json schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "f", "schema": FORECAST},
        },
        "reasoning_effort": "none",
    },
    "reasoning": {"reasoning_effort": "high"},
}
RESPONSES_CASES = {
    "forced call": {
        "tools": [RESPONSES_WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    },
    "json schema": {
        "text": {"format": {"type": "json_schema", "name": "f", "schema": FORECAST}},
        "reasoning": {"effort": "none"},
    },
    "reasoning": {"reasoning": {"effort": "high"}},
}
MESSAGES_CASES = {
    "forced call": {
        "tools": [ANTHROPIC_WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    },
    "json schema": {
        "output_config": {"format": {"type": "json_schema", "schema": FORECAST}},
        "thinking": {"type": "disabled"},
    },
    "reasoning": {"thinking": {"type": "enabled", "budget_tokens": 100}},
}
#: Per API: its path, budget field, a request of each case, and how an answer ends:
#: (tokens generated, finish reason or status) and the end of a cut one.
CUT_APIS = {
    "chat": (
        "/v1/chat/completions",
        "max_tokens",
        lambda case: {"messages": [{"role": "user", "content": "Weather?"}], **CHAT_CASES[case]},
        lambda a: (a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"]),
        "length",
    ),
    "responses": (
        "/v1/responses",
        "max_output_tokens",
        lambda case: {"input": "Weather?", **RESPONSES_CASES[case]},
        lambda a: (a["usage"]["output_tokens"], a["status"]),
        "incomplete",
    ),
    "messages": (
        "/v1/messages",
        "max_tokens",
        lambda case: {
            "messages": [{"role": "user", "content": "Weather?"}],
            **MESSAGES_CASES[case],
        },
        lambda a: (a["usage"]["output_tokens"], a["stop_reason"]),
        "max_tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
@pytest.mark.parametrize("api", sorted(CUT_APIS))
def test_every_token_budget_cuts_the_reply_cleanly(chat_app, api, case):
    """A reply cut at each budget 1..N (N: its whole length) is a 200 that says it was
    cut; at N and past it, the reply ends as it does uncut. Streams end well-formed at
    the first budget, the middle one, N and N + 1."""
    path, budget, request, ending, cut = CUT_APIS[api]
    body = {"model": MODEL, "temperature": 0, **request(case)}
    whole = chat_app.post_json(path, {**body, budget: 400})
    assert whole.status_code == 200, whole.text
    length, end = ending(whole.json())
    assert end != cut and 1 < length < 400, (length, end)
    streamed = {1, length // 2, length, length + 1}
    bodies = [{**body, budget: k, "stream": False} for k in range(1, length + 2)]
    bodies += [{**body, budget: k, "stream": True} for k in sorted(streamed)]
    answers = chat_app.post_all(path, [json.dumps(b).encode() for b in bodies])
    assert not chat_app.errors, chat_app.errors[0].getMessage()
    for sent, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, (sent, answer.text)
        if sent["stream"]:
            STREAM_CHECKS[path](answer.text)
            continue
        tokens, ended = ending(answer.json())
        assert (tokens, ended) == ((sent[budget], cut) if sent[budget] < length else (length, end))
        if api == "responses" and ended == "incomplete":
            assert answer.json()["incomplete_details"] == {"reason": "max_output_tokens"}
