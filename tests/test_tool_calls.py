"""Tool calling: prompts through each template, grammars in each wrapping, the parser, and
`qinfer serve` answering the real `openai` client.

The server runs a random Qwen3 checkpoint with Qwen3's real template (tests/text_assets.py),
so its replies are noise unless something forces them: the calls a test expects come from
a grammar (`tool_choice` required or named, or a test's own `guided_grammar`), never
from a mock of the server. Another serves the planted Qwen3 (tests/planted_qwen3.py),
which never ends a reply of its own off its planted path: greedy, under the grammar of
several calls, it writes its one call again and again. Template renderings are checked
against `transformers`' `apply_chat_template(..., tools=...)` on the same files.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import anthropic
import httpx
import jsonschema
import llguidance
import openai
import pytest
from checkpoints import CHATML_TEMPLATE, build_checkpoint
from planted_qwen3 import build_planted_qwen3
from servers import serving
from text_assets import (
    CHATML_SPECIAL,
    save_qwen3_tokenizer,
    save_tokenizer_folder,
    train_tokenizer,
)

import qinfer
from qinfer.request.grammar import _ll_tokenizer
from qinfer.request.tool_calls import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    ToolCallParser,
    tool_call_format,
    tool_call_grammar,
    tool_prompt,
)
from qinfer.request.tool_calls.partial_json import may_become
from qinfer.server.choices import Delta
from qinfer.server.openai.chat import ChatCompletionRequest
from qinfer.server.schema import MAX_CONSTRAINT_BYTES

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

CITY = {"type": "string", "enum": ["Paris", "Tokyo"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

#: A turn as the openai client sends it back: arguments as JSON text, tool results by id.
ROUND_TRIP = [
    {"role": "system", "content": "Use tools."},
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
]


# --- the parser --------------------------------------------------------------------------


def parse(fmt, text: str, step: int, forced: bool, names=("get_weather", "get_time")):
    """(content, [(name, arguments)], calls' deltas) of `text` pushed `step` characters at a time."""
    parser = ToolCallParser(fmt, names, forced)
    deltas = [parser.push(text[i : i + step]) for i in range(0, len(text), step)]
    deltas.append(parser.finish())
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    call_deltas = [c for d in deltas for c in d.tool_calls]
    for c in call_deltas:
        if c.id is not None:
            assert c.index not in calls and c.name is not None
            calls[c.index] = [c.name, ""]
        calls[c.index][1] += c.arguments
    return content, [tuple(call) for call in calls.values()], call_deltas


TWO_CALLS = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"}ris", '
    '"n": [1, {"a": 2}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"city": "Tokyo"}}\n</tool_call>'
)


@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("step", [1, 2, 7, 10_000])
def test_two_hermes_calls_parse_alike_however_the_text_is_split(step, forced):
    content, calls, _ = parse(HERMES, TWO_CALLS, step, forced)
    assert content == "Let me look."
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": 'Pa"}ris', "n": [1, {"a": 2}]}
    assert json.loads(calls[1][1]) == {"city": "Tokyo"}


@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_text_after_calls_keeps_its_spaces_however_the_text_is_split(step, forced):
    content, calls, _ = parse(HERMES, TWO_CALLS + "\n\nDone, and  ok.", step, forced)
    assert content == "Let me look.Done, and  ok." and len(calls) == 2


def test_forced_calls_stream_their_arguments_in_fragments():
    _, _, deltas = parse(HERMES, TWO_CALLS, 3, forced=True)
    assert sum(1 for d in deltas if d.index == 0 and d.arguments) > 3


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_a_forced_call_cut_short_is_left_out_and_the_complete_ones_kept(step):
    """max_tokens ends the reply inside the second call's arguments: a whole answer keeps
    the first call and leaves the second out, rather than hand on unparsable arguments."""
    cut = TWO_CALLS[: TWO_CALLS.rindex("Tokyo")]
    parser = ToolCallParser(HERMES, ("get_weather", "get_time"), forced=True)
    parsed = [parser.push(cut[i : i + step]) for i in range(0, len(cut), step)]
    parsed.append(parser.finish())
    assert parsed[-1].cut_call == 1 and all(p.cut_call is None for p in parsed[:-1])
    answer = Delta(0)
    for p in parsed:
        answer.extend(Delta(0, content=p.content, tool_calls=p.tool_calls, cut_call=p.cut_call))
    assert [call.name for call in answer.tool_calls] == ["get_weather"]
    assert json.loads(answer.tool_calls[0].arguments)["city"] == 'Pa"}ris'


