"""Tool calls in each model family's own format: the prompt, the grammar, the parser.

A chat request may offer tools (OpenAI's `{"type": "function", "function": {"name",
"description", "parameters"}}`). How a model sees them and writes its calls depends on
what it was trained on; `tool_call_format` reads that off the chat template:

    hermes        Qwen3, Qwen2.5 (the template writes `<tool_call>`): the template renders
                  the tools itself; the model answers with one or more blocks
                      <tool_call>
                      {"name": "get_weather", "arguments": {"city": "Paris"}}
                      </tool_call>
                  separated by newlines, possibly after some text.
    llama3_json   Llama 3.x (the template asks for `{"name", "parameters"}`): the template
                  renders the tools; the whole reply is one JSON object
                      {"name": "get_weather", "parameters": {"city": "Paris"}}
                  optionally after `<|python_tag|>`. One call per turn (Llama 3's
                  template refuses several).
    generic       every other template (the embedded SmolLM2's has no tool support): the
                  tools are described in a system message (`GENERIC_TOOLS_PROMPT`) that
                  asks for the hermes blocks above, and replies are parsed the same way;
                  earlier calls and tool results are written into the history as those
                  blocks and `<tool_response>` user turns, which any template renders.

`tool_call_grammar` builds the llguidance Lark grammar that forces a call in the model's
own wrapping (`tool_choice` "required", or a named tool): JSON valid under the tool's
`parameters`, tags that are single tokens in the vocabulary (Qwen's `<tool_call>`) named
by id, whitespace bounded as in every JSON constraint. The parameters are read in strict
mode, as `response_format` schemas are: an object schema that lists `properties` without
`additionalProperties` (what LangChain, pydantic-ai and instructor send for a pydantic
model, nested models and `$defs` included) allows no other key, so a small model cannot
invent keys until max_tokens; `"additionalProperties": true`, or the tool's `strict:
false`, leaves objects open. `ToolCallParser` turns the
streamed reply into content and call deltas: text goes out as content except a tail that
may be the start of a tag. A call whose syntax a grammar forces goes out as soon as its
header `{"name": "...", "arguments": ` is read (its id and name once), then its arguments
as they arrive; one whose arguments the reply's end (max_tokens, a stop string) cuts is
marked (`ParsedDelta.cut_call`), and a whole answer leaves it out (a stream has sent its
fragments already; its finish_reason "length" says the last call is cut); the start of
a call cut before its arguments is dropped (a forced reply holds nothing else). An
unforced call (`tool_choice` "auto") goes out when its block ends and parses whole as a
call of an offered tool; any other block (malformed JSON, an unknown tool) is returned
as content, as written.

A call identical to one the reply made already (same name, same arguments as parsed
JSON) ends the reply: a small model under a grammar that allows several calls tends to
write its call again and again until max_tokens. The repeat is never handed out: a
forced call that names an earlier call's tool is held back (its id, name and arguments
so far) while its arguments may still turn out to be that call's, and goes out as soon
as they differ; once a repeat's arguments are complete, `ToolCallParser.repeated` tells
the caller to stop generating, and the reply is over (it ends as one that made calls).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qinfer.core.errors import RequestError
from qinfer.request.grammar import (
    JSON_WHITESPACE,
    json_schema_problem,
    lenient_schema,
    strict_schema,
)
from qinfer.text.detokenizer import partial_match_length
from qinfer.text.tokenizer import Tokenizer

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

#: The system message that describes tools to a template without tool support.
GENERIC_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes tool calls (see the module docstring).

    name: "hermes", "llama3_json" or "generic". tagged: calls sit between
    `<tool_call>` and `</tool_call>` (else the reply is one bare JSON object).
    arguments_key: the JSON key of the arguments. in_template: the chat template renders
    the tools (`tools=`); else they go in a system message. parallel: several calls a turn.
    """

    name: str
    tagged: bool
    arguments_key: str
    in_template: bool
    parallel: bool


