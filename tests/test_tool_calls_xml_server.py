"""Qwen3.5 as agents use it, through `qinfer serve` answering the real `openai` client: XML
tool calls returned as `tool_calls` (whole and streamed) and forced by `tool_choice`, and
the reasoning budget (`thinking_token_budget`, `--reasoning-budget`); the Responses and
Anthropic Messages APIs alike (their forced calls, the Messages API's `budget_tokens`).

The server runs a random Qwen3.5 with Qwen3.5's chat template
(tests/qwen3_5_chat_template.jinja), so its replies are noise unless something forces
them: a reply's text comes from a test's own `guided_grammar`, a forced call from the
tool-call grammar, and the budget's effect is seen with `</think>` and the end of text
banned (`logit_bias`), so that only the budget can close the block and the answer must
follow. A call written inside `<think>` comes from a planted Qwen3.5 (tests/planted_qwen3.py)
that writes one there; tests/test_tool_calls_xml.py feeds a Choice such outputs directly.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from checkpoints import HYBRID, build_checkpoint
from planted_qwen3 import LOOP_CALLS, PLANTED_ANSWER, PLANTED_REASONING, build_planted_qwen3
from servers import serving
from test_tool_calls_server import forcing_grammar
from text_assets import save_qwen3_5_tokenizer
from tool_call_cases import TOOLS, USER

import qinfer

pytestmark = pytest.mark.slow

SERVER_BUDGET = 5  # --reasoning-budget
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, tokenizer, URL) of `qinfer serve --reasoning-budget 5` on a random
    Qwen3.5 with Qwen3.5's template."""
    folder = tmp_path_factory.mktemp("tools-qwen3_5")
    backend = save_qwen3_5_tokenizer(folder)
    build_checkpoint(
        folder,
        "qwen3_5",
        **HYBRID["qwen3_5"],
        vocab_size=backend.get_vocab_size(),
        eos_token_id=backend.token_to_id("<|im_end|>"),
        max_position_embeddings=4096,
    )
    args = ["--model", str(folder), "--served-model-name", "tiny", "--max-model-len", "4096"]
    with serving(*args, "--reasoning-budget", str(SERVER_BUDGET)) as server:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120
        )
        yield client, qinfer.load_tokenizer(folder), server.url


def chat(client, stream: bool = False, **fields):
    """A chat about USER: the whole answer's (reasoning, content, calls, finish_reason,
    usage), or the same read off a stream; calls as (name, arguments)."""
    fields = {"model": "tiny", "messages": USER, "max_tokens": 200, **fields}
    if not stream:
        reply = client.chat.completions.create(**fields)
        message = reply.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        reasoning = getattr(message, "reasoning_content", None) or ""
        return reasoning, message.content or "", calls, reply.choices[0].finish_reason, reply.usage
    reasoning, content, calls, finish, usage = "", "", {}, None, None
    chunks = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **fields
    )
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                if call.id is not None:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [tuple(c) for c in calls.values()], finish, usage


XML_WEATHER = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
XML_WEATHER += "<parameter=days>\n3\n</parameter>\n</function>\n"
XML_TIME = "\n<function=get_time>\n<parameter=city>\nTokyo\n</parameter>\n</function>\n"


@pytest.mark.parametrize("stream", [False, True])
def test_xml_calls_come_back_as_tool_calls(served, stream):
    client, tokenizer, _ = served
    text = ["Let me look.\n", None, XML_WEATHER, None, "\n", None, XML_TIME, None]
    extra = {**NO_THINKING, "guided_grammar": forcing_grammar(tokenizer, text)}
    reasoning, content, calls, finish, _ = chat(client, stream, tools=TOOLS, extra_body=extra)
    assert (content, finish) == ("Let me look.\n", "tool_calls")
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"city": "Tokyo"}),
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_parses_against_its_schema(served, stream, choice):
    client, _, _ = served
    _, content, calls, finish, _ = chat(
        client, stream, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=1,
        parallel_tool_calls=False, max_tokens=150, extra_body=NO_THINKING,
    )  # fmt: skip
    assert content == "" and len(calls) == 1, (content, calls, finish)
    assert finish == ("tool_calls" if choice == "required" else "stop")
    name, arguments = calls[0]
    assert choice == "required" or name == "get_weather"
    (tool,) = [t for t in TOOLS if t["function"]["name"] == name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def banned(tokenizer) -> dict[str, int]:
    """logit_bias that bans `</think>` and the end of text: only the budget closes the block."""
    return {str(tokenizer.token_to_id(t)): -100 for t in ("</think>", "<|im_end|>")}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("budget", "spent"), [(3, 4), (None, SERVER_BUDGET + 1), (0, 1)])
def test_the_budget_closes_think_and_the_answer_follows(served, stream, budget, spent):
    """With its own budget (or the server's --reasoning-budget) of N, the block closes after
    N tokens (N + 1 with `</think>`, as `reasoning_tokens` counts) and the answer takes
    the rest of max_tokens."""
    client, tokenizer, _ = served
    extra = {} if budget is None else {"thinking_token_budget": budget}
    reasoning, content, _, finish, usage = chat(
        client, stream, max_tokens=12, temperature=1.0, seed=0,
        logit_bias=banned(tokenizer), extra_body=extra,
    )  # fmt: skip
    assert finish == "length" and usage.completion_tokens == 12
    assert usage.completion_tokens_details.reasoning_tokens == spent
    assert content and (reasoning or budget == 0)
    assert "</think>" not in content + reasoning