def call_block(name: str, arguments: str) -> str:
    """A hermes call block, its arguments as written."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = '{"city": "Paris", "days": 2}'
#: PARIS written otherwise: the same JSON (key order, spaces and an escape aside).
PARIS_AGAIN = '{ "days" : 2, "city": "Pa\\u0072is" }'
REPEATING = "\n".join(
    [
        call_block("get_weather", PARIS),
        call_block("get_weather", PARIS_AGAIN),
        call_block("get_time", '{"city": "Tokyo"}'),
    ]
)


def repeated_after(text: str, forced: bool) -> int | None:
    """How many characters of `text`, pushed one at a time, the parser read when it found
    the reply repeating a call (None: it never did)."""
    parser = ToolCallParser(HERMES, ("get_weather", "get_time"), forced)
    for i, char in enumerate(text):
        parser.push(char)
        if parser.repeated:
            return i + 1
    return None


@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("step", [1, 5, 10_000])
def test_a_repeated_call_ends_the_reply_and_is_never_sent(step, forced):
    """The same call again (as JSON: not as text) ends the reply: it is never sent, and
    what follows it (here a call of another tool) is ignored."""
    content, calls, _ = parse(HERMES, REPEATING + " Done.", step, forced)
    assert content == "" and calls == [("get_weather", PARIS)]
    end = REPEATING.index(PARIS_AGAIN) + len(PARIS_AGAIN)
    # A forced repeat is over once its arguments are; an unforced one once its block is.
    expected = end if forced else REPEATING.index("</tool_call>", end) + len("</tool_call>")
    assert repeated_after(REPEATING, forced) == expected


def test_a_call_of_the_same_tool_is_held_until_its_arguments_differ():
    """A second call of get_weather goes out as soon as its arguments cannot be the first
    call's (its id, name and arguments so far at once); a call of another tool at once."""
    other_days = '{"city": "Paris", "days": 3}'
    time_call = call_block("get_time", '{"city": "Tokyo"}')
    text = "\n".join([call_block("get_weather", PARIS), call_block("get_weather", other_days)])
    text += "\n" + time_call
    parser = ToolCallParser(HERMES, ("get_weather", "get_time"), forced=True)
    opened = {}  # call index -> (characters read when it went out, its first delta)
    for i, char in enumerate(text):
        for call in parser.push(char).tool_calls:
            if call.id is not None:
                opened[call.index] = (i + 1, call)
    assert not parser.repeated
    second_at, second = opened[1]
    assert second_at == text.index("3}") + 1
    assert (second.name, second.arguments) == ("get_weather", '{"city": "Paris", "days": 3')
    third_at, third = opened[2]
    assert third_at == text.index('{"city": "Tokyo"}') + 1 and third.arguments == ""
    assert [name for name, _ in parse(HERMES, text, 1, forced=True)[1]] == [
        "get_weather",
        "get_weather",
        "get_time",
    ]


@pytest.mark.parametrize(
    ("cut", "cut_call"),
    [
        ("<tool_", None),  # in the opening tag
        ('<tool_call>\n{"na', None),  # in the header
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None),  # held
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "To', 1),  # sent
    ],
    ids=["tag", "header", "possible-repeat", "other-arguments"],
)
def test_a_forced_reply_cut_in_its_second_call_keeps_the_first(cut, cut_call):
    """max_tokens (or a stop string) ends the reply inside its second call: the whole
    answer is the first call; what of the second was never sent is dropped, and one sent
    already is marked cut."""
    parser = ToolCallParser(HERMES, ("get_weather", "get_time"), forced=True)
    parsed = [parser.push(call_block("get_weather", PARIS) + "\n"), parser.push(cut)]
    parsed.append(parser.finish())
    assert parsed[-1].cut_call == cut_call and parser.made_calls
    answer = Delta(0)
    for p in parsed:
        answer.extend(Delta(0, content=p.content, tool_calls=p.tool_calls, cut_call=p.cut_call))
    assert answer.content == ""
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [("get_weather", PARIS)]


VALUE = {"city": "Paris", "days": 2, "tags": ["a", "b"], "x": None, "ok": True, "q": 1.5}


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(VALUE),
        json.dumps(VALUE, indent=2),
        '{"q": 15e-1, "ok": true, "x": null, "tags": [ "a" ,"b"], "days": 2, "city": "\\u0050aris"}',
    ],
    ids=["compact", "indented", "reordered"],
)
def test_every_start_of_a_json_text_may_become_its_value(text):
    assert json.loads(text) == VALUE
    assert all(may_become(text[:i], VALUE) for i in range(len(text) + 1))