HERMES = ToolCallFormat("hermes", True, "arguments", in_template=True, parallel=True)
LLAMA3_JSON = ToolCallFormat("llama3_json", False, "parameters", in_template=True, parallel=False)
GENERIC = ToolCallFormat("generic", True, "arguments", in_template=False, parallel=True)


def tool_call_format(tokenizer: Tokenizer) -> ToolCallFormat:
    """The format of the tokenizer's chat template (see the module docstring)."""
    template = tokenizer.chat_template or ""
    if TOOL_CALL_OPEN in template:
        return HERMES
    if '"parameters"' in template and "<|start_header_id|>" in template:
        return LLAMA3_JSON
    return GENERIC


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


def check_tool_schemas(
    tools: Sequence[Mapping[str, Any]], field: str = "tools.{}.function.parameters"
) -> None:
    """Refuse, with a RequestError naming `field` of the tool (`tools.i.function.parameters`
    in chat requests), the first tool whose parameters llguidance cannot compile; checked
    whatever `tool_choice` says (a forced call's grammar holds them all, and its error
    would name neither tool nor field)."""
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        problem = None if parameters is None else json_schema_problem(parameters)
        if problem is not None:
            param = field.format(i)
            raise RequestError(
                f"Invalid value for '{param}': not a JSON schema qinfer can follow ({problem})",
                param=param,
            )


def tool_call_grammar(
    fmt: ToolCallFormat,
    tools: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    parallel: bool = True,
) -> str:
    """An llguidance Lark grammar: one call (or, with `parallel` in a format that allows
    it, one or more) of one of `tools`, in the model's own wrapping.

    tools: OpenAI function tools; a tool's `parameters` schema (any object when absent)
    constrains its arguments, closed as in strict mode unless the tool says `strict: false`
    (see the module docstring).
    """
    if len(tools) == 1:
        call_json = _call_schema(fmt, tools[0]["function"], "")
    else:
        schemas = [_call_schema(fmt, t["function"], f"/anyOf/{i}") for i, t in enumerate(tools)]
        call_json = {"anyOf": schemas}
    call_json = {**call_json, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    lines = ["%llguidance {}", f"call_json: %json {json.dumps(call_json)}"]
    if not fmt.tagged:
        lines.append("start: call_json")
        return "\n".join(lines) + "\n"
    open_tag, close_tag = _tag(tokenizer, TOOL_CALL_OPEN), _tag(tokenizer, TOOL_CALL_CLOSE)
    lines.append(f'call: {open_tag} "\\n" call_json "\\n" {close_tag}')
    lines.append('start: call ("\\n" call)*' if parallel and fmt.parallel else "start: call")
    return "\n".join(lines) + "\n"


def _call_schema(fmt: ToolCallFormat, function: Mapping[str, Any], at: str) -> dict[str, Any]:
    """The JSON schema of one call of `function`: its name, then its arguments.

    at: the JSON pointer of this schema in the grammar's whole call schema ("" at its
    root), so that the parameters' local `$ref`s (`#/$defs/City`, as pydantic writes
    nested models) still point into the parameters once nested in the call.
    """
    parameters = function.get("parameters") or {"type": "object"}
    closed = function.get("strict") is not False
    parameters = strict_schema(parameters) if closed else lenient_schema(parameters)
    parameters = _rebased_refs(parameters, f"{at}/properties/{fmt.arguments_key}")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, fmt.arguments_key: parameters},
        "required": ["name", fmt.arguments_key],
        "additionalProperties": False,
    }