def test_a_bad_budget_is_one_error_naming_it(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        chat(client, extra_body={"thinking_token_budget": -1})


def test_without_thinking_no_reasoning_tokens_are_counted(served):
    """Thinking off (and `<think>` banned: the model may not open a block of its own)."""
    client, tokenizer, _ = served
    bias = {**banned(tokenizer), str(tokenizer.token_to_id("<think>")): -100}
    *_, usage = chat(client, max_tokens=4, logit_bias=bias, extra_body=NO_THINKING)
    assert usage.completion_tokens == 4 and usage.completion_tokens_details.reasoning_tokens == 0


def test_the_responses_api_gets_a_forced_xml_call(served):
    client, _, _ = served
    weather = {"type": "function", "name": "get_weather", **{
        k: v for k, v in TOOLS[0]["function"].items() if k != "name"}}  # fmt: skip
    response = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[weather], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=150, temperature=1.0,
        reasoning={"effort": "none"},
    )  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), weather["parameters"])


@pytest.fixture
def claude(served):
    _, _, url = served
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


def test_the_messages_api_gets_a_forced_xml_call(claude):
    schema = TOOLS[0]["function"]["parameters"]
    message = claude.messages.create(
        model="tiny", max_tokens=150, messages=USER, extra_body={"temperature": 1.0},
        tools=[{"name": "get_weather", "input_schema": schema}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(use.input, schema)


def test_the_messages_api_budget_closes_think(served, claude):
    """`thinking.budget_tokens` is the same budget: greedy, with `</think>` and the end
    banned, the thinking block is the chat completion's reasoning under the same budget
    (2 tokens, then `</think>`), and the answer follows."""
    client, tokenizer, _ = served
    fields = {"logit_bias": banned(tokenizer), "temperature": 0}
    message = claude.messages.create(
        model="tiny", max_tokens=12, messages=USER,
        thinking={"type": "enabled", "budget_tokens": 2}, extra_body=fields,
    )  # fmt: skip
    reasoning, content, _, _, usage = chat(
        client, max_tokens=12, extra_body={**fields, "thinking_token_budget": 2}
    )
    assert usage.completion_tokens_details.reasoning_tokens == 3
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == reasoning and message.content[1].text == content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12


def test_a_forced_call_cut_by_max_tokens_is_reported_cut(served):
    """Cut inside its parameters, a forced call streams as far as it got and ends with
    "length"; the whole answer leaves it out (its arguments are not JSON)."""
    client, tokenizer, _ = served
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"
    cut_at = len(tokenizer.encode(head, add_special_tokens=False))  # inside the city
    fields = dict(
        tools=[TOOLS[0]],
        tool_choice="required",
        max_tokens=cut_at,
        temperature=0,
        extra_body=NO_THINKING,
    )
    _, content, calls, finish, _ = chat(client, **fields)
    assert (content, calls, finish) == ("", [], "length")
    _, content, calls, finish, _ = chat(client, stream=True, **fields)
    assert content == "" and finish == "length" and len(calls) == 1
    name, arguments = calls[0]
    assert name == "get_weather" and arguments == ""  # its first parameter is not whole


@pytest.fixture(scope="module")
def thinks_a_call(tmp_path_factory):
    """URL of `qinfer serve` on the planted Qwen3.5 that writes its get_weather call inside
    `<think>` (tests/planted_qwen3.py), then closes the block and answers."""
    folder = build_planted_qwen3(
        tmp_path_factory.mktemp("think-call"),
        family="qwen3_5",
        call_in_think=True,
        max_position_embeddings=4096,
    )
    args = ["--model", str(folder), "--served-model-name", "tiny", "--max-model-len", "4096"]
    with serving(*args) as server:
        yield server.url


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_written_inside_think_reaches_the_client_as_a_call(thinks_a_call, stream):
    """The call is not left in `reasoning_content` (vLLM's bug #39056): whole and streamed,
    it comes back as a tool call, the reasoning around it as reasoning."""
    client = openai.OpenAI(base_url=f"{thinks_a_call}/v1", api_key="none", max_retries=0)
    reasoning, content, calls, finish, _ = chat(
        client, stream, tools=TOOLS, temperature=0, max_tokens=40
    )
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [LOOP_CALLS[0]]
    assert (reasoning.strip(), content.strip(), finish) == (
        PLANTED_REASONING, PLANTED_ANSWER, "tool_calls"
    )  # fmt: skip


def test_a_call_written_inside_think_reaches_the_responses_and_messages_apis(thinks_a_call):
    client = openai.OpenAI(base_url=f"{thinks_a_call}/v1", api_key="none", max_retries=0)
    weather = {"type": "function", "name": "get_weather", **{
        k: v for k, v in TOOLS[0]["function"].items() if k != "name"}}  # fmt: skip
    response = client.responses.create(
        model="tiny", input=USER[0]["content"], tools=[weather], temperature=0,
        max_output_tokens=40,
    )  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == LOOP_CALLS[0]
    claude = anthropic.Anthropic(base_url=thinks_a_call, api_key="none", max_retries=0)
    schema = TOOLS[0]["function"]["parameters"]
    message = claude.messages.create(
        model="tiny", max_tokens=40, messages=USER, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "input_schema": schema}],
    )  # fmt: skip
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert (use.name, use.input) == LOOP_CALLS[0] and message.stop_reason == "tool_use"
