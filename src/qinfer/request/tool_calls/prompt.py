"""How a request's tools are shown to the model: given to a template that renders them,
or, for the generic format (`formats`), described in a system message, the history's
calls and tool results rewritten as hermes blocks that any template renders."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from qinfer.request.tool_calls.formats import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCallFormat

#: The system message that describes tools to a template without tool support.
GENERIC_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tool_prompt(
    fmt: ToolCallFormat,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template kwargs) that show `tools` (None: no tools) to the model.

    A template that renders tools gets them as `tools=`; for the generic format they are
    described in the system message (added, or appended to the first one) and the
    history's calls and tool results are rewritten as hermes blocks.
    """
    messages = [dict(message) for message in messages]
    if fmt.in_template:
        return messages, ({"tools": list(tools)} if tools else {})
    history = [_generic_turn(message) for message in messages]
    if not tools:
        return history, {}
    described = GENERIC_TOOLS_PROMPT.format(
        tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    )
    if history and history[0].get("role") == "system":
        first = history[0]
        history[0] = {**first, "content": f"{first.get('content') or ''}\n\n{described}"}
    else:
        history.insert(0, {"role": "system", "content": described})
    return history, {}


def _generic_turn(message: dict[str, Any]) -> dict[str, Any]:
    """One history message as a template without tool support can render it."""
    if message.get("role") == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message.get('content')}\n</tool_response>",
        }
    if message.get("role") == "assistant" and message.get("tool_calls"):
        blocks = [_hermes_block(call["function"]) for call in message["tool_calls"]]
        text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        return {"role": "assistant", "content": text}
    return message


def _hermes_block(function: Mapping[str, Any]) -> str:
    """One call as a hermes block (arguments decoded: the server decodes them)."""
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
