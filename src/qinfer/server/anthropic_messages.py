"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request's `system` and `messages` (text, `tool_use`, `tool_result` and `thinking`
blocks) become a conversation for the chat template, as chat completions render it:
tool uses are the assistant's `tool_calls`, tool results `tool` messages, thinking its
`reasoning_content`. `tools` are offered in the family's own call format; `tool_choice`
"any" or a named tool forces calls with a grammar, "none" shows no tools. `thinking`
turns Qwen3's thinking on ("enabled", "adaptive") or off ("disabled"); without it, the
server's default (`--chat-template-kwargs`) holds. Its `budget_tokens` is not enforced:
`max_tokens` bounds thinking and answer together.

The reply goes out as content blocks in the order the model wrote them (`reply_parts`):
`thinking` (with an empty signature: nothing is signed here), `text`, `tool_use`.
Streams send Anthropic's events: message_start, ping, then per block content_block_start,
content_block_delta (text_delta, thinking_delta, input_json_delta) and content_block_stop,
then message_delta (stop_reason and usage) and message_stop.

Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with
its status codes (529 when the engine's queue is full); `AnthropicRoute` makes every
failure of these routes (authentication and request validation included) one of them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from qinfer.sampling import MAX_STOP_STRINGS
from qinfer.server.completions import Completion
from qinfer.server.errors import APIError, error_from_exception
from qinfer.server.protocol import MAX_CONSTRAINT_BYTES, MAX_TOOLS, StrictModel
from qinfer.server.reply_parts import Part, PartEvent, PartsFormat, ReplyParts
from qinfer.tool_calls import check_tool_schemas

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from qinfer.server.app import ModelServer

#: Most messages one request may send (each becomes one or more for the template).
MAX_MESSAGES = 4096

#: Anthropic's error `type` of each status the server returns (503, the engine's full
#: queue, goes out as Anthropic's 529).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error(error: APIError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in Anthropic's shape."""
    status = 529 if error.status == 503 else error.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}


class AnthropicRoute(APIRoute):
    """A route whose every failure (the API key, the body, the engine) is answered in
    Anthropic's error shape instead of the app's OpenAI one."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_in_anthropic_shape(request: Request) -> Response:
            try:
                return await handle(request)
            except Exception as error:
                status, body = anthropic_error(error_from_exception(error))
                return JSONResponse(body, status_code=status)

        return handle_in_anthropic_shape


# --- the request ---------------------------------------------------------------------


class Block(StrictModel):
    """A content block. Clients echo the blocks of earlier replies whole, with fields
    that do not change the prompt here (`cache_control`, `citations`, ...): those are
    ignored, the rest is checked strictly."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Block):
    """What a tool returned (text; `is_error` marks a failure, as "Error: " before it)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] | str = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined(self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Block):
    """Another server's encrypted thinking: nothing this model can read (left out)."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


#: The blocks each role's messages may hold.
ROLE_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "thinking", "redacted_thinking", "tool_use"),
}


class Message(StrictModel):
    role: Literal["user", "assistant"]
    # Lists first: pydantic reports the first member's error, the most telling one.
    content: list[ContentBlock] | str

    @model_validator(mode="after")
    def _blocks_of_its_role(self):
        kinds = [] if isinstance(self.content, str) else [block.type for block in self.content]
        wrong = next((kind for kind in kinds if kind not in ROLE_BLOCKS[self.role]), None)
        if wrong is not None:
            raise ValueError(f"a {self.role} message cannot hold a {wrong} block")
        return self


