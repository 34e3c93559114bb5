"""The request bodies of the OpenAI API, as validated pydantic models.

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
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qinfer.request.grammar import lenient_schema
from qinfer.request.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS
from qinfer.server.images import ImageRef, image_part
from qinfer.text.prompts import Prompt

log = logging.getLogger("qinfer.server")

#: Most choices (`n`) one request may ask for: each one is a separate engine request.
MAX_CHOICES = 8

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
#: The request fields that constrain the output, and the SamplingParams field each sets.
CONSTRAINT_FIELDS = {
    "response_format": "json_schema",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


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


def Unsupported(reason: str) -> Any:  # noqa: N802 (reads as a type in a field declaration)
    """The type of a field qinfer knows but cannot honour: null (or absent) is accepted,
    any other value is a 400 naming the field, saying `reason`."""

    def refuse(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"not supported by qinfer ({reason})")
        return value

    return Annotated[Any, AfterValidator(refuse)]


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextPart(StrictModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the checkpoint sizes images


class ImageURLPart(StrictModel):
    """An image part: a data URL, or an http(s) URL (`qinfer.server.images`)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class CalledFunction(StrictModel):
    """The function of a call in an assistant message: its name and arguments, which
    OpenAI clients send as JSON text and templates read as an object (decoded here)."""

    name: str
    arguments: str | dict[str, Any]

    @field_validator("arguments")
    @classmethod
    def _decode_arguments(cls, arguments: str | dict[str, Any]) -> dict[str, Any]:
        return arguments if isinstance(arguments, dict) else json_object(arguments)


class AssistantToolCall(StrictModel):
    """One entry of an assistant message's `tool_calls` (a call the model made)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """One turn of a conversation.

    Fields beyond role, content and tool_calls (`name`, `tool_call_id`,
    `reasoning_content`, ...) are kept and handed to the chat template, which may read them.
    """

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None

    def for_template(self, index: int = 0) -> dict[str, Any]:
        """The message (`messages.{index}`) as a chat template reads it: text parts joined
        into one string, or, when it holds images, text parts and the engine's image parts
        (`images.image_part`); a call's arguments decoded; an assistant turn of only calls
        has content "" (OpenAI clients send null, which Qwen's template cannot read)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(isinstance(part, ImageURLPart) for part in self.content):
                message["content"] = [
                    image_part(
                        ImageRef(f"messages.{index}.content.{j}.image_url", part.image_url.url)
                    )
                    if isinstance(part, ImageURLPart)
                    else {"type": "text", "text": part.text}
                    for j, part in enumerate(self.content)
                ]
            else:
                message["content"] = "".join(part.text for part in self.content)
        if self.tool_calls and self.content is None:
            message["content"] = ""
        return message


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: the schema the reply follows.

    The reply always follows the schema. In strict mode (the default here, and `strict:
    true`) objects that list properties without `additionalProperties` get false, as
    OpenAI's do; with `strict: false` they stay open, as JSON Schema reads them.
    """

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """`response_format`: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self

    def reply_schema(self) -> dict[str, Any] | None:
        """The JSON schema the reply must follow, or None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.json_schema is None:
            return None
        schema = self.json_schema.schema_
        return lenient_schema(schema) if self.json_schema.strict is False else schema


class FunctionDefinition(StrictModel):
    """A function the model may call: name, description, JSON schema of its arguments."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    """`tool_choice.function`: the name of the tool to call."""

    name: str


class NamedToolChoice(StrictModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this tool."""

    type: Literal["function"]
    function: FunctionName


def _no_reserved_template_names(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_NAMES)
    if taken:
        raise ValueError(f"{taken[0]!r} is set by the server, not by chat_template_kwargs")
    return kwargs


#: `chat_template_kwargs`: variables for the chat template, not those the server sets.
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_no_reserved_template_names)]


