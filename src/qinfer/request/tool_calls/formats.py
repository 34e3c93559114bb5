"""Each model family's tool-call format, and which one a tokenizer's chat template uses.

A chat request may offer tools (OpenAI's `{"type": "function", "function": {"name",
"description", "parameters"}}`). How a model sees them and writes its calls depends on
what it was trained on; `tool_call_format` reads that off the chat template:

    hermes        Qwen3, Qwen2.5 (the template writes `<tool_call>`): the template renders
                  the tools itself; the model answers with one or more blocks
                      <tool_call>
                      {"name": "get_weather", "arguments": {"city": "Paris"}}
                      </tool_call>
                  separated by newlines, possibly after some text.
    qwen3_xml     Qwen3.5/3.6, Qwen3-Coder (the template writes `<function=` and
                  `<parameter=`): the template renders the tools and earlier calls; the
                  model answers with blocks (`xml_calls`)
                      <tool_call>
                      <function=get_weather>
                      <parameter=city>
                      Paris
                      </parameter>
                      </function>
                      </tool_call>
                  separated by newlines, possibly after some text (or inside `<think>`).
    llama3_json   Llama 3.x (the template asks for `{"name", "parameters"}`): the template
                  renders the tools; the whole reply is one JSON object
                      {"name": "get_weather", "parameters": {"city": "Paris"}}
                  optionally after `<|python_tag|>`. One call per turn (Llama 3's
                  template refuses several).
    generic       every other template (the embedded SmolLM2's has no tool support): the
                  tools are described in a system message (`prompt.GENERIC_TOOLS_PROMPT`)
                  that asks for the hermes blocks above, and replies are parsed the same
                  way; earlier calls and tool results are written into the history as those
                  blocks and `<tool_response>` user turns, which any template renders.
"""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.text.tokenizer import Tokenizer

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes tool calls (see the module docstring).

    name: "hermes", "qwen3_xml", "llama3_json" or "generic". xml: the calls are XML
    (`xml_calls`), else JSON. tagged: calls sit between
    `<tool_call>` and `</tool_call>` (else the reply is one bare JSON object).
    arguments_key: the JSON key of the arguments. in_template: the chat template renders
    the tools (`tools=`); else they go in a system message. parallel: several calls a turn.
    """

    name: str
    tagged: bool
    arguments_key: str
    in_template: bool
    parallel: bool
    xml: bool = False


HERMES = ToolCallFormat("hermes", True, "arguments", in_template=True, parallel=True)
QWEN3_XML = ToolCallFormat(
    "qwen3_xml", True, "arguments", in_template=True, parallel=True, xml=True
)
LLAMA3_JSON = ToolCallFormat("llama3_json", False, "parameters", in_template=True, parallel=False)
GENERIC = ToolCallFormat("generic", True, "arguments", in_template=False, parallel=True)


def tool_call_format(tokenizer: Tokenizer) -> ToolCallFormat:
    """The format of the tokenizer's chat template (see the module docstring)."""
    template = tokenizer.chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_XML
    if TOOL_CALL_OPEN in template:
        return HERMES
    if '"parameters"' in template and "<|start_header_id|>" in template:
        return LLAMA3_JSON
    return GENERIC
