"""The grammar that forces a tool call, and the check of the tools' schemas.

`tool_call_grammar` builds the llguidance Lark grammar that forces a call in the model's
own wrapping (`tool_choice` "required", or a named tool): JSON valid under the tool's
`parameters`, tags that are single tokens in the vocabulary (Qwen's `<tool_call>`) named
by id, whitespace bounded as in every JSON constraint. The parameters are read in strict
mode, as `response_format` schemas are: an object schema that lists `properties` without
`additionalProperties` (what LangChain, pydantic-ai and instructor send for a pydantic
model, nested models and `$defs` included) allows no other key, so a small model cannot
invent keys until max_tokens; `"additionalProperties": true`, or the tool's `strict:
false`, leaves objects open.

Qwen3.5's XML calls (`xml_calls`) are forced parameter by parameter, in the schema's
order, the required ones always and the others optionally: a string's value is text
without `</` (so that `</parameter>` ends it), any other value JSON under its schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from qinfer.core.errors import RequestError
from qinfer.request.grammar import (
    JSON_WHITESPACE,
    json_schema_problem,
    lenient_schema,
    strict_schema,
)
from qinfer.request.tool_calls.formats import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCallFormat
from qinfer.text.tokenizer import Tokenizer


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
    if fmt.xml:
        return _xml_call_grammar(tools, tokenizer, parallel and fmt.parallel)
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


def _xml_call_grammar(
    tools: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, parallel: bool
) -> str:
    """The Lark grammar of one or more XML calls of `tools` (see the module docstring)."""
    open_tag, close_tag = _tag(tokenizer, TOOL_CALL_OPEN), _tag(tokenizer, TOOL_CALL_CLOSE)
    lines = [
        "%llguidance {}",
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: {open_tag} "\\n" function "</function>\\n" {close_tag}',
        # A string value: text in which `</` can only start the closing `</parameter>`.
        "TEXT_VALUE: /(?s:(?:[^<]|<[^\\/])*)\\n<\\/parameter>\\n/",
    ]
    functions = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = function.get("parameters") or {}
        closed = function.get("strict") is not False
        parameters = strict_schema(parameters) if closed else lenient_schema(parameters)
        required = set(parameters.get("required") or ())
        items = [json.dumps(f"<function={function['name']}>\n")]
        for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
            rule, opening = f"p{i}_{j}", json.dumps(f"<parameter={key}>\n")
            lines.append(f"{rule}: {opening} {_xml_value(rule, schema, parameters, lines)}")
            items.append(rule if key in required else f"{rule}?")
        lines.append(f"f{i}: {' '.join(items)}")
        functions.append(f"f{i}")
    lines.append(f"function: {' | '.join(functions)}")
    return "\n".join(lines) + "\n"


def _xml_value(rule: str, schema: Any, parameters: Mapping[str, Any], lines: list[str]) -> str:
    """The Lark items of one parameter's value and its closing, rules added to `lines`:
    one of a string enum's values, text for a string (or a schema that allows one), else
    JSON under the schema (its `$ref`s resolved against the parameters' `$defs`)."""
    closing = '"\\n</parameter>\\n"'
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or ())
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if enum and all(isinstance(value, str) for value in enum):
        return f"({' | '.join(json.dumps(value) for value in enum)}) {closing}"
    if "string" in types or not isinstance(schema, dict) or not (types or "$ref" in schema):
        return "TEXT_VALUE"
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    value = {**schema, **defs, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    lines.append(f"{rule}_json: %json {json.dumps(value)}")
    return f"{rule}_json {closing}"


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