def _rebased_refs(schema: Any, prefix: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#/...", "#") start at `prefix`."""
    if isinstance(schema, list):
        return [_rebased_refs(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebased_refs(value, prefix) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = f"#{prefix}{ref[1:]}"
    return out


def _tag(tokenizer: Tokenizer, tag: str) -> str:
    """A tag in Lark: by id when it is one token (llguidance treats added tokens as
    special: only the id matches them), else as text."""
    token_id = tokenizer.token_to_id(tag)
    return json.dumps(tag) if token_id is None else f"<[{token_id}]>"


@dataclass(frozen=True)
class ToolUse:
    """The tools one request offers, in the model's format, and whether a call is forced.

    forced: "required" (some tool), a tool's name (that tool), or None (`auto`).
    """

    fmt: ToolCallFormat
    tool_names: tuple[str, ...]
    forced: str | None = None

    def parser(self) -> ToolCallParser:
        """A parser for one reply (one per choice)."""
        return ToolCallParser(self.fmt, self.tool_names, forced=self.forced is not None)

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        """OpenAI's finish reason: "tool_calls" when a reply that stopped made calls, but
        "stop" when a named tool was forced (as OpenAI answers)."""
        if reason != "stop" or not made_calls or self.forced not in (None, "required"):
            return reason
        return "tool_calls"


# --- parsing replies -----------------------------------------------------------------


@dataclass
class ToolCallDelta:
    """What one stretch of a reply adds to the call at `index` (OpenAI's stream shape):
    its id and name the first time, then fragments of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self, whole: bool) -> dict[str, Any]:
        """The `tool_calls` entry of a message (whole) or of a stream delta."""
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        entry: dict[str, Any] = {} if whole else {"index": self.index}
        if self.id is not None:
            entry |= {"id": self.id, "type": "function"}
        return {**entry, "function": function}


@dataclass
class ParsedDelta:
    """The content and tool-call deltas of one stretch of a reply; cut_call: the index of
    a call whose arguments the reply's end cut (max_tokens), set by `finish`."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    cut_call: int | None = None


# Where the parser is: in plain text, in a call whose header is not yet read, in its
# arguments, after them (until the block closes), past a repeated call (the reply is over).
_TEXT, _BLOCK, _ARGUMENTS, _AFTER, _OVER = "text", "block", "arguments", "after", "over"


class ToolCallParser:
    """Splits a streamed reply into content and tool-call deltas (module docstring).

    tool_names: the tools offered; a call naming another is content. forced: a grammar
    forces the calls' syntax, so they stream from their header on (else each call waits
    for its block's end, to be checked whole).
    `push(text)` and `finish()` return a ParsedDelta; `push` may hold text back. Once
    `repeated` is true (the reply wrote one of its calls again), the rest is ignored.
    """

    def __init__(self, fmt: ToolCallFormat, tool_names: Sequence[str], forced: bool) -> None:
        self.fmt, self.tool_names, self.forced = fmt, frozenset(tool_names), forced
        self.num_calls = 0  # calls opened (each call's index), a cut one included
        self.repeated = False  # the reply wrote one of its calls again: it is over
        self._made: list[tuple[str, Any]] = []  # (name, arguments; None: unparsable) per call
        self._name, self._arguments = "", ""  # the open call's name and arguments so far
        self._holding: ToolCallDelta | None = None  # the open call, held: it may be a repeat
        self._state = _TEXT
        self._after_call = False  # a call was made and no text has come since
        self._held = ""  # text not yet handed out
        self._block = ""  # the current block's text (after its opening tag)
        self._started = False  # the untagged format: the reply's first character was read
        self._header = re.compile(
            r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"'
            + re.escape(fmt.arguments_key)
            + r'"\s*:\s*(?=\S)'  # through the first character of the arguments
        )
        self._scan = _ValueScanner()
        self._steps = {
            _TEXT: self._in_text,
            _BLOCK: self._in_block,
            _ARGUMENTS: self._in_arguments,
            _AFTER: self._in_after,
            _OVER: self._in_over,
        }

    def push(self, text: str) -> ParsedDelta:
        """The content and call deltas that the reply's next `text` completes."""
        self._held += text
        out = ParsedDelta()
        while True:  # one delta may cross several states
            state, held = self._state, self._held
            self._steps[state](out)
            if self._state == state and self._held == held:
                return out

    @property
    def made_calls(self) -> bool:
        """Whether the reply made a call (a whole one: not one the reply's end cut)."""
        return bool(self._made)

    def finish(self) -> ParsedDelta:
        """The end of the reply: what was held, or a pending block, goes out; but in a
        forced reply, whose text can only be calls, what the end cut (a call's start, a
        call held back as a possible repeat) was never sent and is dropped."""
        out = self.push("")
        if self._state == _ARGUMENTS and self._holding is None:
            out.cut_call = self.num_calls - 1  # its fragments are out: not a call to run
        elif not self.forced and self._state == _BLOCK:
            self._close_block(self._block + self._held, out, closed=False)
        elif not self.forced and self._state == _TEXT:
            out.content += self._held
        self._held, self._state, self._holding = "", _TEXT, None
        return out

    # -- the states -------------------------------------------------------------------

    def _in_text(self, out: ParsedDelta) -> None:
        if self._after_call:  # the newlines between and after calls are no content
            self._held = self._held.lstrip()
            self._after_call = not self._held
        if not self.fmt.tagged:
            self._untagged_start(out)
            return
        start = self._held.find(TOOL_CALL_OPEN)
        if start >= 0:
            out.content += self._held[:start]
            self._held = self._held[start + len(TOOL_CALL_OPEN) :]
            self._block, self._state = "", _BLOCK
            return
        keep = partial_match_length(self._held, [TOOL_CALL_OPEN])
        out.content += self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]

    def _untagged_start(self, out: ParsedDelta) -> None:
        """A bare-JSON call is the whole reply: decide from its first characters."""
        if self._started:
            out.content, self._held = out.content + self._held, ""
            return
        head = self._held.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return  # not yet known
        self._started = True
        call = head.removeprefix(PYTHON_TAG).lstrip()
        if call.startswith("{") or not call:
            self._held, self._block, self._state = call, "", _BLOCK
        else:
            out.content, self._held = out.content + self._held, ""

    def _in_block(self, out: ParsedDelta) -> None:
        self._block, self._held = self._block + self._held, ""
        end = self._block.find(TOOL_CALL_CLOSE) if self.fmt.tagged else -1
        header = self._header.match(self._block) if self.forced else None
        if header and (end < 0 or header.end() <= end):
            name = json.loads(header.group(1))
            if name in self.tool_names:
                call = self._open_call(name)
                if self._may_repeat(name, ""):
                    self._holding = call
                else:
                    out.tool_calls.append(call)
                self._held, self._state = self._block[header.end() :], _ARGUMENTS
                self._name, self._arguments, self._scan = name, "", _ValueScanner()
                return
        if end >= 0:
            block = self._block[:end]
            self._held, self._state = self._block[end + len(TOOL_CALL_CLOSE) :], _TEXT
            self._close_block(block, out, closed=True)

    def _in_arguments(self, out: ParsedDelta) -> None:
        end = self._held.find(TOOL_CALL_CLOSE) if self.fmt.tagged else -1
        scanned = self._held if end < 0 else self._held[:end]
        length = self._scan.feed(scanned)
        if length:
            self._add_arguments(scanned[:length], out)
        self._held = self._held[length:]
        if self._scan.done:
            self._state = _AFTER
            self._call_made(out)
        elif end >= 0:  # the block closed inside the arguments: they stay as written
            self._held, self._state = self._held[end - length + len(TOOL_CALL_CLOSE) :], _TEXT
            self._call_made(out)

    def _in_after(self, out: ParsedDelta) -> None:
        """After the arguments: skip to the end of the block (`}` then the closing tag)."""
        if not self.fmt.tagged:
            brace = self._held.find("}")
            if brace >= 0:
                self._held, self._state = self._held[brace + 1 :], _TEXT
            return
        end = self._held.find(TOOL_CALL_CLOSE)
        if end >= 0:
            self._held, self._state = self._held[end + len(TOOL_CALL_CLOSE) :], _TEXT

    def _in_over(self, out: ParsedDelta) -> None:
        """Past a repeated call: the reply is over, whatever the model still writes."""
        self._held = ""

    # -- calls --------------------------------------------------------------------------

    def _open_call(self, name: str) -> ToolCallDelta:
        self.num_calls += 1
        self._after_call = True
        return ToolCallDelta(self.num_calls - 1, id=f"call_{uuid.uuid4().hex[:24]}", name=name)

    def _add_arguments(self, text: str, out: ParsedDelta) -> None:
        """More of the open call's arguments: out, or held with the call while it may
        still repeat an earlier one (all of it goes out once it cannot)."""
        self._arguments += text
        if self._holding is None:
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=text))
            return
        self._holding.arguments += text
        if not self._may_repeat(self._name, self._arguments):
            out.tool_calls.append(self._holding)
            self._holding = None

    def _call_made(self, out: ParsedDelta) -> None:
        """The open call's arguments ended: a repeat ends the reply, any other call is
        made (and goes out, if it was held)."""
        arguments = _json_or_none(self._arguments)
        if self._repeats(self._name, arguments):
            self._holding = None
            self._end_repeated()
            return
        if self._holding is not None:
            out.tool_calls.append(self._holding)
            self._holding = None
        self._made.append((self._name, arguments))

    def _repeats(self, name: str, arguments: Any) -> bool:
        """Whether a call of `name` with these (parsed) arguments is one made already."""
        return arguments is not None and any(
            made == name and _same_json(args, arguments) for made, args in self._made
        )

    def _may_repeat(self, name: str, arguments: str) -> bool:
        """Whether a call of `name` whose arguments start with this text may still turn
        out to be one made already."""
        return any(
            made == name and args is not None and _may_become(arguments, args)
            for made, args in self._made
        )

    def _end_repeated(self) -> None:
        self.repeated, self._held, self._state = True, "", _OVER

    def _close_block(self, block: str, out: ParsedDelta, closed: bool) -> None:
        """A block whose header did not parse: a call if it parses whole (a repeat ends
        the reply), else content."""
        call = _parse_call(block, self.fmt.arguments_key)
        if call is not None and call[0] in self.tool_names:
            if self._repeats(*call):
                self._end_repeated()
                return
            delta = self._open_call(call[0])
            delta.arguments = json.dumps(call[1], ensure_ascii=False)
            out.tool_calls.append(delta)
            self._made.append(call)
            return
        if self.fmt.tagged:
            block = TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
        out.content += block


