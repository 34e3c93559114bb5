"""The request bodies of the Anthropic Messages API (`POST /v1/messages`,
`/v1/messages/count_tokens`), and the conversation they make for the chat template.

Validation is as strict as chat completions' (`schema.StrictModel`), but for content
blocks, which clients echo back from earlier replies with fields that do not change the
prompt here (ignored).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from qinfer.request.sampling import MAX_STOP_STRINGS
from qinfer.server.images import ImageRef, image_part
from qinfer.server.schema import (
    MAX_CONSTRAINT_BYTES,
    MAX_TOOLS,
    MAX_TOP_K,
    StrictModel,
    check_tools,
)

#: Most messages one request may send (each becomes one or more for the template).
MAX_MESSAGES = 4096


class Block(StrictModel):
    """A content block. Clients echo the blocks of earlier replies whole, with fields
    that do not change the prompt here (`cache_control`, `citations`, ...): those are
    ignored (as by every `StrictModel`), the rest is checked strictly."""


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


class Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(StrictModel):
    """An http(s) URL, fetched only from a host the server allows (`qinfer.server.images`)."""

    type: Literal["url"]
    url: str


class ImageBlock(Block):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def ref(self, field: str) -> ImageRef:
        """The image of this block, which is the request's `field`."""
        source = self.source
        if isinstance(source, Base64Source):
            return ImageRef(f"{field}.source.data", data=source.data)
        return ImageRef(f"{field}.source.url", url=source.url)


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


#: The blocks each role's messages may hold.
ROLE_BLOCKS = {
    "user": ("text", "image", "tool_result"),
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
    def _prefill_of_text(cls, messages: list[Message]) -> list[Message]:
        """A last assistant message is a prefill: text the reply continues (Anthropic's
        rules: text blocks only, no trailing whitespace)."""
        last = messages[-1]
        if last.role != "assistant" or isinstance(last.content, str):
            blocks = []
        else:
            blocks = last.content
        if any(not isinstance(block, TextBlock) for block in blocks):
            raise ValueError("a last assistant message (a prefill) holds text blocks only")
        if last.role == "assistant" and _message_text(last) != _message_text(last).rstrip():
            raise ValueError("final assistant content cannot end with trailing whitespace")
        return messages

    @model_validator(mode="after")
    def _no_prefill_while_thinking(self):
        if self.prefill is not None and self.thinking and self.thinking.type != "disabled":
            raise ValueError(
                "a last assistant message (a prefill) cannot be continued with thinking "
                "enabled: end with a user message, or disable thinking"
            )
        return self

    @property
    def prefill(self) -> str | None:
        """The text of a last assistant message, which the reply continues; else None."""
        last = self.messages[-1]
        return _message_text(last) if last.role == "assistant" else None

    @field_validator("tools")
    @classmethod
    def _tools_are_distinct_and_bounded(cls, tools: list[Tool] | None):
        schemas = [tool.input_schema for tool in tools or ()]
        check_tools([tool.name for tool in tools or ()], schemas, what="input schemas")
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
        # A prefill is not a turn: the prompt ends with the reply opened, then its text.
        turns = self.messages[:-1] if self.prefill is not None else self.messages
        for i, message in enumerate(turns):
            blocks = message.content
            if isinstance(blocks, str):
                blocks = [TextBlock(type="text", text=blocks)]
            if message.role == "assistant":
                messages.append(_assistant_turn(blocks))
                continue
            texts: list[TextBlock | dict[str, Any]] = []
            for j, block in enumerate(blocks):
                if isinstance(block, ImageBlock):
                    texts.append(image_part(block.ref(f"messages.{i}.content.{j}")))
                elif isinstance(block, ToolResultBlock):
                    tool = {
                        "role": "tool",
                        "content": block.text,
                        "tool_call_id": block.tool_use_id,
                    }
                    messages.append(tool)
                else:
                    texts.append(block)
            if texts or not blocks:
                messages.append({"role": "user", "content": _user_content(texts)})
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


def _message_text(message: Message) -> str:
    content = message.content
    return content if isinstance(content, str) else _joined(content)


def _user_content(blocks: list[TextBlock | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A user turn's text blocks as one text; with images (the engine's image parts, in
    `blocks` already), its text and image parts in order."""
    if all(isinstance(block, TextBlock) for block in blocks):
        return _joined(blocks)
    return [
        {"type": "text", "text": block.text} if isinstance(block, TextBlock) else block
        for block in blocks
    ]


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
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
    # Anthropic-hosted features, named so that asking for one is a 400 that says so.
    container: str | dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    # Server-held threads: read only to be refused (messages.threads_unsupported).
    thread: dict[str, Any] | None = None

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

    def thinking_budget(self) -> int | None:
        """`thinking.budget_tokens` when thinking is on: the most tokens of reasoning."""
        thinking = self.thinking
        if thinking is None or thinking.type == "disabled":
            return None
        return thinking.budget_tokens

    def sampling_overrides(self) -> dict[str, Any]:
        fields = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop=self.stop_sequences or None,
            json_schema=self.reply_schema(),
            thinking_budget=self.thinking_budget(),
        )
        return {name: value for name, value in fields.items() if value is not None}
