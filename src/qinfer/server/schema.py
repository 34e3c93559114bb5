"""What every API's request bodies share: the strict pydantic base model, the logging of
unknown fields, the bounds on tools and constraints, and shared field types; and the base
model of every API's answers (`Answer`).

Validation is strict: a field of the wrong type (`"temperature": "hot"`) or a value out
of range (`"top_p": 7`) is refused with a 400 naming the field, rather than coerced. The
ranges are OpenAI's where it states one.

A field qinfer does not know is ignored and logged once per name (as vLLM does): clients
send fields of newer API versions by default, and a 400 would break them. A field qinfer
knows but cannot honour (`audio`, `prediction`, ...) is a 400 naming it (`Unsupported`),
never silently dropped.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

log = logging.getLogger("qinfer.server")

#: Template variables the server itself passes (the messages, the tokenizer's own tokens).
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "special_tokens", "source", "tools"})
#: Largest output constraint (schema, regex, grammar, choices) compiled, as JSON bytes:
#: llguidance needs seconds for schemas near a megabyte, and fails past its symbol limit.
MAX_CONSTRAINT_BYTES = 256 * 2**10
#: Most tools one request may offer.
MAX_TOOLS = 128
#: Largest `top_k` accepted. A k past the vocabulary keeps every token already; the bound
#: is torch's int64, which the sampler's tensor of every row's k holds (a larger k would
#: fail the engine step, and with it every request batched in that step).
MAX_TOP_K = 2**63 - 1


#: Unknown fields already logged, as "Model.field"; a client sending ever new names stops
#: being logged after this many, so that it cannot grow the set without bound.
MAX_LOGGED_UNKNOWN_FIELDS = 1000
_logged_unknown_fields: set[str] = set()


def log_unknown_fields(model: type[BaseModel], data: Any) -> None:
    """Log (once per name, at WARNING) the fields of `data` that `model` does not know."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields.values()
    known = set(model.model_fields) | {f.alias for f in fields if f.alias}
    for name in data.keys() - known:
        key = f"{model.__name__}.{name}"
        if (
            key in _logged_unknown_fields
            or len(_logged_unknown_fields) >= MAX_LOGGED_UNKNOWN_FIELDS
        ):
            continue
        _logged_unknown_fields.add(key)
        shown = name if len(name) <= 80 else f"{name[:80]}..."  # a hostile name stays short
        log.warning("ignoring the unknown field %r of %s (logged once)", shown, model.__name__)


def check_tools(names: list[str], parameters: list[Any], what: str = "parameters") -> None:
    """A request's tools, by name and parameters schema, as every API checks them: a call
    names its tool, so two tools of one name would make it ambiguous (ValueError); their
    schemas are compiled (`tool_calls.check_tool_schemas`), together when a call is forced,
    so they are bounded as one constraint. what: the API's name for the schemas."""
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"two tools are named {twice!r}; tool names must be distinct")
    size = sum(len(json.dumps(schema).encode()) for schema in parameters)
    if size > MAX_CONSTRAINT_BYTES:
        raise ValueError(
            f"the tools' {what} are {size} bytes; schemas of at most "
            f"{MAX_CONSTRAINT_BYTES} bytes in all are compiled"
        )


def json_object(text: str) -> dict[str, Any]:
    """A tool call's arguments written as JSON text, decoded; a ValueError (which pydantic
    reports naming the field) when they are not JSON, or not an object."""
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg})") from None
    if not isinstance(decoded, dict):
        raise ValueError("must be a JSON object")
    return decoded


class StrictModel(BaseModel):
    """No coercion between JSON types; unknown fields ignored and logged once per name."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        log_unknown_fields(cls, data)
        return data


class Answer(BaseModel):
    """A part of an answer the server sends: exactly these keys (`additionalProperties:
    false` in the document), so that an answer with a key its model lacks fails its
    route's validation (`openapi.documented`) rather than differ from the document."""

    model_config = ConfigDict(extra="forbid")


def Unsupported(reason: str) -> Any:  # noqa: N802 (reads as a type in a field declaration)
    """The type of a field qinfer knows but cannot honour: null (or absent) is accepted,
    any other value is a 400 naming the field, saying `reason`."""

    def refuse(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"not supported by qinfer ({reason})")
        return value

    return Annotated[Any, AfterValidator(refuse)]


def _no_reserved_template_names(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_NAMES)
    if taken:
        raise ValueError(f"{taken[0]!r} is set by the server, not by chat_template_kwargs")
    return kwargs


#: `chat_template_kwargs`: variables for the chat template, not those the server sets.
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_no_reserved_template_names)]
