"""Qwen3.5's XML tool calls (vLLM's `qwen3_coder` parser), read whole and streamed.

The model writes each call as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text, read as its schema's type (`parameter_value`): a string as
written, a number, a boolean, null, an object or array as JSON; text that does not read as
its type stays a string, as vLLM keeps it. The newline after `<parameter=P>` and the one
before `</parameter>` belong to the syntax, not the value.

`XmlCallParser` splits a reply into content and calls, their arguments as JSON text (as
OpenAI's are). A call that a grammar forces goes out as it is written: its id and name
once `<function=NAME>` is read, then its arguments a parameter at a time (`{"city":
"Paris"`, `, "days": 3`, `}`); one that names an earlier call's tool is held until its
block closes (it may repeat that call: `parser` explains the repeats). An unforced call
goes out whole when its block closes, once it is known to be a call. A block that is not a
call of an offered tool with its own parameters (an unknown tool, an unknown parameter, no
`<function=...>`) is content, as written. A block the reply's end cuts after its
`<function=NAME>` goes out as a call with the parameters read whole so far and is marked
cut (`ParsedDelta.cut_call`: the stream has it, finish_reason "length" says it is cut, a
whole answer leaves it out); cut before, it is content (dropped in a forced reply, as
`parser.ToolCallParser` drops a cut call's start).

Qwen3.5 sometimes writes its call inside `<think>`: the reasoning gets its own parser
(`ToolUse.reasoning_parser`) that shares the calls' numbering and memory (`CallLog`), so
such a call is returned as a call, not lost in `reasoning_content`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qinfer.request.tool_calls.formats import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from qinfer.request.tool_calls.parser import ParsedDelta, ToolCallDelta
from qinfer.request.tool_calls.partial_json import same_json
from qinfer.text.detokenizer import partial_match_length

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"

_FUNCTION_HEAD = re.compile(r"\s*<function=([^>\n]+)>\n")
_NEXT_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


@dataclass
class CallLog:
    """The calls of one reply, shared by its content's parser and its reasoning's: the
    number opened (each call's index) and (name, arguments) of each one made."""

    opened: int = 0
    made: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def open(self, name: str, arguments: dict[str, Any] | None) -> ToolCallDelta:
        """A new call's delta: its index, id, name and arguments as JSON text (None: none
        yet, they stream)."""
        self.opened += 1
        return ToolCallDelta(
            self.opened - 1,
            id=f"call_{uuid.uuid4().hex[:24]}",
            name=name,
            arguments="" if arguments is None else json.dumps(arguments, ensure_ascii=False),
        )

    def repeats(self, name: str, arguments: dict[str, Any]) -> bool:
        return any(made == name and same_json(args, arguments) for made, args in self.made)


def parameter_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text read as its schema's type (see the module docstring)."""
    types = (schema or {}).get("type", "string")
    types = [types] if isinstance(types, str) else list(types)
    if "string" in types or not types:
        return text
    stripped = text.strip()
    if stripped == "null" and "null" in types:
        return None
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        return text
    if isinstance(value, bool):
        return value if "boolean" in types else text
    if isinstance(value, int | float) and ("number" in types or "integer" in types):
        if "integer" in types and isinstance(value, float) and value.is_integer():
            return int(value)
        return value
    if (isinstance(value, dict) and "object" in types) or (
        isinstance(value, list) and "array" in types
    ):
        return value
    return text


def parse_xml_call(
    block: str, tools: Mapping[str, Mapping[str, Any]]
) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one whole block (the text between `<tool_call>` and
    `</tool_call>`), or None when it is not a call of one of `tools` ({name: parameters
    schema}) naming only its parameters."""
    found = _FUNCTION.match(block)
    if found is None or found.group(1).strip() not in tools:
        return None
    name = found.group(1).strip()
    arguments = _parameters(found.group(2), tools[name], whole=True)
    return None if arguments is None else (name, arguments)


def _parameters(body: str, schema: Mapping[str, Any], whole: bool) -> dict[str, Any] | None:
    """The parameters of a function's body, or None when it holds anything else (an
    unknown parameter, stray text); whole=False: the body may stop anywhere (a cut call),
    its last unclosed parameter is left out."""
    properties = schema.get("properties") or {}
    arguments, at = {}, 0
    for found in _PARAMETER.finditer(body):
        if found.start() != at or found.group(1).strip() not in properties:
            return None
        key = found.group(1).strip()
        arguments[key] = parameter_value(found.group(2), properties[key])
        at = found.end()
    rest = body[at:]
    if whole and rest.strip():
        return None
    if not whole and rest and not PARAMETER_OPEN.startswith(rest[: len(PARAMETER_OPEN)]):
        return None
    return arguments


# Where the parser is: in plain text, inside a block, past a repeated call (reply over).
_TEXT, _BLOCK, _OVER = "text", "block", "over"


@dataclass
class _Streaming:
    """A forced call going out as it is written: its index and name, where its next
    parameter starts in the block, and its arguments so far."""

    index: int
    name: str
    at: int
    arguments: dict[str, Any] = field(default_factory=dict)


class XmlCallParser:
    """Splits a streamed reply into content and XML calls (see the module docstring); the
    same interface as `parser.ToolCallParser`.

    tools: {name: parameters schema} of the offered tools. forced: a grammar forces the
    calls (a cut call's start is dropped rather than returned as content). log: the
    reply's calls, shared with its reasoning's parser (a new one when None).
    """

    def __init__(
        self,
        tools: Mapping[str, Mapping[str, Any]],
        forced: bool,
        log: CallLog | None = None,
    ) -> None:
        self.tools, self.forced = tools, forced
        self.log = CallLog() if log is None else log
        self.repeated = False  # the reply wrote one of its calls again: it is over
        self._state, self._held, self._block = _TEXT, "", ""
        self._after_call = False  # a call was made and no text has come since
        self._streaming: _Streaming | None = None  # the forced call going out

    @property
    def num_calls(self) -> int:
        return self.log.opened

    @property
    def made_calls(self) -> bool:
        """Whether the reply made a call (a whole one: not one the reply's end cut)."""
        return bool(self.log.made)

    def push(self, text: str) -> ParsedDelta:
        """The content and calls that the reply's next `text` completes."""
        self._held += text
        out = ParsedDelta()
        while True:  # one delta may hold several blocks
            state, held = self._state, self._held
            if state == _TEXT:
                self._in_text(out)
            elif state == _BLOCK:
                self._in_block(out)
            else:
                self._held = ""
            if self._state == state and self._held == held:
                return out

    def finish(self) -> ParsedDelta:
        """The end of the reply: held text goes out; a cut block is a cut call (from its
        `<function=NAME>` on) or content (dropped in a forced reply)."""
        out = self.push("")
        if self._streaming is not None:  # made if its function closed, else cut
            if FUNCTION_CLOSE in self._block[self._streaming.at :]:
                self._close_streaming(out)
            else:
                out.cut_call, self._streaming = self._streaming.index, None
        elif self._state == _BLOCK:
            self._cut_block(self._block + self._held, out)
        elif self._state == _TEXT:
            out.content += self._held
        self._held, self._block, self._state = "", "", _TEXT
        return out

    def _in_text(self, out: ParsedDelta) -> None:
        if self._after_call:  # the newlines between and after calls are no content
            self._held = self._held.lstrip()
            self._after_call = not self._held
        start = self._held.find(TOOL_CALL_OPEN)
        if start >= 0:
            out.content += self._held[:start]
            self._held, self._block = self._held[start + len(TOOL_CALL_OPEN) :], ""
            self._state = _BLOCK
            return
        keep = partial_match_length(self._held, [TOOL_CALL_OPEN])
        out.content += self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]

    def _in_block(self, out: ParsedDelta) -> None:
        self._block, self._held = self._block + self._held, ""
        end = self._block.find(TOOL_CALL_CLOSE)
        if self.forced and self._streaming is None:
            self._start_streaming(out)
        if self._streaming is not None:
            self._stream_parameters(self._block if end < 0 else self._block[:end], out)
        if end < 0:
            return
        block, self._held = self._block[:end], self._block[end + len(TOOL_CALL_CLOSE) :]
        self._state, self._block = _TEXT, ""
        if self._streaming is not None:
            self._close_streaming(out)
        else:
            self._whole_block(block, out, closed=True)

    def _start_streaming(self, out: ParsedDelta) -> None:
        """A forced call whose `<function=NAME>` is read goes out, unless an earlier call
        named that tool (then it waits for its block's end: it may be a repeat)."""
        head = _FUNCTION_HEAD.match(self._block)
        name = None if head is None else head.group(1).strip()
        if name not in self.tools or any(made == name for made, _ in self.log.made):
            return
        call = self.log.open(name, None)
        out.tool_calls.append(call)
        self._streaming = _Streaming(call.index, name, head.end())

    def _stream_parameters(self, block: str, out: ParsedDelta) -> None:
        """The streaming call's parameters whole in `block` and not yet out, as JSON."""
        call = self._streaming
        properties = self.tools[call.name].get("properties") or {}
        while (found := _NEXT_PARAMETER.match(block, call.at)) is not None:
            key = found.group(1).strip()
            if key not in properties:  # not the grammar's: nothing more goes out
                return
            value = parameter_value(found.group(2), properties[key])
            text = (
                json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            )
            out.tool_calls.append(
                ToolCallDelta(call.index, arguments=(", " if call.arguments else "{") + text)
            )
            call.arguments[key], call.at = value, found.end()

    def _close_streaming(self, out: ParsedDelta) -> None:
        call, self._streaming = self._streaming, None
        out.tool_calls.append(ToolCallDelta(call.index, arguments="}" if call.arguments else "{}"))
        self.log.made.append((call.name, call.arguments))
        self._after_call = True

    def _whole_block(self, block: str, out: ParsedDelta, closed: bool = False) -> None:
        """A whole block: a call (a repeat ends the reply), else content as written."""
        call = parse_xml_call(block, self.tools)
        if call is None:
            out.content += TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
        elif self.log.repeats(*call):
            self.repeated, self._held, self._state = True, "", _OVER
        else:
            out.tool_calls.append(self.log.open(*call))
            self.log.made.append(call)
            self._after_call = True

    def _cut_block(self, block: str, out: ParsedDelta) -> None:
        if FUNCTION_CLOSE in block:  # only `</tool_call>` is missing: a whole call
            self._whole_block(block, out)
            return
        found = _FUNCTION.match(block)
        name = None if found is None else found.group(1).strip()
        arguments = None
        if name in self.tools:
            arguments = _parameters(found.group(2), self.tools[name], whole=False)
        if arguments is not None:
            out.tool_calls.append(self.log.open(name, arguments))
            out.cut_call = self.log.opened - 1
        elif not self.forced:
            out.content += TOOL_CALL_OPEN + block
