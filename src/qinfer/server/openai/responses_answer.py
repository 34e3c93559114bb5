"""The Responses API's answers as models: the response object (`POST /v1/responses`, `GET
/v1/responses/{id}`), its output items, a deleted response, and the events of its stream,
as `openai.responses` builds them (see `openai.answers` for why answers are models)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from qinfer.server.schema import Answer

#: An output item's status: announced in a stream, done, or cut by the token budget.
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextPart(Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]  # none are computed


class ReasoningTextPart(Answer):
    type: Literal["reasoning_text"]
    text: str


ContentPart = Annotated[OutputTextPart | ReasoningTextPart, Field(discriminator="type")]


class OutputMessage(Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[OutputTextPart]  # empty while a stream announces it
    status: ItemStatus


class OutputReasoning(Answer):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningTextPart]
    status: ItemStatus


class OutputFunctionCall(Answer):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text (what a stream has of it so far, while in progress)
    status: ItemStatus


OutputItem = Annotated[
    OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")
]


class ResponseFailure(Answer):
    code: str
    message: str


class IncompleteDetails(Answer):
    reason: Literal["max_output_tokens"]


class ReasoningEcho(Answer):
    effort: str | None
    summary: None


class TextEcho(Answer):
    format: dict[str, Any]  # the request's text.format, or {"type": "text"}


class InputTokensDetails(Answer):
    cached_tokens: int


class OutputTokensDetails(Answer):
    reasoning_tokens: int  # generated up to and including </think>


class ResponseUsage(Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(Answer):
    """A response: its status and output, and the request's settings echoed."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseFailure | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningEcho
    store: bool
    temperature: float
    top_p: float
    text: TextEcho
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None  # null until the response ends
    user: str | None
    metadata: dict[str, str]


class DeletedResponse(Answer):
    """`DELETE /v1/responses/{id}`."""

    id: str
    object: Literal["response"]
    deleted: Literal[True]


class Numbered(Answer):
    sequence_number: int  # the event's place in its stream, from 0


class ResponseEvent(Numbered):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class OutputItemEvent(Numbered):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class PlacedEvent(Numbered):
    """An event about one output item's text part."""

    item_id: str
    output_index: int
    content_index: int


class ContentPartEvent(PlacedEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: ContentPart


class TextDeltaEvent(PlacedEvent):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    delta: str
    logprobs: list[Any] | None = None  # text's only


class TextDoneEvent(PlacedEvent):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    text: str
    logprobs: list[Any] | None = None  # text's only


class ArgumentsDeltaEvent(Numbered):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Numbered):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str
    name: str


class ErrorEvent(Numbered):
    """The error that ended a stream (a `response.failed` follows)."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


#: The data of one event of a response's stream (its event name is its type).
ResponseStreamEvent = Annotated[
    ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent,
    Field(discriminator="type"),
]