class GenerationRequest(StrictModel):
    """The fields chat and text completions share: model, sampling, stopping, streaming,
    and vLLM's constraint fields (`extra_body` in the openai client): guided_json,
    guided_regex, guided_choice, guided_grammar, at most one of them."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K, description="0 = no top-k cut")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    # Choice j of n samples with seed + j; torch seeds are 64-bit, so keep clear of the top.
    seed: int | None = Field(None, ge=0, le=2**62)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and not acted on: they tag or route a request on OpenAI's side.
    user: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    guided_json: dict[str, Any] | None = None
    # Empty constraints mean nothing: refused here, so that the 400 names the field.
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None
    ) = None
    guided_grammar: str | None = Field(None, min_length=1)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_of_token_ids(cls, bias: dict[str, float] | None) -> dict[int, float] | None:
        """{"token id": bias} in JSON -> {id: bias}; ids past the vocabulary are checked
        by the server, which knows it."""
        if bias is None:
            return None
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"the bias of token {key} is {value}; biases lie in "
                    f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        return {int(key): value for key, value in bias.items()}

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_constraint_of_bounded_size(self):
        given = self.constraint_fields()
        if len(given) > 1:
            names = ", ".join(name for name in CONSTRAINT_FIELDS if hasattr(self, name))
            raise ValueError(f"give at most one of {names}; got {' and '.join(given)}")
        for name, value in given.items():
            size = len(value.encode() if isinstance(value, str) else json.dumps(value).encode())
            if size > MAX_CONSTRAINT_BYTES:
                raise ValueError(
                    f"{name} is {size} bytes; constraints of at most "
                    f"{MAX_CONSTRAINT_BYTES} bytes are compiled"
                )
        return self

    def constraint_fields(self) -> dict[str, Any]:
        """{request field: value} of the output constraints this request sets."""
        values = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        return {name: value for name, value in values.items() if value is not None}

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_overrides(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (None = keep the server's default)."""
        fields = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.token_budget,
            seed=self.seed,
            stop=self.stop_strings or None,
            logprobs=self.top_logprobs_count,
            logit_bias=self.logit_bias,
            **self.constraint(),
        )
        return {name: value for name, value in fields.items() if value is not None}

    def constraint(self) -> dict[str, Any]:
        """The SamplingParams constraint field (json_schema, regex, choice, grammar) this
        request sets, if any."""
        return {CONSTRAINT_FIELDS[name]: value for name, value in self.constraint_fields().items()}

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        """None = no logprobs; k >= 0 = the sampled token's logprob and k alternatives."""
        raise NotImplementedError


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: TemplateKwargs = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Thinking on or off (a thinking model's template's `enable_thinking`); see `thinking`.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: Unsupported("qinfer answers in text only") = None
    prediction: Unsupported("predicted outputs are not implemented") = None
    web_search_options: Unsupported("qinfer does not search the web") = None
    functions: Unsupported("the deprecated functions field; send tools instead") = None
    function_call: Unsupported("the deprecated function_call field; send tool_choice") = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self

    @field_validator("tools")
    @classmethod
    def _tools_are_distinct_and_bounded(cls, tools: list[ToolDefinition] | None):
        functions = [tool.function for tool in tools or ()]
        check_tools([f.name for f in functions], [f.parameters for f in functions])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _names_an_offered_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        # A field validator (tools, declared before, is already checked) so that the 400
        # names tool_choice; invalid tools are reported instead.
        if "tools" not in info.data or choice in (None, "none", "auto"):
            return choice
        tools = info.data["tools"] or []
        if not tools:
            raise ValueError("a forced tool call needs tools: give the tools it may call")
        names = {tool.function.name for tool in tools}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"{choice.function.name!r} is not one of the tools")
        return choice

    @model_validator(mode="after")
    def _forced_call_without_other_constraint(self):
        if self.forced_tool is not None and self.constraint_fields():
            field = next(iter(self.constraint_fields()))
            raise ValueError(
                f"tool_choice forces a tool call, whose grammar cannot be combined with {field}"
            )
        return self

    def constraint_fields(self) -> dict[str, Any]:
        """As `GenerationRequest.constraint_fields`, with a `response_format` that asks for
        JSON (its schema) first."""
        fields = super().constraint_fields()
        schema = None if self.response_format is None else self.response_format.reply_schema()
        return fields if schema is None else {"response_format": schema, **fields}

    @property
    def thinking(self) -> bool | None:
        """Whether `reasoning_effort` asks a thinking model to think (None: not said)."""
        if self.reasoning_effort is None:
            return None
        return self.reasoning_effort not in ("none", "minimal")

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools shown to the model (None when there are none or tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def forced_tool(self) -> str | None:
        """ "required" (some tool must be called), a tool's name (that one), or None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    @property
    def token_budget(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`: one prompt, or a batch of them (one choice group each).

    echo: each choice's text starts with its prompt's; with `logprobs`, its logprobs
    start with the prompt tokens' (the first's null, as OpenAI's and vLLM's). max_tokens 0
    generates nothing: with echo and logprobs, the prompt's logprobs alone (what
    lm-eval's loglikelihood asks). suffix: the text after the completion (fill in the
    middle, for models with FIM tokens; see `qinfer.text.fill_in_middle`).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for text completions (chat runs to the end of the context).
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError(
                f"best_of {best_of} differs from n: qinfer returns every choice it samples "
                "and does not rank them; set n instead"
            )
        return best_of

    @model_validator(mode="after")
    def _prompts_not_empty(self):
        if not self.prompts:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """The list of prompts: a lone string or a lone list of ids is one prompt."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(token, int) for token in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def sampling_overrides(self) -> dict[str, Any]:
        fields = super().sampling_overrides()
        if self.echo and self.logprobs is not None:
            fields["prompt_logprobs"] = self.logprobs
        return fields


class TokenizeRequest(StrictModel):
    """vLLM's `POST /tokenize`: a `prompt` (encoded as a text completion encodes it), or
    chat `messages` (rendered as a chat request renders them, tools included)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # the prompt's BOS/EOS, as a text completion adds them
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    """vLLM's `POST /detokenize`: the text of `tokens`."""

    model: str | None = None
    tokens: list[int]
