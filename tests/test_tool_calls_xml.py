"""Qwen3.5's XML tool calls without a server: the parser whole and streamed, values read by
their schema's types, malformed and cut calls, calls written inside `<think>`, the
template's own rendering of tools and earlier calls (against `transformers`'
`apply_chat_template(..., tools=...)` on Qwen3.5's template, tests/qwen3_5_chat_template.jinja),
and the grammar that forces a call (what llguidance accepts, and what a random model
writes under it).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from checkpoints import build_checkpoint
from test_tool_call_formats import accepts
from text_assets import save_qwen3_5_tokenizer, save_qwen3_tokenizer, tokenizer_pair
from tool_call_cases import ROUND_TRIP, TOOLS, decoded

import qinfer
from qinfer import SamplingParams, generate
from qinfer.engine.outputs import RequestOutput
from qinfer.request.tool_calls import (
    HERMES,
    QWEN3_XML,
    ToolUse,
    XmlCallParser,
    parse_xml_call,
    tool_call_format,
    tool_call_grammar,
    tool_prompt,
)
from qinfer.request.tool_calls.xml_calls import parameter_value
from qinfer.server.choices import Choice, Delta
from qinfer.server.openai.chat import ChatCompletionRequest

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
RICH = {  # every kind of value
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "flag": {"type": "boolean"},
        "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "maybe": {"type": ["integer", "null"]},
    },
}


def xml_call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


TWO_CALLS = (
    "Let me look.\n"
    + xml_call("get_weather", city="Paris", days="3")
    + "\n"
    + xml_call("get_time", city="Tokyo")
)


def parse(text: str, step: int, forced: bool = False, tools=SCHEMAS):
    """(content, [(index, name, arguments)], cut calls) of `text` pushed `step` characters
    at a time; a cut call's arguments stay text (they are not JSON)."""
    parser = XmlCallParser(tools, forced)
    deltas = [parser.push(text[i : i + step]) for i in range(0, len(text), step)]
    deltas.append(parser.finish())
    calls: dict[int, list] = {}
    for call in (c for d in deltas for c in d.tool_calls):
        if call.id is not None:
            assert call.index not in calls and call.name is not None
            calls[call.index] = [call.index, call.name, ""]
        calls[call.index][2] += call.arguments
    cut = [d.cut_call for d in deltas if d.cut_call is not None]
    for index, call in calls.items():
        call[2] = call[2] if index in cut else json.loads(call[2])
    return "".join(d.content for d in deltas), [tuple(c) for c in calls.values()], cut


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("step", [1, 2, 7, 10_000])
def test_two_xml_calls_parse_alike_however_the_text_is_split(step, forced):
    content, calls, cut = parse(TWO_CALLS, step, forced)
    assert content == "Let me look.\n" and not cut
    assert calls == [
        (0, "get_weather", {"city": "Paris", "days": 3}),
        (1, "get_time", {"city": "Tokyo"}),
    ]


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("text", "two\nlines", "two\nlines"),
        ("text", "42", "42"),  # a string stays as written
        ("n", "42", 42),
        ("n", "4.0", 4),
        ("n", "many", "many"),  # not its type: kept as text, as vLLM keeps it
        ("x", "2.5", 2.5),
        ("flag", "true", True),
        ("flag", "yes", "yes"),
        ("opts", '{"a": [1, null]}', {"a": [1, None]}),
        ("tags", '["a", "b"]', ["a", "b"]),
        ("tags", "{}", "{}"),
        ("maybe", "null", None),
        ("maybe", "7", 7),
    ],
)
def test_values_are_read_as_their_schema_types(key, text, value):
    assert parameter_value(text, RICH["properties"][key]) == value
    assert parse_xml_call(
        f"<function=f>\n<parameter={key}>\n{text}\n</parameter>\n</function>", {"f": RICH}
    ) == ("f", {key: value})


@pytest.mark.parametrize(
    "block",
    [
        xml_call("delete_all", city="Paris"),  # an unknown tool
        xml_call("get_weather", town="Paris"),  # an unknown parameter
        "<tool_call>\nget_weather(Paris)\n</tool_call>",  # no <function=...>
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",  # stray text
    ],
)
@pytest.mark.parametrize("step", [1, 10_000])
def test_a_block_that_is_not_a_call_of_an_offered_tool_is_content(block, step):
    assert parse(block, step) == (block, [], [])


