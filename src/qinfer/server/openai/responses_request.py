"""The request body of the OpenAI Responses API (`POST /v1/responses`), and the
conversation its items make for the chat template.

Validation is as strict as chat completions' (`schema.StrictModel`), but for the items
a client echoes back from earlier output, whose extra fields are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qinfer.server.images import ImageRef, image_part
from qinfer.server.openai.chat import ResponseFormat
from qinfer.server.schema import (
    MAX_CONSTRAINT_BYTES,
    MAX_TOOLS,
    StrictModel,
    Unsupported,
    check_tools,
    json_object,
)

#: Most input items one request may send (each becomes a message for the template).
MAX_INPUT_ITEMS = 4096


class EchoedModel(StrictModel):
    """An item the server wrote, sent back as input: clients echo the output items whole,
    with fields that vary across client versions (`phase`, `caller`, ...): those are
    ignored (as by every `StrictModel`), the rest is checked strictly."""


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(EchoedModel):
    type: Literal["output_text"]
    text: str


class Refusal(EchoedModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(StrictModel):
    """An image: `image_url` a data URL or an http(s) URL (`qinfer.server.images`);
    uploaded files are OpenAI-hosted (refused)."""

    type: Literal["input_image"]
    image_url: str | None = None  # None: refused as no URL (a file_id is refused first)
    detail: Literal["auto", "low", "high", "original"] | None = None  # the checkpoint sizes images
    file_id: Unsupported("uploaded files are OpenAI-hosted: send a data URL") = None


ContentPart = Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(EchoedModel):
    """A message: the user's, the instructions' (system, developer), or an earlier reply."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    # Lists first: pydantic reports the first member's error, the most telling one.
    content: list[ContentPart] | str

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        texts = [p for p in self.content if not isinstance(p, InputImage)]
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in texts)

    def template_content(self, field: str) -> str | list[dict[str, Any]]:
        """The content as the template reads it: its text, or with images (this item
        being `field`) its text and the engine's image parts, in order."""
        if isinstance(self.content, str) or not any(
            isinstance(p, InputImage) for p in self.content
        ):
            return self.text
        return [
            image_part(ImageRef(f"{field}.content.{j}.image_url", p.image_url))
            if isinstance(p, InputImage)
            else {"type": "text", "text": p.refusal if isinstance(p, Refusal) else p.text}
            for j, p in enumerate(self.content)
        ]


