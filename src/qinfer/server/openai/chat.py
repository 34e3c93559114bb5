"""OpenAI's chat completions: `POST /v1/chat/completions`, its request body (the
messages, the JSON reply format, which the Responses API reads too, and the tools), its
handling over the shared chat machinery (`ModelServer.start_chat`) and the
`chat.completion` answer it gives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from qinfer.request.grammar import lenient_schema
from qinfer.request.sampling import MAX_LOGPROBS
from qinfer.request.tool_calls import ToolCallDelta, check_tool_schemas
from qinfer.server.choices import Completion, Delta
from qinfer.server.images import ImageRef, image_part
from qinfer.server.openai.answers import ChatCompletion, ChatEvent
from qinfer.server.openai.generation import (
    ChoicesFormat,
    GenerationRequest,
    json_logprob,
    sampling_params,
)
from qinfer.server.openapi import documented
from qinfer.server.routing import Access, read_body
from qinfer.server.schema import (
    MAX_TOOLS,
    StrictModel,
    TemplateKwargs,
    Unsupported,
    check_tools,
    json_object,
)

if TYPE_CHECKING:
    from qinfer.engine import TokenLogprob
    from qinfer.server.model_server import ModelServer


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
    # vLLM's name: at most this many tokens of <think> (then </think> is forced; see
    # `SamplingParams.thinking_budget`); None: the server's `--reasoning-budget`.
    thinking_token_budget: int | None = Field(None, ge=0)
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

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them."""
        return [message.for_template(i) for i, message in enumerate(self.messages)]

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

    def sampling_overrides(self) -> dict[str, Any]:
        fields = super().sampling_overrides()
        if self.thinking_token_budget is not None:
            fields["thinking_budget"] = self.thinking_token_budget
        return fields

    @property
    def token_budget(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


#: A body the route accepts, for the document (/docs' "Try it out" starts from it).
CHAT_EXAMPLE = {"messages": [{"role": "user", "content": "Hi"}]}


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/chat/completions (the generate task)."""
    routes = APIRouter()

    @routes.post(
        "/v1/chat/completions",
        dependencies=access.serving("generate"),
        **documented(
            ChatCompletion,
            ChatCompletionRequest,
            CHAT_EXAMPLE,
            events=ChatEvent,
            done=True,
        ),
    )
    async def chat_completions(request: Request) -> Response | dict[str, Any]:
        return await chat(server, await read_body(request, ChatCompletionRequest), request)

    return routes


async def chat(
    server: ModelServer, body: ChatCompletionRequest, connection: Request
) -> Response | dict[str, Any]:
    lora = server.check_model(body.model, adapters=True)
    if body.tools:  # compiling schemas can take a while: off the event loop
        await run_in_threadpool(
            check_tool_schemas, [tool.model_dump(exclude_none=True) for tool in body.tools]
        )
    completion = await server.start_chat(
        body.template_messages(),
        sampling_params(server, body, chat=True),
        server.template_kwargs(body.chat_template_kwargs, body.thinking),
        tools=body.offered_tools(),
        forced_tool=body.forced_tool,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        n=body.n,
        lora=lora,
    )
    return await server.respond(
        completion,
        ChatFormat(server.tokenizer, lora or server.settings.model_name),
        connection,
        stream=body.stream,
        include_usage=body.include_usage,
    )


def openai_tool_call(call: ToolCallDelta, whole: bool) -> dict[str, Any]:
    """The `tool_calls` entry of a message (whole) or of a stream delta (its index, then
    its id and name once, then fragments of its arguments)."""
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.name is not None:
        function = {"name": call.name, **function}
    entry: dict[str, Any] = {} if whole else {"index": call.index}
    if call.id is not None:
        entry |= {"id": call.id, "type": "function"}
    return {**entry, "function": function}


class ChatFormat(ChoicesFormat):
    """`chat.completion`: an assistant message with `content`, `reasoning_content` and
    `tool_calls` (in a stream: a call's index, id and name once, then its arguments)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, delta: Delta, *, stream: bool) -> dict[str, Any]:
        if stream:
            message = {"content": delta.content} if delta.content else {}
            if delta.reasoning:
                message["reasoning_content"] = delta.reasoning
            if delta.tool_calls:
                message["tool_calls"] = [
                    openai_tool_call(call, whole=False) for call in delta.tool_calls
                ]
        else:
            message = {
                "role": "assistant",
                # OpenAI's content is null when the reply is only tool calls.
                "content": delta.content or (None if delta.tool_calls else ""),
                "reasoning_content": delta.reasoning or None,
            }
            if delta.tool_calls:
                message["tool_calls"] = [
                    openai_tool_call(call, whole=True) for call in delta.tool_calls
                ]
        return {
            "index": delta.index,
            "delta" if stream else "message": message,
            "logprobs": self._logprobs(delta.logprobs) if delta.logprobs else None,
            "finish_reason": delta.finish_reason,
        }

    def opening_chunks(self, completion: Completion) -> list[dict[str, Any]]:
        return [
            {
                "index": choice.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for choice in completion.choices
        ]

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.token_text(token_id)
            return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode())}

        content = [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(tid, value) for tid, value in lp.top_logprobs.items()],
            }
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}
