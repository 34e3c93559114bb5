"""The Messages API's answers as models: the message (`POST /v1/messages`), the events of
its stream and the token count, as `anthropic.messages` builds them (see `openai.answers`
for why answers are models)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from qinfer.server.schema import Answer


class ReplyText(Answer):
    type: Literal["text"]
    text: str


class ReplyThinking(Answer):
    type: Literal["thinking"]
    thinking: str
    signature: str  # empty: nothing is signed here


class ReplyToolUse(Answer):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]  # empty while a stream opens the block


ReplyBlock = Annotated[ReplyText | ReplyThinking | ReplyToolUse, Field(discriminator="type")]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(Answer):
    input_tokens: int  # those not read from the prefix cache
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class ReplyMessage(Answer):
    """The assistant's message; its stop reason is null while a stream opens it."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ReplyBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(Answer):
    """`POST /v1/messages/count_tokens`."""

    input_tokens: int


class MessageStart(Answer):
    type: Literal["message_start"]
    message: ReplyMessage


class Ping(Answer):
    type: Literal["ping"]


class BlockStart(Answer):
    type: Literal["content_block_start"]
    index: int
    content_block: ReplyBlock


class TextDelta(Answer):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(Answer):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(Answer):
    type: Literal["input_json_delta"]
    partial_json: str


class BlockDelta(Answer):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class BlockStop(Answer):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(Answer):
    stop_reason: StopReason
    stop_sequence: str | None


class OutputUsage(Answer):
    output_tokens: int


class MessageDelta(Answer):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: OutputUsage


class MessageStop(Answer):
    type: Literal["message_stop"]


class StreamErrorFields(Answer):
    type: str
    message: str
    details: dict[str, str] | None = None  # the error_code clients act on, if any


class StreamError(Answer):
    """The error that ended a stream, in Anthropic's error shape."""

    type: Literal["error"]
    error: StreamErrorFields


#: The data of one event of a message's stream (its event name is its type).
MessageEvent = Annotated[
    MessageStart
    | Ping
    | BlockStart
    | BlockDelta
    | BlockStop
    | MessageDelta
    | MessageStop
    | StreamError,
    Field(discriminator="type"),
]