@pytest.mark.parametrize(
    "start",
    [
        '{"city": "T',  # another string
        '{"days": 3',  # another integer
        '{"days": 2.0',  # a float is another number
        '{"ok": 1',  # 1 is not true
        '{"tags": ["a"]',  # fewer items
        '{"days": 2, "days"',  # a key twice
        '{"extra"',  # a key the value has not
        '{"city": "Paris", "days": 2, "tags": ["a", "b"], "x": null, "ok": true}',  # one short
    ],
)
def test_a_json_start_that_differs_cannot_become_the_value(start):
    assert not may_become(start, VALUE)


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "get_weather", "arguments": {city: Paris}}',  # malformed JSON
        '{"name": "rm_rf", "arguments": {}}',  # a tool that was not offered
        "not json at all",
        '{"name": "get_weather", "arguments": ["Paris"]}',  # arguments are an object
        '{"name": "get_weather", "arguments": "Paris"}',
    ],
)
def test_an_unforced_block_that_is_not_a_call_is_content(block):
    text = f"Hi <tool_call>\n{block}\n</tool_call> bye"
    assert parse(HERMES, text, 3, forced=False)[:2] == (text, [])


def test_arguments_written_as_json_text_are_decoded_once():
    block = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})})
    content, calls, _ = parse(HERMES, f"<tool_call>\n{block}\n</tool_call>", 5, forced=False)
    assert content == "" and calls == [("get_weather", '{"city": "Paris"}')]


def test_a_half_written_tag_is_held_back_until_known():
    parser = ToolCallParser(HERMES, ["get_weather"], forced=False)
    assert parser.push("Hello <tool_").content == "Hello "
    assert parser.push("box>").content == "<tool_box>"


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  "])
@pytest.mark.parametrize("forced", [True, False])
def test_llama3_json_call_optionally_after_python_tag(prefix, forced):
    text = prefix + '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls, _ = parse(LLAMA3_JSON, text, 2, forced)
    assert content == "" and calls[0][0] == "get_weather"
    assert json.loads(calls[0][1]) == {"city": "Paris"}


@pytest.mark.parametrize("text", ["Paris is sunny {really}", '{"answer": 1}'])
def test_llama3_text_or_other_json_is_content(text):
    assert parse(LLAMA3_JSON, text, 2, forced=False)[:2] == (text, [])


# --- templates ---------------------------------------------------------------------------


def server_prompt(tokenizer, body: dict) -> str:
    """The prompt text the server renders for a request body (its own code path)."""
    request = ChatCompletionRequest.model_validate_json(json.dumps(body))
    messages, kwargs = tool_prompt(
        tool_call_format(tokenizer),
        [m.for_template() for m in request.messages],
        request.offered_tools(),
    )
    return tokenizer.apply_chat_template(messages, **kwargs)


def decoded(messages: list[dict]) -> list[dict]:
    """The messages as the templates expect them: each call's arguments decoded, the
    content of a turn of only calls "" rather than null."""
    out = json.loads(json.dumps(messages))
    for message in out:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if message.get("tool_calls") and message["content"] is None:
            message["content"] = ""
    return out


@pytest.mark.parametrize("pair", ["qwen3_pair", "llama3_pair"])
def test_tool_round_trip_renders_like_transformers(pair, request):
    ours, reference = request.getfixturevalue(pair)
    expected = reference.apply_chat_template(
        decoded(ROUND_TRIP), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert server_prompt(ours, {"messages": ROUND_TRIP, "tools": TOOLS}) == expected
    assert "get_time" in expected and "temp" in expected


def test_formats_are_read_off_the_templates(qwen3_pair, llama3_pair, tmp_path):
    plain = save_tokenizer_folder(
        tmp_path, train_tokenizer(CHATML_SPECIAL), chat_template=CHATML_TEMPLATE
    )
    assert tool_call_format(qwen3_pair[0]) is HERMES
    assert tool_call_format(llama3_pair[0]) is LLAMA3_JSON
    assert tool_call_format(qinfer.load_tokenizer(plain)) is GENERIC


def test_generic_format_describes_tools_in_the_system_message_and_rewrites_history():
    messages, kwargs = tool_prompt(GENERIC, decoded(ROUND_TRIP), TOOLS)
    assert kwargs == {}
    system = messages[0]["content"]
    assert system.startswith("Use tools.\n\n# Tools")
    assert all(json.dumps(tool) in system for tool in TOOLS) and "<tool_call>" in system
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert messages[3] == {
        "role": "user",
        "content": '<tool_response>\n{"temp": 18}\n</tool_response>',
    }


def test_tool_choice_none_shows_no_tools(qwen3_pair):
    ours, reference = qwen3_pair
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "none"}
    expected = reference.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert server_prompt(ours, body) == expected


def test_strict_false_leaves_objects_open():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}
    for strict, additional in ((False, True), (True, None), (None, None)):
        body["response_format"]["json_schema"] = {"name": "r", "schema": schema, "strict": strict}
        request = ChatCompletionRequest.model_validate(body)
        assert (
            json.loads(json.dumps(request.constraint()["json_schema"])).get("additionalProperties")
            == additional
        )


