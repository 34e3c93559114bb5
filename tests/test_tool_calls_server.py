"""Tool calling through `qinfer serve` answering the real `openai` client (and raw HTTP).

The server runs a random Qwen3 checkpoint with Qwen3's real template (tests/text_assets.py),
so its replies are noise unless something forces them: the calls a test expects come from
a grammar (`tool_choice` required or named, or a test's own `guided_grammar`), never
from a mock of the server. Another serves the planted Qwen3 (tests/planted_qwen3.py),
which never ends a reply of its own off its planted path: greedy, under the grammar of
several calls, it writes its one call again and again. The prompt of a tool round trip is
checked against `transformers`' `apply_chat_template(..., tools=...)` on the same files.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from checkpoints import build_checkpoint
from planted_qwen3 import build_planted_qwen3
from servers import serving
from text_assets import save_qwen3_tokenizer
from tool_call_cases import (
    ROUND_TRIP,
    TOOLS,
    USER,
    WEATHER,
    StreamedChoice,
    decoded,
    valid_call,
)

import qinfer
from qinfer.server.schema import MAX_CONSTRAINT_BYTES

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


# --- the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, httpx client, tokenizer, checkpoint folder) of `qinfer serve` on a
    random Qwen3 with Qwen3's template."""
    folder = tmp_path_factory.mktemp("tools-qwen3")
    backend = save_qwen3_tokenizer(folder)
    eos = backend.token_to_id("<|im_end|>")
    # Tools make long prompts for a 400-token vocabulary: 4096 positions of context.
    build_checkpoint(
        folder,
        "qwen3",
        vocab_size=backend.get_vocab_size(),
        eos_token_id=eos,
        max_position_embeddings=4096,
    )
    with serving(
        *("--model", str(folder), "--served-model-name", "tiny", "--max-model-len", "4096")
    ) as server:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120
        )
        with httpx.Client(base_url=server.url, timeout=120) as http:
            yield client, http, qinfer.load_tokenizer(folder), folder


def chat(client, thinking: bool = False, **fields):
    """A chat about USER; thinking: leave Qwen3's thinking on (its template's default)."""
    extra = {**({} if thinking else NO_THINKING), **fields.pop("extra_body", {})}
    fields.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="tiny", messages=USER, extra_body=extra, **fields)


def streamed_choices(client, **fields) -> dict[int, StreamedChoice]:
    """Each choice of a streamed chat, by index."""
    return streamed_chat(client, **fields)[0]


def streamed_chat(
    client, **fields
) -> tuple[dict[int, StreamedChoice], openai.types.CompletionUsage | None]:
    """Each choice of a streamed chat, by index, and the stream's usage."""
    choices: dict[int, StreamedChoice] = {}
    usage = None
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}, **fields):
        usage = chunk.usage or usage
        for delta_choice in chunk.choices:
            choice = choices.setdefault(delta_choice.index, StreamedChoice())
            delta = delta_choice.delta
            choice.reasoning += getattr(delta, "reasoning_content", None) or ""
            choice.content += delta.content or ""
            for call in delta.tool_calls or ():
                if call.id is not None:
                    assert call.index not in choice.calls, "a call's id and name come once"
                    choice.calls[call.index] = [call.id, call.function.name, ""]
                choice.calls[call.index][2] += call.function.arguments or ""
            choice.finish_reason = delta_choice.finish_reason or choice.finish_reason
    return choices, usage


def streamed(client, **fields):
    """(content, {index: [id, name, arguments]}, finish_reason) of a streamed chat."""
    choice = streamed_choices(client, **fields)[0]
    return choice.content, choice.calls, choice.finish_reason


def forcing_grammar(tokenizer, text_parts: list[str | None]) -> str:
    """A Lark grammar that forces exactly this text; None stands for a tag token in turn
    (<tool_call>, </tool_call>, <tool_call>, ...), named by id."""
    tags = [tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("</tool_call>")]
    items, tag = [], 0
    for part in text_parts:
        if part is None:
            items.append(f"<[{tags[tag % 2]}]>")
            tag += 1
        else:
            items.append(json.dumps(part))
    return "start: " + " ".join(items)


def two_call_reply(tokenizer) -> str:
    call = '\n{"name": "%s", "arguments": {"city": "%s"}}\n'
    parts = ["Let me look.", None, call % ("get_weather", "Paris"), None, "\n", None]
    return forcing_grammar(tokenizer, [*parts, call % ("get_time", "Tokyo"), None])


