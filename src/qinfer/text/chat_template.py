"""Chat templates: render a checkpoint's Jinja template exactly as `transformers` does.

A chat template is untrusted code shipped with a checkpoint. `transformers` renders it in a
sandboxed Jinja environment with a handful of extras; a template written against that
environment must see the same one here, or the prompt (and so the model's answer) changes.
What `transformers.utils.chat_template_utils` sets up, and this module mirrors:

- `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
  `loopcontrols` extension (`{% break %}`, `{% continue %}`);
- a `tojson` filter that is plain `json.dumps` (no HTML escaping, `ensure_ascii=False`);
- globals `raise_exception(message)`, `strftime_now(format)`, a `dict` constructor and a
  `namespace` that refuses underscore-prefixed names;
- the context: `messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's
  named special tokens (`bos_token`, `eos_token`, ...), then any extra keyword (Qwen3's
  `enable_thinking`), which wins over a special token of the same name;
- messages with `None` values dropped (OpenAI clients send `content: null` next to
  `tool_calls`), and a message's reasoning copied under `reasoning_content` and `thinking`
  whichever of `reasoning_content`, `thinking`, `reasoning` it came under.

The `{% generation %}` tag (assistant-token masks for training) is accepted and renders
its body unchanged.
"""

from __future__ import annotations

import functools
import json
import traceback
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qinfer.core.errors import TokenizerError

# Names a message's reasoning comes under; templates read the first (gpt-oss reads "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks.

    Rendering a prompt needs no mask, so the tag renders its body as it is.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore names that could reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed names on a namespace ({name!r})"
            )


class _TemplateDict:
    """`dict(...)` inside templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson escapes <, >, & and ' for HTML; prompts need the plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template once (templates are large; every request renders one)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise TokenizerError(
            f"chat template does not parse: line {error.lineno}: {error.message}"
        ) from None


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` through the template `source`; the text equals `transformers`'.

    messages: OpenAI-style dicts with a `role` and usually `content` (a string or a list
    of content parts), optionally `tool_calls`, `reasoning_content`, `name`, ...
    tools / documents: JSON-schema tool definitions and retrieval documents (dicts).
    special_tokens: the tokenizer's named special tokens (`bos_token` -> "<s>", ...).
    kwargs: extra template variables, such as Qwen3's `enable_thinking=False`; they take
    precedence over a special token of the same name.
    """
    template = compile_chat_template(source)
    chat = [_prepare_message(i, message) for i, message in enumerate(messages)]
    if not chat:
        raise TokenizerError("cannot apply a chat template to an empty list of messages")
    tools, documents = _plain(tools), _plain(documents)
    for name, values in (("tools", tools), ("documents", documents)):
        for i, value in enumerate(values or ()):
            if not isinstance(value, dict):
                raise TokenizerError(f"{name}[{i}] must be a dict, got {type(value).__name__}")
    context = {**(special_tokens or {}), **kwargs}
    tracker = _ReadTracker()
    tracked = [_TrackedMessage(message, i, tracker) for i, message in enumerate(chat)]
    try:
        return template.render(
            messages=tracked,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **_plain(context),
        )
    except Exception as error:  # the template is third-party code: report, don't crash
        raise TokenizerError(_describe_render_error(error, tracker)) from error


class _ReadTracker:
    """Which message the template read last: the best answer Jinja can give to "which
    message is at fault" when a template fails (`raise_exception("roles must alternate")`)."""

    def __init__(self) -> None:
        self.index: int | None = None
        self.role: str | None = None


class _TrackedMessage(dict):
    """One message; reading any of its fields tells the tracker the template is at it.

    A dict in every other way, so templates render it exactly as a plain one.
    """

    def __init__(self, fields: dict[str, Any], index: int, tracker: _ReadTracker) -> None:
        super().__init__(fields)
        self._index, self._tracker = index, tracker

    def _mark(self) -> None:
        self._tracker.index, self._tracker.role = self._index, dict.get(self, "role")

    def __getitem__(self, key: Any) -> Any:
        self._mark()
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self._mark()
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._mark()
        return super().get(key, default)


def _prepare_message(index: int, message: Any) -> dict[str, Any]:
    """A plain copy of one message, as `transformers` hands it to the template."""
    fields = _plain(message)  # a dict, also from a pydantic model (the server's requests)
    if not isinstance(fields, dict):
        raise TokenizerError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    if not isinstance(fields.get("role"), str):
        raise TokenizerError(f"messages[{index}] has no 'role' string")
    # Keys set to None are dropped: templates test for a key's presence (`'content' in m`).
    plain = {key: value for key, value in fields.items() if value is not None}
    reasoning = next((plain[k] for k in REASONING_FIELDS if plain.get(k) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _plain(value: Any) -> Any:
    """Rebuild `value` out of plain JSON types (str subclasses, tuples of dicts, ...).

    The sandbox only knows the built-in types are safe; enums, numpy scalars or pydantic
    models (from the server's request parsing) are converted before the template sees them.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if hasattr(value, "item"):  # numpy and torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _describe_render_error(error: Exception, tracker: _ReadTracker) -> str:
    """One line: which message and which template line rendering failed on, and why."""
    lines = [
        frame.lineno
        for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename == "<template>"
    ]
    where = f" at line {lines[-1]} of the template" if lines else ""
    if tracker.index is not None:
        where += f" (reading messages[{tracker.index}], role {tracker.role!r})"
    if isinstance(error, jinja2.TemplateError) and type(error) is jinja2.TemplateError:
        # raise_exception(...) from the template itself: its message says what is wrong.
        return f"chat template rejected the messages{where}: {error.message}"
    return f"chat template failed to render{where}: {type(error).__name__}: {error}"