class Tool(Block):
    """A client tool (`type` "custom" or none): Anthropic's server tools are not served."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        """The tool as chat requests and templates show it."""
        function = {"name": self.name, "description": self.description}
        function |= {"parameters": self.input_schema, "strict": self.strict}
        return {
            "type": "function",
            "function": {key: value for key, value in function.items() if value is not None},
        }


class ToolChoice(StrictModel):
    """auto (the model decides), any (some tool must be called), tool (this one), none
    (no tools shown)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a name is given with type 'tool', and only then")
        return self


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(StrictModel):
    """`output_config.format`: the reply is JSON under this schema."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, schema: dict[str, Any]) -> dict[str, Any]:
        size = len(json.dumps(schema).encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise ValueError(
                f"the schema is {size} bytes; schemas of at most {MAX_CONSTRAINT_BYTES} "
                "bytes are compiled"
            )
        return schema


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class ConversationRequest(StrictModel):
    """What `/v1/messages/count_tokens` reads, and `/v1/messages` with it: the model, the
    conversation and the tools."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: list[TextBlock] | str | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("messages")
    @classmethod
    def _no_prefill(cls, messages: list[Message]) -> list[Message]:
        if messages[-1].role == "assistant":
            raise ValueError(
                "the last message is the assistant's: continuing it (prefill) is not "
                "supported; end with a user message"
            )
        return messages

    @field_validator("tools")
    @classmethod
    def _tools_are_distinct_and_bounded(cls, tools: list[Tool] | None):
        names = [tool.name for tool in tools or ()]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise ValueError(f"two tools are named {twice!r}; tool names must be distinct")
        size = sum(len(json.dumps(tool.input_schema).encode()) for tool in tools or ())
        if size > MAX_CONSTRAINT_BYTES:
            raise ValueError(
                f"the tools' input schemas are {size} bytes; schemas of at most "
                f"{MAX_CONSTRAINT_BYTES} bytes in all are compiled"
            )
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _names_an_offered_tool(cls, choice: ToolChoice | None, info: ValidationInfo):
        if "tools" not in info.data or choice is None or choice.type in ("auto", "none"):
            return choice
        names = {tool.name for tool in info.data["tools"] or ()}
        if not names:
            raise ValueError("a forced tool call needs tools: give the tools it may call")
        if choice.name is not None and choice.name not in names:
            raise ValueError(f"{choice.name!r} is not one of the tools")
        return choice

    @property
    def forced_tool(self) -> str | None:
        """ "required" (some tool must be called), a tool's name (that one), or None."""
        if self.tool_choice is None or self.tool_choice.type in ("auto", "none"):
            return None
        return self.tool_choice.name or "required"

    def offered_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        return [tool.for_chat() for tool in self.tools]

    def template_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The server's template kwargs, with `thinking` as Qwen3's enable_thinking."""
        if self.thinking is None:
            return defaults
        return {**defaults, "enable_thinking": self.thinking.type != "disabled"}

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as a chat template reads it (module docstring)."""
        system = self.system if isinstance(self.system, str) else _joined(self.system or [])
        messages = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            blocks = message.content
            if isinstance(blocks, str):
                blocks = [TextBlock(type="text", text=blocks)]
            if message.role == "assistant":
                messages.append(_assistant_turn(blocks))
                continue
            texts: list[TextBlock] = []
            for block in blocks:
                if isinstance(block, ToolResultBlock):
                    tool = {
                        "role": "tool",
                        "content": block.text,
                        "tool_call_id": block.tool_use_id,
                    }
                    messages.append(tool)
                else:
                    texts.append(block)
            if texts or not blocks:
                messages.append({"role": "user", "content": _joined(texts)})
        return messages


def _assistant_turn(blocks: list[Any]) -> dict[str, Any]:
    """An earlier reply: its text, its thinking as reasoning_content, its tool uses as calls."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    turn["content"] = _joined([block for block in blocks if isinstance(block, TextBlock)])
    thinking = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    if thinking:
        turn["reasoning_content"] = thinking
    calls = [
        {
            "id": block.id,
            "type": "function",
            "function": {"name": block.name, "arguments": block.input},
        }
        for block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn


def _joined(blocks: list[TextBlock]) -> str:
    """Text blocks as one text, a newline between two blocks."""
    return "\n".join(block.text for block in blocks)


class MessagesRequest(ConversationRequest):
    """`POST /v1/messages`. `metadata`, `service_tier` and `cache_control` are accepted and
    change nothing (the prefix cache needs no marks), `output_config.effort` likewise;
    Anthropic's hosted features (containers, MCP servers) are refused."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
    # Anthropic-hosted features, named so that asking for one is a 400 that says so.
    container: str | dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None

    @field_validator("container", "mcp_servers")
    @classmethod
    def _hosted_features_refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(
                f"{info.field_name} is an Anthropic-hosted feature qinfer does not serve"
            )
        return value

    @model_validator(mode="after")
    def _forced_call_without_a_format(self):
        if self.forced_tool is not None and self.reply_schema() is not None:
            raise ValueError(
                "tool_choice forces a tool call, whose grammar cannot be combined with "
                "output_config.format"
            )
        return self

    def reply_schema(self) -> dict[str, Any] | None:
        config = self.output_config
        return None if config is None or config.format is None else config.format.schema_

    def sampling_overrides(self) -> dict[str, Any]:
        fields = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop=self.stop_sequences or None,
            json_schema=self.reply_schema(),
        )
        return {name: value for name, value in fields.items() if value is not None}


# --- the answer -----------------------------------------------------------------------


