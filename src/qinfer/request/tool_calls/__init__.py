"""Tool calls in each model family's own format, one concern a module:

    formats        hermes, qwen3_xml, llama3_json, generic; `tool_call_format(tokenizer)` picks one
    prompt         how the tools are shown to the model (`tool_prompt`)
    grammar        the grammar that forces a call (`tool_call_grammar`), the schema check
    use            a request's tools and its replies' parsers (`ToolUse`)
    parser         the streaming parser: a reply -> content and call deltas (`ToolUse`)
    xml_calls      Qwen3.5's XML calls: their parser (`XmlCallParser`), values by type
    partial_json   JSON text that may stop anywhere, against a value (the parser's repeats)

How an API writes a call out (OpenAI's `tool_calls`, a Responses `function_call` item,
an Anthropic `tool_use` block) is the server's: `ToolCallDelta` holds only what the
reply says.
"""

from qinfer.request.tool_calls.formats import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    QWEN3_XML,
    ToolCallFormat,
    tool_call_format,
)
from qinfer.request.tool_calls.grammar import check_tool_schemas, tool_call_grammar
from qinfer.request.tool_calls.parser import ParsedDelta, ToolCallDelta, ToolCallParser
from qinfer.request.tool_calls.prompt import tool_prompt
from qinfer.request.tool_calls.use import ToolUse
from qinfer.request.tool_calls.xml_calls import XmlCallParser, parse_xml_call

__all__ = [
    "GENERIC",
    "HERMES",
    "LLAMA3_JSON",
    "QWEN3_XML",
    "ParsedDelta",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallParser",
    "ToolUse",
    "XmlCallParser",
    "check_tool_schemas",
    "parse_xml_call",
    "tool_call_format",
    "tool_call_grammar",
    "tool_prompt",
]