def test_auto_parses_two_calls_whole_and_streamed(served):
    client, _, tokenizer, _ = served
    fields = dict(tools=TOOLS, extra_body={"guided_grammar": two_call_reply(tokenizer)})
    reply = chat(client, **fields).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == "Let me look."
    calls = reply.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris"},
        {"city": "Tokyo"},
    ]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    content, stream_calls, finish = streamed(client, **fields)
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(name, args) for _, name, args in stream_calls.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_tool_choice_none_returns_the_same_text_as_content(served):
    client, _, tokenizer, _ = served
    reply = chat(
        client,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"guided_grammar": two_call_reply(tokenizer)},
    ).choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason == "stop"
    assert reply.message.content.startswith("Let me look.<tool_call>\n")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_always_makes_a_valid_call_streamed_alike(served, seed):
    client, _, _, _ = served
    fields = dict(
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed
    )
    reply = chat(client, **fields).choices[0]
    assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
    assert valid_call(reply.message.tool_calls[0])
    _, calls, finish = streamed(client, **fields)
    call = reply.message.tool_calls[0]
    assert finish == "tool_calls"
    assert [(n, a) for _, n, a in calls.values()] == [(call.function.name, call.function.arguments)]


#: Seeds of eight samples each (choice j seeded seed + j) for the thinking tests; the first
#: already shows every ending on this CPU, the others are there should another CPU's
#: rounding draw otherwise.
THINKING_SEEDS = (16, 24, 32, 40, 48, 56)


def reply_ending(reasoning: str | None, content: str | None, calls, finish: str) -> str:
    """How one reply of a thinking model under tool_choice "required" ended, checked on the
    way: "thought, then called" or "called" (calls, no content), or "stop" / "length"
    inside the think block (EOS or max_tokens before `</think>`: no calls, no content)."""
    assert "</think>" not in (reasoning or "")  # the block ends at the first one
    if finish == "tool_calls":
        assert calls and not content, (content, calls)
        return "thought, then called" if reasoning else "called"
    assert finish in ("stop", "length") and not calls and not content, (finish, content, calls)
    return finish


def test_thinking_then_a_required_call_or_a_clear_end_inside_the_block(served):
    """Qwen3 thinks unconstrained (its template's default); the call's grammar starts after
    `</think>`. A random model may think and then call, call at once, or end inside the
    block by EOS ("stop") or max_tokens ("length"): each is a well-formed reply, and the
    stream carries the same reasoning and calls as the whole answer."""
    client, _, _, _ = served
    endings = set()
    for seed in THINKING_SEEDS:
        fields = dict(
            thinking=True, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, n=8
        )
        whole = chat(client, max_tokens=600, **fields).choices
        stream = streamed_choices(client, max_tokens=600, **fields)
        for choice in whole:
            message = choice.message
            reasoning = getattr(message, "reasoning_content", None)
            endings.add(
                reply_ending(reasoning, message.content, message.tool_calls, choice.finish_reason)
            )
            assert all(valid_call(call) for call in message.tool_calls or ())
            streamed_choice = stream[choice.index]
            assert streamed_choice.reasoning == (reasoning or "")
            assert streamed_choice.finish_reason == choice.finish_reason
            assert [(name, args) for _, name, args in streamed_choice.calls.values()] == [
                (call.function.name, call.function.arguments) for call in message.tool_calls or ()
            ]
        if endings == {"thought, then called", "called", "stop", "length"}:
            return
    pytest.fail(f"{len(THINKING_SEEDS) * 8} samples ended only as {sorted(endings)}")


def test_thinking_off_makes_every_required_call_at_once(served):
    client, _, _, _ = served
    fields = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=16, n=8)
    for choice in chat(client, max_tokens=600, **fields).choices:
        assert getattr(choice.message, "reasoning_content", None) is None
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert all(valid_call(call) for call in choice.message.tool_calls)


def test_a_named_tool_is_called_and_ends_with_stop(served):
    client, _, _, _ = served
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=5).choices[0]
    assert reply.finish_reason == "stop"
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_time" and valid_call(call)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """An openai client of `qinfer serve` on the planted Qwen3 (module docstring)."""
    folder = build_planted_qwen3(
        tmp_path_factory.mktemp("tools-planted"), max_position_embeddings=4096
    )
    with serving(
        *("--model", str(folder), "--served-model-name", "tiny", "--max-model-len", "4096")
    ) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@dataclass
class ForcedReply:
    """What the tests read off a reply under `tool_choice` "required"."""

    calls: list[tuple[str, str]]  # (name, arguments)
    finish_reason: str
    tokens: int  # completion tokens


def forced_reply(client, stream: bool, **fields) -> ForcedReply:
    """A greedy reply of the planted model under `tool_choice` "required", whole or
    streamed (parallel calls at their default unless `fields` say otherwise)."""
    fields = dict(tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=400) | fields
    if stream:
        choices, usage = streamed_chat(client, **fields)
        calls = [(name, arguments) for _, name, arguments in choices[0].calls.values()]
        return ForcedReply(calls, choices[0].finish_reason, usage.completion_tokens)
    reply = chat(client, **fields)
    choice = reply.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return ForcedReply(calls, choice.finish_reason, reply.usage.completion_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_ends_the_reply_once_it_repeats(planted, stream):
    """Parallel calls allowed, the planted model writes its call again: the reply ends as
    soon as the repeat's arguments are complete, with the one call (the repeat never sent)."""
    one = forced_reply(planted, stream, parallel_tool_calls=False)
    assert one.finish_reason == "tool_calls" and len(one.calls) == 1
    repeated = forced_reply(planted, stream)
    assert (repeated.calls, repeated.finish_reason) == (one.calls, "tool_calls")
    assert repeated.tokens < 2 * one.tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_tokens_inside_a_second_call_keeps_the_first(planted, stream):
    one = forced_reply(planted, stream, parallel_tool_calls=False)
    max_tokens = one.tokens * 7 // 4  # inside the repeat's arguments
    cut = forced_reply(planted, stream, max_tokens=max_tokens)
    assert (cut.calls, cut.finish_reason, cut.tokens) == (one.calls, "length", max_tokens)