# --- grammars ----------------------------------------------------------------------------


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether llguidance's matcher of `grammar` takes `text` (as the tokenizer encodes it)
    through to an accepting state."""
    matcher = llguidance.LLMatcher(
        _ll_tokenizer(tokenizer, tokenizer.eos_token_ids),
        llguidance.grammar_from("grammar", grammar),
        log_level=0,
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_grammar_names_the_tags_by_id_and_follows_the_schemas(qwen3_pair):
    tokenizer = qwen3_pair[0]
    grammar = tool_call_grammar(HERMES, TOOLS, tokenizer, parallel=True)
    assert f"<[{tokenizer.token_to_id('<tool_call>')}]>" in grammar
    one = hermes_call("get_weather", {"city": "Paris", "days": 2})
    two = one + "\n" + hermes_call("get_time", {"city": "Tokyo"})
    assert accepts(tokenizer, grammar, one) and accepts(tokenizer, grammar, two)
    assert not accepts(tokenizer, grammar, hermes_call("get_weather", {"city": "Rome"}))
    assert not accepts(tokenizer, grammar, hermes_call("get_weather", {"city": "Paris", "x": 1}))
    assert not accepts(tokenizer, grammar, hermes_call("delete_all", {}))
    assert not accepts(tokenizer, grammar, "Sure. " + one)
    single = tool_call_grammar(HERMES, TOOLS, tokenizer, parallel=False)
    assert accepts(tokenizer, single, one) and not accepts(tokenizer, single, two)


# A pydantic model's schema as LangChain, pydantic-ai and instructor send it: no
# additionalProperties anywhere, the nested model under $defs.
TRIP_SCHEMA = {
    "$defs": {
        "City": {
            "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
            "required": ["name", "country"],
            "type": "object",
        }
    },
    "properties": {"destination": {"$ref": "#/$defs/City"}, "days": {"type": "integer"}},
    "required": ["destination", "days"],
    "type": "object",
}
TRIP = {"destination": {"name": "Paris", "country": "France"}, "days": 3}


def trip_tool(schema: dict, **function) -> dict:
    return {"type": "function", "function": {"name": "Trip", "parameters": schema, **function}}


def test_forced_calls_allow_no_undeclared_keys_unless_the_schema_says_so(qwen3_pair):
    tokenizer = qwen3_pair[0]
    closed = tool_call_grammar(HERMES, [trip_tool(TRIP_SCHEMA)], tokenizer)
    extra_top = {**TRIP, "note": "x"}
    extra_nested = {**TRIP, "destination": {**TRIP["destination"], "note": "x"}}
    assert accepts(tokenizer, closed, hermes_call("Trip", TRIP))
    assert not accepts(tokenizer, closed, hermes_call("Trip", extra_top))
    assert not accepts(tokenizer, closed, hermes_call("Trip", extra_nested))
    opened = json.loads(json.dumps(TRIP_SCHEMA))
    opened["$defs"]["City"]["additionalProperties"] = True
    nested_open = tool_call_grammar(HERMES, [trip_tool(opened)], tokenizer)
    assert accepts(tokenizer, nested_open, hermes_call("Trip", extra_nested))
    assert not accepts(tokenizer, nested_open, hermes_call("Trip", extra_top))
    lenient = tool_call_grammar(HERMES, [trip_tool(TRIP_SCHEMA, strict=False)], tokenizer)
    assert accepts(tokenizer, lenient, hermes_call("Trip", extra_top))
    assert accepts(tokenizer, lenient, hermes_call("Trip", extra_nested))
    # Its $ref still finds $defs when the call is one of several tools' (an anyOf).
    either = tool_call_grammar(HERMES, [WEATHER, trip_tool(TRIP_SCHEMA)], tokenizer)
    assert accepts(tokenizer, either, hermes_call("Trip", TRIP))
    assert not accepts(tokenizer, either, hermes_call("Trip", extra_nested))


def test_llama3_grammar_is_one_bare_json_call(llama3_pair):
    tokenizer = llama3_pair[0]
    grammar = tool_call_grammar(LLAMA3_JSON, [TIME], tokenizer)
    call = {"name": "get_time", "parameters": {"city": "Paris"}}
    assert accepts(tokenizer, grammar, json.dumps(call))
    assert not accepts(tokenizer, grammar, json.dumps({**call, "name": "get_weather"}))
    assert not accepts(tokenizer, grammar, json.dumps(call) + "; " + json.dumps(call))


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


@dataclass
class StreamedChoice:
    """One choice of a stream, put together from its deltas; calls: {index: [id, name,
    arguments]}."""

    reasoning: str = ""
    content: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)
    finish_reason: str | None = None


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


def valid_call(call, tools=TOOLS) -> bool:
    (tool,) = [t for t in tools if t["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    return True


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