class FunctionCallItem(EchoedModel):
    """A call the model made (an earlier output item); arguments are JSON text."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _arguments_are_an_object(cls, arguments: str) -> str:
        json_object(arguments)  # refused unless a JSON object; kept as the client wrote it
        return arguments


class FunctionCallOutputItem(EchoedModel):
    """What a call returned, sent back for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: list[InputText] | str

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(EchoedModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(EchoedModel):
    """An earlier `<think>` block (its text in `content`, or a summary of it)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


def _item_type(item: Any) -> str:
    """A message may leave out its `type` (OpenAI's "easy input message")."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
_INPUT_ITEM = TypeAdapter(InputItem)


def input_item(value: dict[str, Any]) -> Any:
    """An item as input (an output item of the server's, kept for `previous_response_id`)."""
    return _INPUT_ITEM.validate_python(value)


class FunctionTool(StrictModel):
    """A function the model may call (the only kind of tool served)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        """The tool as chat requests and templates show it."""
        return {
            "type": "function",
            "function": self.model_dump(exclude={"type"}, exclude_none=True),
        }


class FunctionChoice(StrictModel):
    """`tool_choice: {"type": "function", "name": ...}`: call this function."""

    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """`text.format`: plain text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        if self.schema_ is not None and len(json.dumps(self.schema_)) > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"schemas of at most {MAX_CONSTRAINT_BYTES} bytes are compiled")
        return self

    def reply_schema(self) -> dict[str, Any] | None:
        """The JSON schema the reply must follow (None: plain text), as chat's
        `response_format` reads it (strict unless `strict: false`)."""
        chat_format = {"type": self.type}
        if self.type == "json_schema":
            chat_format["json_schema"] = self.model_dump(exclude={"type"}, by_alias=True)
        return ResponseFormat.model_validate(chat_format).reply_schema()


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    """`reasoning`: its effort turns Qwen3's thinking on ("low" and up) or off ("none",
    "minimal"); summaries are not written (the reasoning itself is returned)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @property
    def thinking(self) -> bool | None:
        """The template's enable_thinking (None: the server's default)."""
        return None if self.effort is None else self.effort not in ("none", "minimal")


class ResponsesRequest(StrictModel):
    """`POST /v1/responses`. OpenAI's hosted features (background runs, conversations,
    stored prompts) are refused; `metadata`, `user`, `include`, `service_tier`,
    `prompt_cache_key` and `safety_identifier` are accepted and change nothing."""

    model: str | None = None
    input: Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)] | str
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI-hosted features, named so that asking for one is a 400 that says so.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    @field_validator("background", "conversation", "prompt")
    @classmethod
    def _hosted_features_refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False):
            raise ValueError(f"{info.field_name} is an OpenAI-hosted feature qinfer does not serve")
        return value

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, value: str | list[Any]) -> str | list[Any]:
        if not value:
            raise ValueError("input must not be empty: give some text or items")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_are_distinct_and_bounded(cls, tools: list[FunctionTool] | None):
        check_tools([tool.name for tool in tools or ()], [tool.parameters for tool in tools or ()])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _names_an_offered_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data or choice in ("none", "auto"):
            return choice
        names = {tool.name for tool in info.data["tools"] or ()}
        if not names:
            raise ValueError("a forced tool call needs tools: give the tools it may call")
        if isinstance(choice, FunctionChoice) and choice.name not in names:
            raise ValueError(f"{choice.name!r} is not one of the tools")
        return choice

    @model_validator(mode="after")
    def _forced_call_without_a_format(self):
        if self.forced_tool is not None and self.reply_schema() is not None:
            raise ValueError(
                "tool_choice forces a tool call, whose grammar cannot be combined with "
                "a JSON text.format"
            )
        return self

    @property
    def items(self) -> list[Any]:
        """The input as items (text is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def forced_tool(self) -> str | None:
        if isinstance(self.tool_choice, FunctionChoice):
            return self.tool_choice.name
        return "required" if self.tool_choice == "required" else None

    def offered_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.for_chat() for tool in self.tools]

    def reply_schema(self) -> dict[str, Any] | None:
        if self.text is None or self.text.format is None:
            return None
        return self.text.format.reply_schema()

    def sampling_overrides(self) -> dict[str, Any]:
        fields = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_output_tokens,
            json_schema=self.reply_schema(),
        )
        return {name: value for name, value in fields.items() if value is not None}


def template_messages(
    instructions: str | None, items: list[Any], first_input: int = 0
) -> list[dict[str, Any]]:
    """The conversation of `items` as a chat template reads it; items from `first_input`
    on are the request's `input` (before: the previous response's), which names their
    image parts.

    Developer messages are system messages; a reasoning item becomes the
    `reasoning_content` of the assistant turn after it; consecutive function calls join
    the assistant turn before them; their outputs are `tool` messages.
    """
    messages = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = None  # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = item.text
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.text, "tool_call_id": item.call_id})
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            role = "system" if item.role == "developer" else item.role
            field = f"input.{i - first_input}" if i >= first_input else "previous_response_id"
            messages.append({"role": role, "content": item.template_content(field)})
            continue
        last = messages[-1] if messages else None
        if isinstance(item, FunctionCallItem) and last is not None and last["role"] == "assistant":
            turn = last  # a call joins the turn whose text (or calls) came before it
        else:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        if reasoning:
            turn["reasoning_content"], reasoning = reasoning, None
        if isinstance(item, MessageItem):
            turn["content"] += item.text
        else:
            call = {"name": item.name, "arguments": json.loads(item.arguments)}
            call = {"id": item.call_id, "type": "function", "function": call}
            turn.setdefault("tool_calls", []).append(call)
    return messages