def test_forced_calls_stream_a_parameter_at_a_time():
    parser = XmlCallParser(SCHEMAS, forced=True)
    head = parser.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert [(c.index, c.name, c.arguments) for c in head.tool_calls] == [(0, "get_weather", "")]
    city = parser.push("is\n</parameter>\n<parameter=days>\n")
    assert [c.arguments for c in city.tool_calls] == ['{"city": "Paris"']
    rest = parser.push("3\n</parameter>\n</function>\n</tool_call>")
    assert [c.arguments for c in rest.tool_calls] == [', "days": 3', "}"]
    assert parser.made_calls


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("step", [1, 10_000])
def test_a_call_cut_short_is_a_partial_call_marked_cut(step, forced):
    cut = TWO_CALLS[: TWO_CALLS.index("Tokyo")]
    content, calls, cut_calls = parse(cut, step, forced)
    assert content == "Let me look.\n" and cut_calls == [1]
    partial = "" if forced else "{}"  # streamed: nothing whole yet; else what parsed whole
    assert calls == [(0, "get_weather", {"city": "Paris", "days": 3}), (1, "get_time", partial)]
    # cut before its function's name: content when unforced, nothing when forced
    start = "Sure.\n<tool_call>\n<function=get_w"
    assert parse(start, step) == (start, [], [])
    assert parse(start, step, forced=True) == ("Sure.\n", [], [])


@pytest.mark.parametrize("step", [1, 10_000])
def test_a_repeated_call_ends_the_reply_and_is_never_sent(step):
    once = xml_call("get_time", city="Tokyo")
    other = xml_call("get_time", city="Paris")  # the same tool: held until it differs
    content, calls, _ = parse(f"{once}\n{other}\n{once}\nmore", step, forced=True)
    assert content == ""
    assert calls == [(0, "get_time", {"city": "Tokyo"}), (1, "get_time", {"city": "Paris"})]


def output(text: str, delta: str, finished: bool) -> RequestOutput:
    return RequestOutput(
        "r", None, [1], text, [], delta, [], finished, "stop" if finished else None, None,
        1, 0, 0, None, prompt_opened_think=True,
    )  # fmt: skip


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_a_call_written_inside_think_is_still_a_call(step):
    """Qwen3.5 writes a call inside <think> (the prompt opened it): it is returned as a call
    numbered before the answer's, not left in the reasoning."""
    text = "I need the time.\n" + xml_call("get_time", city="Tokyo") + "\n</think>\n\n"
    text += "Checking.\n" + xml_call("get_weather", city="Paris")
    tools = ToolUse(QWEN3_XML, ("get_weather", "get_time"), None, SCHEMAS)
    choice = Choice(0, "r", [1], SamplingParams(), split_reasoning=True, tools=tools)
    whole = Delta(0)
    for start in range(0, len(text), step):
        end = min(start + step, len(text))
        whole.extend(choice.advance(output(text[:end], text[start:end], end == len(text))))
    assert whole.reasoning == "I need the time.\n" and whole.content == "Checking.\n"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        (0, "get_time", {"city": "Tokyo"}),
        (1, "get_weather", {"city": "Paris"}),
    ]
    assert whole.finish_reason == "tool_calls"


def test_hermes_leaves_the_reasoning_to_the_reasoning():
    tools = ToolUse(HERMES, ("get_time",), None, SCHEMAS)
    assert tools.reasoning_parser(tools.parser()) is None


# --- the template and the grammar ---------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_5_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5-tokenizer")
    save_qwen3_5_tokenizer(folder)
    return tokenizer_pair(folder)


def test_the_format_is_read_off_the_template(qwen3_5_pair, tmp_path):
    save_qwen3_tokenizer(tmp_path)
    assert tool_call_format(qwen3_5_pair[0]) is QWEN3_XML
    assert tool_call_format(qinfer.load_tokenizer(tmp_path)) is HERMES


