"""Chat templates render byte for byte as `transformers`' apply_chat_template(tokenize=False).

The reference is `AutoTokenizer.from_pretrained` on the same folder qinfer reads, holding
Qwen3's and Llama 3.2's real templates (tests/text_assets.py; the `qwen3_pair` and
`llama3_pair` fixtures of tests/conftest.py).
"""

import pytest

import qinfer
from qinfer.core.errors import TokenizerError
from qinfer.text.chat_template import render_chat_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city <in °C> & wind, e.g. 東京",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

SYSTEM_MULTI_TURN = [
    {"role": "system", "content": "You are terse. Réponds en français si besoin."},
    {"role": "user", "content": "Hi! 👋"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]

QWEN3_TOOL_TURNS = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "days": 2}'},
            },
        ],
    },
    {"role": "tool", "content": '{"temp": 18}'},
    {"role": "tool", "content": '{"temp": 25}'},
    {"role": "assistant", "content": "<think>\nBoth fetched.\n</think>\n\nParis 18, Tokyo 25."},
    {"role": "user", "content": "Thanks"},
]

QWEN3_THINKING_HISTORY = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "times 3?"},
    {"role": "assistant", "content": "12", "reasoning_content": "\n4*3\n"},
]

LLAMA3_TOOL_TURNS = [
    {"role": "system", "content": "  Be helpful.  "},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 18}'},
]


def assert_renders_like_transformers(pair, messages, **kwargs):
    ours, reference = pair
    expected = reference.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_system_and_multi_turn(qwen3_pair, add_generation_prompt):
    assert_renders_like_transformers(
        qwen3_pair, SYSTEM_MULTI_TURN, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_enable_thinking(qwen3_pair, enable_thinking, add_generation_prompt):
    assert_renders_like_transformers(
        qwen3_pair,
        QWEN3_THINKING_HISTORY + [{"role": "user", "content": "and minus 1?"}],
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


def test_qwen3_last_assistant_turn_keeps_its_reasoning(qwen3_pair):
    assert_renders_like_transformers(
        qwen3_pair, QWEN3_THINKING_HISTORY, add_generation_prompt=False
    )


def test_qwen3_tool_calls_and_tool_responses(qwen3_pair):
    assert_renders_like_transformers(
        qwen3_pair, QWEN3_TOOL_TURNS, tools=[WEATHER_TOOL], add_generation_prompt=True
    )


def test_qwen3_null_fields_are_dropped_like_openai_clients_send_them(qwen3_pair):
    messages = [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Hello", "tool_calls": None},
        {"role": "user", "content": "Bye"},
    ]
    assert_renders_like_transformers(qwen3_pair, messages, add_generation_prompt=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_llama3_system_and_multi_turn(llama3_pair, add_generation_prompt):
    assert_renders_like_transformers(
        llama3_pair,
        SYSTEM_MULTI_TURN,
        add_generation_prompt=add_generation_prompt,
        date_string="1 Jan 2026",
    )


def test_llama3_today_date_comes_from_strftime_now(llama3_pair):
    assert_renders_like_transformers(llama3_pair, SYSTEM_MULTI_TURN, add_generation_prompt=True)


def test_llama3_tools_are_indented_json_in_the_first_user_message(llama3_pair):
    assert_renders_like_transformers(
        llama3_pair,
        LLAMA3_TOOL_TURNS,
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        date_string="x",
    )


def test_rendered_prompt_encodes_to_the_same_ids(qwen3_pair):
    ours, reference = qwen3_pair
    expected = reference.apply_chat_template(
        QWEN3_TOOL_TURNS, tools=[WEATHER_TOOL], tokenize=True, return_dict=False
    )
    text = ours.apply_chat_template(
        QWEN3_TOOL_TURNS, tools=[WEATHER_TOOL], add_generation_prompt=False
    )
    assert ours.encode(text, add_special_tokens=False) == list(expected)


def test_template_exception_names_the_message_and_the_reason(llama3_pair):
    ours, _ = llama3_pair
    two_calls = dict(LLAMA3_TOOL_TURNS[2])
    two_calls["tool_calls"] = two_calls["tool_calls"] * 2
    messages = [LLAMA3_TOOL_TURNS[1], two_calls]
    with pytest.raises(TokenizerError, match=r"messages\[1\].*assistant.*single tool-calls"):
        ours.apply_chat_template(messages)


def test_template_type_error_names_the_message_it_was_reading(qwen3_pair):
    ours, _ = qwen3_pair
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": 42},
        {"role": "assistant", "content": "c"},
    ]
    with pytest.raises(TokenizerError) as caught:
        ours.apply_chat_template(messages)
    message = str(caught.value)
    assert message.startswith("chat template failed to render at line ")
    assert "(reading messages[2], role 'user')" in message and "\n" not in message


def test_template_syntax_error_is_reported(qwen3_pair):
    tokenizer = qinfer.Tokenizer(qwen3_pair[0].backend, chat_template="{% for m in messages %}")
    with pytest.raises(TokenizerError, match="does not parse: line 1"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages, fault",
    [
        ([], "empty"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\] has no 'role'"),
    ],
)
def test_malformed_messages_are_rejected(qwen3_pair, messages, fault):
    with pytest.raises(TokenizerError, match=fault):
        qwen3_pair[0].apply_chat_template(messages)


def test_tokenizer_without_template_says_so(qwen3_pair):
    tokenizer = qinfer.Tokenizer(qwen3_pair[0].backend)
    assert not tokenizer.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_templates_cannot_reach_python_internals(qwen3_pair):
    escape = "{{ messages.__class__.__mro__ }}"
    tokenizer = qinfer.Tokenizer(qwen3_pair[0].backend, chat_template=escape)
    with pytest.raises(TokenizerError):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("alias", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_under_any_of_its_names_reaches_the_template(qwen3_pair, alias):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", alias: "add them"},
    ]
    assert_renders_like_transformers(qwen3_pair, messages, add_generation_prompt=False)


def test_smollm2_gguf_template_renders_like_transformers(smollm2_reader):
    from transformers.utils.chat_template_utils import render_jinja_template

    field = smollm2_reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    messages = SYSTEM_MULTI_TURN[1:]
    (expected,), _ = render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=True
    )
    assert render_chat_template(template, messages, add_generation_prompt=True) == expected


def test_pydantic_messages_and_tools_render_as_their_dicts(qwen3_pair):
    import pydantic

    class Message(pydantic.BaseModel):
        role: str
        content: str

    class Tool(pydantic.BaseModel):
        type: str
        function: dict

    ours, _ = qwen3_pair
    messages = [Message(role="user", content="Weather?")]
    expected = ours.apply_chat_template([m.model_dump() for m in messages], tools=[WEATHER_TOOL])
    assert ours.apply_chat_template(messages, tools=[Tool(**WEATHER_TOOL)]) == expected


def test_tool_that_is_not_a_schema_is_rejected(qwen3_pair):
    with pytest.raises(TokenizerError, match=r"tools\[1\] must be a dict, got str"):
        qwen3_pair[0].apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL, "get_weather"]
        )