def _parse_call(text: str, arguments_key: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one whole call's JSON, or None when it is not one. Arguments
    are an object, as OpenAI's are; some models write it as JSON text, decoded here."""
    value = _json_or_none(text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters")))
    if isinstance(arguments, str):
        arguments = _json_or_none(arguments)
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _same_json(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are the same: key order aside, but 1 is neither
    1.0 nor true (Python's == would say they are)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _may_become(text: str, value: Any) -> bool:
    """Whether JSON `text`, which may stop anywhere, can still turn out to be `value` (as
    `_same_json` compares); a float still being written counts as yes (`1` may become
    `1.5` or `15e-1`), since the caller then only waits longer. A key written twice
    counts as a difference."""
    try:
        _PartialJSON(text).value(value)
    except _Differs:
        return False
    except _TextEnded:
        pass
    return True


class _Differs(Exception):
    """The JSON read so far is not the expected value's."""


class _TextEnded(Exception):
    """The text stops inside the value: what follows may still make it the expected one."""


#: A string's text up to its closing quote (escapes whole), an escape still being
#: written, a number's or a literal's characters.
_STRING_BODY = re.compile(r'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*')
_PARTIAL_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?")
_SCALAR = re.compile(r"[-+.\w]*")
_LITERALS = ("true", "false", "null")


class _PartialJSON:
    """Reads JSON text that may stop anywhere against an expected value (`_may_become`):
    `value` returns when the value is whole and the expected one, or raises _Differs or
    _TextEnded."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def value(self, expected: Any) -> None:
        char = self._next()
        if char == "{":
            self._object(expected)
        elif char == "[":
            self._array(expected)
        elif char == '"':
            if not isinstance(expected, str):
                raise _Differs
            self._string_among([expected])
        else:
            self._scalar(expected)

    def _object(self, expected: Any) -> None:
        if not isinstance(expected, dict):
            raise _Differs
        missing = dict(expected)  # the keys not read yet
        char = self._next()
        while char != "}":
            if char != '"':
                raise _Differs
            key = self._string_among(missing)
            if self._next() != ":":
                raise _Differs
            self.value(missing.pop(key))
            char = self._next()
            if char == ",":
                char = self._next()
            elif char != "}":
                raise _Differs
        if missing:
            raise _Differs

    def _array(self, expected: Any) -> None:
        if not isinstance(expected, list):
            raise _Differs
        for i, item in enumerate(expected):
            self.value(item)
            if self._next() != ("]" if i == len(expected) - 1 else ","):
                raise _Differs
        if not expected and self._next() != "]":
            raise _Differs

    def _string_among(self, candidates: Iterable[str]) -> str:
        """A string (read from after its opening quote) that must be one of `candidates`:
        its text, or _TextEnded while it may still become one."""
        body = _STRING_BODY.match(self.text, self.at)
        self.at, rest = body.end(), self.text[body.end() :]
        try:
            text = json.loads(f'"{body.group()}"')
        except json.JSONDecodeError:  # an unknown escape, a raw control character
            raise _Differs from None
        if rest.startswith('"'):
            self.at += 1
            if text in candidates:
                return text
            raise _Differs
        if rest and not _PARTIAL_ESCAPE.fullmatch(rest):  # else: an escape being written
            raise _Differs
        if text[-1:] and "\ud800" <= text[-1] <= "\udbff":  # half of a surrogate pair
            text = text[:-1]
        if any(candidate.startswith(text) for candidate in candidates):
            raise _TextEnded
        raise _Differs

    def _scalar(self, expected: Any) -> None:
        word = _SCALAR.match(self.text, self.at - 1).group()
        self.at += len(word) - 1
        if self.at == len(self.text):  # the scalar may go on
            if _may_start(word, expected):
                raise _TextEnded
            raise _Differs
        try:
            value = json.loads(word)
        except json.JSONDecodeError:
            raise _Differs from None
        if not _same_json(value, expected):
            raise _Differs

    def _next(self) -> str:
        """The next character past whitespace (read); _TextEnded at the text's end."""
        while self.at < len(self.text) and self.text[self.at] in " \t\n\r":
            self.at += 1
        if self.at == len(self.text):
            raise _TextEnded
        self.at += 1
        return self.text[self.at - 1]


def _may_start(word: str, value: Any) -> bool:
    """Whether a scalar's first characters can still become `value`: an integer is
    written one way (`-0` aside), a float many (`1.5`, `15e-1`), a literal one way."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).startswith(word) or (value == 0 and "-0".startswith(word))
    if isinstance(value, float):
        return word[:1] in "-0123456789"
    return any(lit.startswith(word) and _same_json(json.loads(lit), value) for lit in _LITERALS)


class _ValueScanner:
    """Finds where one JSON value ends in streamed text: tracks strings and nesting,
    nothing more (the grammar, or the caller, checks the rest)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.started = self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all, until it ends)."""
        for i, char in enumerate(text):
            if self.done:
                return i
            if not self.started:
                if char.isspace():
                    continue
                self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                if self.depth == 0:  # a bare value ends at its object's brace
                    self.done = True
                    return i
                self.depth -= 1
                self.done = self.depth <= 0
            elif self.depth == 0 and char == ",":
                self.done = True
                return i
        return len(text)
