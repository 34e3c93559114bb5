"""Tool calling on `qinfer serve` with no model: the embedded SmolLM2, whose template knows
no tools, so its calls go in the generic format (the tools described in the system
message). Under `tool_choice` "required" it makes valid calls, and a call it writes again
ends the reply, on the chat completions, Responses and Messages APIs alike, through the
real `openai` and `anthropic` clients.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import anthropic
import jsonschema
import openai
import pytest
from tool_call_cases import TOOLS, StreamedChoice, valid_call

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow


def test_the_default_model_calls_tools_in_the_generic_format(serve):
    """`qinfer serve` with no model (the embedded SmolLM2, whose template knows no tools)."""
    url = serve().url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather in Tokyo?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert all(valid_call(call) for call in choice.message.tool_calls)


#: One city: the embedded model makes one call, and writes it again if parallel calls are on.
DEFAULT_USER = [{"role": "user", "content": "What is the weather in Tokyo?"}]
#: TOOLS as the Responses API and Anthropic's Messages API take them.
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
MESSAGES_TOOLS = [
    {"input_schema" if key == "parameters" else key: value for key, value in function.items()}
    for function in (tool["function"] for tool in TOOLS)
]


@dataclass
class DefaultReply:
    """What the embedded-model test reads off a forced reply of any API."""

    finished: bool  # ended with the API's finish reason for a reply that made calls
    calls: list[tuple[str, str]]  # (name, arguments as JSON text)
    tokens: int  # completion / output tokens


def chat_forced(client, stream: bool, **fields) -> DefaultReply:
    """A greedy chat completion of DEFAULT_USER under `tool_choice` "required"."""
    fields = (
        dict(
            messages=DEFAULT_USER,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=300,
        )
        | fields
    )
    if not stream:
        reply = client.chat.completions.create(**fields)
        (choice,) = reply.choices
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return DefaultReply(
            choice.finish_reason == "tool_calls", calls, reply.usage.completion_tokens
        )
    choice, usage = StreamedChoice(), None
    chunks = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **fields
    )
    for chunk in chunks:
        usage = chunk.usage or usage
        for delta_choice in chunk.choices:
            for call in delta_choice.delta.tool_calls or ():
                if call.id is not None:
                    choice.calls[call.index] = [call.id, call.function.name, ""]
                choice.calls[call.index][2] += call.function.arguments or ""
            choice.finish_reason = delta_choice.finish_reason or choice.finish_reason
    calls = [(name, arguments) for _, name, arguments in choice.calls.values()]
    return DefaultReply(choice.finish_reason == "tool_calls", calls, usage.completion_tokens)


def responses_forced(client, stream: bool, **fields) -> DefaultReply:
    """A greedy response to DEFAULT_USER under `tool_choice` "required", whole or the
    stream helper's final response."""
    fields = (
        dict(
            input=DEFAULT_USER,
            tools=RESPONSES_TOOLS,
            tool_choice="required",
            temperature=0,
            max_output_tokens=300,
        )
        | fields
    )
    if stream:
        with client.responses.stream(**fields) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**fields)
    calls = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
    return DefaultReply(
        response.status == "completed" and bool(calls), calls, response.usage.output_tokens
    )


def messages_forced(client, stream: bool, **fields) -> DefaultReply:
    """A greedy message answering DEFAULT_USER under `tool_choice` any, whole or the
    stream helper's final message (the client takes no temperature: it goes as extra_body)."""
    fields = (
        dict(
            messages=DEFAULT_USER,
            tools=MESSAGES_TOOLS,
            tool_choice={"type": "any"},
            max_tokens=300,
            extra_body={"temperature": 0},
        )
        | fields
    )
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    calls = [(b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"]
    return DefaultReply(message.stop_reason == "tool_use", calls, message.usage.output_tokens)


def test_a_forced_call_of_the_default_model_ends_once_it_repeats_on_every_api(serve):
    """Issue 30 on the embedded SmolLM2 (the generic format): greedy, parallel calls at
    their default, it writes its forced call again; the repeat ends the reply with the
    call's finish reason in under twice the tokens of one call (the same request with
    parallel calls off), on all three APIs, whole and streamed. One server for all."""
    url = serve().url
    chat_client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    model = chat_client.models.list().data[0].id
    messages_client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    apis = [
        (chat_forced, chat_client, {"parallel_tool_calls": False}),
        (responses_forced, chat_client, {"parallel_tool_calls": False}),
        (
            messages_forced,
            messages_client,
            {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
        ),
    ]
    for forced, client, parallel_off in apis:
        for stream in (False, True):
            where = f"{forced.__name__}, {'streamed' if stream else 'whole'}"
            one = forced(client, stream, model=model, **parallel_off)
            assert one.finished and len(one.calls) == 1, (where, one)
            default = forced(client, stream, model=model)
            assert default.finished and default.calls[:1] == one.calls, (where, default)
            for name, arguments in default.calls:
                (tool,) = [t for t in TOOLS if t["function"]["name"] == name]
                jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
            assert default.tokens < 2 * one.tokens, (where, one, default)