def test_tool_results_go_back_through_the_template(served):
    client, _, _, folder = served
    from transformers import AutoTokenizer

    reply = client.chat.completions.create(
        model="tiny", messages=ROUND_TRIP, tools=TOOLS, max_tokens=1, extra_body=NO_THINKING
    )
    reference = AutoTokenizer.from_pretrained(folder)
    text = reference.apply_chat_template(
        decoded(ROUND_TRIP),
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert reply.usage.prompt_tokens == len(reference.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice forces a tool call, whose grammar cannot be combined with response_format",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "got response_format and guided_regex",
        ),
    ],
)
def test_conflicting_requests_are_a_400_naming_the_fields(served, fields, message):
    _, http, _, _ = served
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert not response.json()["error"]["message"].startswith("Value error")  # pydantic's words


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope' is not one of the tools",
        ),
        ({"tool_choice": "required"}, "a forced tool call needs tools"),
        ({"tools": [], "tool_choice": "required"}, "a forced tool call needs tools"),
    ],
)
def test_a_tool_choice_without_its_tool_is_a_400_naming_it(served, fields, message):
    _, http, _, _ = served
    body = {"model": "tiny", "messages": USER, **fields}
    error = http.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "tool_choice" and message in error["message"]


BIG_PARAMETERS = {"type": "object", "description": "x" * MAX_CONSTRAINT_BYTES}


@pytest.mark.parametrize(
    ("tools", "param", "message"),
    [
        (
            [TOOLS[0], TOOLS[0]],
            "tools",
            f"two tools are named {TOOLS[0]['function']['name']!r}; tool names must be distinct",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tools.0.function.parameters",
            "not a JSON schema qinfer can follow (Invalid type: nope)",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": BIG_PARAMETERS}}],
            "tools",
            f"the tools' parameters are {len(json.dumps(BIG_PARAMETERS))} bytes; schemas of at "
            f"most {MAX_CONSTRAINT_BYTES} bytes in all are compiled",
        ),
    ],
    ids=["same-name-twice", "parameters-not-a-schema", "parameters-too-large"],
)
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_bad_tools_are_a_400_naming_the_tool_field(served, tools, param, message, tool_choice):
    _, http, _, _ = served
    body = {"model": "tiny", "messages": USER, "tools": tools, "tool_choice": tool_choice}
    error = http.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == param and error["message"] == f"Invalid value for '{param}': {message}"


def test_history_arguments_that_are_not_json_are_a_400_naming_them(served):
    _, http, _, _ = served
    messages = json.loads(json.dumps(ROUND_TRIP))
    messages[2]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    response = http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
    error = response.json()["error"]
    assert response.status_code == 400
    assert error["param"] == "messages.2.tool_calls.0.function.arguments"


HUGE_SCHEMA = {
    "type": "object",
    "properties": {
        f"field_{i:06d}": {"type": "string", "description": "x" * 60} for i in range(12_000)
    },
}


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "nope"}, "json_schema is invalid"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, "Unimplemented keys"),
        (HUGE_SCHEMA, "bytes; constraints of at most"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            "refers back to itself",
        ),
    ],
    ids=["invalid", "unsupported-keyword", "1MB", "recursive-ref"],
)
def test_bad_schemas_are_400s_and_the_server_keeps_serving(served, schema, message):
    client, _, _, _ = served
    assert len(json.dumps(HUGE_SCHEMA)) > 2**20
    with pytest.raises(openai.BadRequestError, match=message):
        chat(client, max_tokens=4, extra_body={"guided_json": schema})
    assert chat(client, max_tokens=2, temperature=0).choices[0].finish_reason == "length"


def live_matchers(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("qinfer_grammar_matchers_live "):
            return float(line.split()[1])
    raise AssertionError("no qinfer_grammar_matchers_live in /metrics")


def test_aborting_200_constrained_streams_frees_every_matcher(served):
    _, http, _, _ = served
    body = {
        "model": "tiny",
        "messages": USER,
        "max_tokens": 400,
        "stream": True,
        "guided_regex": "[a-z ]{400}",
        **NO_THINKING,
    }
    baseline = live_matchers(http)
    for i in range(200):
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line)
            assert next(events).startswith("data: ")  # the role chunk: sent on arrival
            if i == 0:  # a sampled token: its matcher exists, and the gauge sees it
                assert '"content":' in next(events)
                assert live_matchers(http) == baseline + 1
    deadline = time.monotonic() + 30
    while live_matchers(http) != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_matchers(http) == baseline