@pytest.mark.parametrize("thinking", [True, False])
def test_tools_and_earlier_calls_render_as_transformers_renders_them(qwen3_5_pair, thinking):
    ours, reference = qwen3_5_pair
    history = [*ROUND_TRIP, {"role": "assistant", "content": "Sunny.", "tool_calls": [
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "days": 2}'}},
    ]}, {"role": "tool", "tool_call_id": "c2", "content": "rain"}]  # fmt: skip
    request = ChatCompletionRequest.model_validate({"messages": history, "tools": TOOLS})
    messages, kwargs = tool_prompt(  # as the server renders a request (`encode_chat`)
        tool_call_format(ours),
        [m.for_template() for m in request.messages],
        request.offered_tools(),
    )
    expected = reference.apply_chat_template(
        decoded(history),
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    assert ours.apply_chat_template(messages, **kwargs, enable_thinking=thinking) == expected
    assert "<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n" in expected
    assert "<parameter=days>\n2\n</parameter>" in expected and "<tools>" in expected


def test_the_grammar_forces_xml_calls_of_the_schemas(qwen3_5_pair):
    tokenizer = qwen3_5_pair[0]
    grammar = tool_call_grammar(QWEN3_XML, TOOLS, tokenizer, parallel=True)
    assert f"<[{tokenizer.token_to_id('<tool_call>')}]>" in grammar
    one = xml_call("get_weather", city="Paris", days="2")
    two = one + "\n" + xml_call("get_time", city="Tokyo")
    assert accepts(tokenizer, grammar, one) and accepts(tokenizer, grammar, two)
    assert accepts(tokenizer, grammar, xml_call("get_weather", city="Paris"))  # days optional
    assert not accepts(tokenizer, grammar, xml_call("get_weather", city="Rome"))
    assert not accepts(tokenizer, grammar, xml_call("get_weather", city="Paris", days="8"))
    assert not accepts(tokenizer, grammar, xml_call("get_weather", days="2"))  # city required
    assert not accepts(tokenizer, grammar, xml_call("get_weather", city="Paris", x="1"))
    assert not accepts(tokenizer, grammar, "Sure. " + one)
    single = tool_call_grammar(QWEN3_XML, TOOLS, tokenizer, parallel=False)
    assert accepts(tokenizer, single, one) and not accepts(tokenizer, single, two)
    rich = tool_call_grammar(
        QWEN3_XML, [{"function": {"name": "f", "parameters": RICH}}], tokenizer, False
    )
    text = xml_call("f", text="a <b> c\nd", n="3", flag="false", opts='{"k": [1]}')
    assert accepts(tokenizer, rich, text)
    assert not accepts(tokenizer, rich, xml_call("f", n="three"))
    assert not accepts(tokenizer, rich, xml_call("f", text="a </b>"))


def test_a_random_model_under_the_grammar_writes_calls_that_parse(tmp_path):
    """Sampled, a random Qwen3.5 under the forced-call grammar writes calls the parser
    reads whole, with arguments valid under their tool's schema."""
    backend = save_qwen3_5_tokenizer(tmp_path)
    build_checkpoint(  # tools make a prompt of ~1200 tokens of this small vocabulary
        tmp_path,
        "qwen3",
        vocab_size=backend.get_vocab_size(),
        eos_token_id=backend.token_to_id("<|im_end|>"),
        num_hidden_layers=1,
        max_position_embeddings=2048,
    )
    model = qinfer.load_model(tmp_path, dtype=torch.float32, device="cpu")
    tokenizer = qinfer.load_tokenizer(tmp_path)
    grammar = tool_call_grammar(QWEN3_XML, TOOLS, tokenizer, parallel=False)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=120, grammar=grammar)
        for seed in range(3)
    ]
    messages = [[{"role": "user", "content": "Weather?"}]] * 3
    results = generate(
        model, tokenizer, messages, params, chat=True, tools=TOOLS, enable_thinking=False
    )
    for result in results:
        assert result.finish_reason == "eos", result.text
        content, calls, cut = parse(result.answer, 10_000, forced=True)
        assert content == "" and not cut and len(calls) == 1, result.text
        _, name, arguments = calls[0]
        jsonschema.validate(arguments, SCHEMAS[name])