class MessagesFormat(PartsFormat):
    """A message object and its stream events, for one request."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.id = f"msg_{uuid.uuid4().hex}"

    def message(
        self, completion: Completion, content: list[dict[str, Any]], stop: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            **stop,
            "usage": _usage(completion),
        }

    def answer(self, completion: Completion, reply: ReplyParts) -> dict[str, Any]:
        # A call cut by max_tokens has arguments that do not parse: it is left out (the
        # stop reason says the reply was cut), never returned with made-up input.
        content = [block for part in reply.parts if (block := _block(part)) is not None]
        return self.message(completion, content, _stop(completion, reply))

    def opening_events(self, completion: Completion) -> list[dict[str, Any]]:
        stop = {"stop_reason": None, "stop_sequence": None}
        return [
            {"type": "message_start", "message": self.message(completion, [], stop)},
            {"type": "ping"},
        ]

    def part_events(self, event: PartEvent, completion: Completion) -> list[dict[str, Any]]:
        part = event.part
        if event.action == "open":
            start = _empty_block(part)
            return [{"type": "content_block_start", "index": part.index, "content_block": start}]
        if event.action == "add":
            kind, field = _DELTAS[part.kind]
            delta = {"type": kind, field: event.text}
            return [{"type": "content_block_delta", "index": part.index, "delta": delta}]
        return [{"type": "content_block_stop", "index": part.index}]

    def closing_events(self, completion: Completion, reply: ReplyParts) -> list[dict[str, Any]]:
        output_tokens = {"output_tokens": _usage(completion)["output_tokens"]}
        return [
            {"type": "message_delta", "delta": _stop(completion, reply), "usage": output_tokens},
            {"type": "message_stop"},
        ]

    def error_events(self, error: APIError, completion: Completion) -> list[dict[str, Any]]:
        return [anthropic_error(error)[1]]


#: The delta type of each kind of part, and its field.
_DELTAS = {
    "text": ("text_delta", "text"),
    "reasoning": ("thinking_delta", "thinking"),
    "call": ("input_json_delta", "partial_json"),
}


def _empty_block(part: Part) -> dict[str, Any]:
    """The content block of a part as its stream opens it (no text, no input yet)."""
    if part.kind == "text":
        return {"type": "text", "text": ""}
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": {}}


def _block(part: Part) -> dict[str, Any] | None:
    """The content block of a whole part (None: a call whose arguments do not parse)."""
    if part.kind == "text":
        return {"type": "text", "text": part.text}
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    try:
        arguments = json.loads(part.text)
    except json.JSONDecodeError:
        return None
    return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": arguments}


def _stop(completion: Completion, reply: ReplyParts) -> dict[str, Any]:
    """stop_reason (max_tokens, tool_use, stop_sequence, end_turn) and stop_sequence."""
    output = completion.choices[0].output
    matched = output.stop_reason if isinstance(output.stop_reason, str) else None
    if output.finish_reason == "length":
        reason = "max_tokens"
    elif reply.made_calls:
        reason = "tool_use"
    else:
        reason = "end_turn" if matched is None else "stop_sequence"
    return {"stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None}


def _usage(completion: Completion) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those not read from the prefix cache."""
    output = completion.choices[0].output
    return {
        "input_tokens": output.num_prompt_tokens - output.num_cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": output.num_cached_tokens,
        "output_tokens": output.num_generated_tokens,
    }


# --- the endpoints ----------------------------------------------------------------------


class MessagesAPI:
    """`POST /v1/messages` and `/v1/messages/count_tokens` on a `ModelServer`."""

    def __init__(self, server: ModelServer):
        self.server = server

    async def create(self, body: MessagesRequest, connection: Request) -> Response:
        server = self.server
        server.check_model(body.model)
        await self._check_tools(body)
        params = server.settings.default_params.replace(**body.sampling_overrides())
        parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
        completion = await server.start_chat(
            body.template_messages(),
            params,
            body.template_kwargs(server.template_kwargs(None)),
            tools=body.offered_tools(),
            forced_tool=body.forced_tool,
            parallel_tool_calls=parallel,
            id_prefix="msg",
        )
        answer_format = MessagesFormat(server.settings.model_name)
        return await server.respond(completion, answer_format, connection, stream=body.stream)

    async def count_tokens(self, body: ConversationRequest) -> dict[str, int]:
        """{"input_tokens": the prompt's length}, as `create` would encode it."""
        server = self.server
        server.check_model(body.model)
        await self._check_tools(body)
        ids = await server.encode_chat(
            body.template_messages(),
            body.template_kwargs(server.template_kwargs(None)),
            body.offered_tools(),
        )
        return {"input_tokens": len(ids)}

    async def _check_tools(self, body: ConversationRequest) -> None:
        if body.tools:  # compiling schemas can take a while: off the event loop
            tools = [tool.for_chat() for tool in body.tools]
            await run_in_threadpool(check_tool_schemas, tools, "tools.{}.input_schema")
