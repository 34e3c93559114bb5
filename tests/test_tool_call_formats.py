"""Tool-call formats without a server: the parser of each format (hermes, llama3 JSON),
prompts through each template, and grammars in each wrapping. Template renderings are
checked against `transformers`' `apply_chat_template(..., tools=...)` on the same files;
grammars by what llguidance's matcher of them accepts.
"""

from __future__ import annotations

import json

import llguidance
import pytest
from checkpoints import CHATML_TEMPLATE
from text_assets import CHATML_SPECIAL, save_tokenizer_folder, train_tokenizer
from tool_call_cases import ROUND_TRIP, TIME, TOOLS, USER, WEATHER, decoded

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

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow


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
