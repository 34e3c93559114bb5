"""What the tool-calling tests share (tests/test_tool_call_formats.py,
tests/test_tool_calls_server.py, tests/test_tool_calls_default_model.py): the tools they
offer, the user turn and tool round trip they send, and the helpers that read calls back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jsonschema

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


@dataclass
class StreamedChoice:
    """One choice of a stream, put together from its deltas; calls: {index: [id, name,
    arguments]}."""

    reasoning: str = ""
    content: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)
    finish_reason: str | None = None


def valid_call(call, tools=TOOLS) -> bool:
    (tool,) = [t for t in tools if t["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    return True
