"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request's `system` and `messages` (text, `tool_use`, `tool_result` and `thinking`
blocks) become a conversation for the chat template, as chat completions render it:
tool uses are the assistant's `tool_calls`, tool results `tool` messages, thinking its
`reasoning_content`. `tools` are offered in the family's own call format; `tool_choice`
"any" or a named tool forces calls with a grammar, "none" shows no tools. `thinking`
turns Qwen3's thinking on ("enabled", "adaptive") or off ("disabled"); without it, the
server's default (`--chat-template-kwargs`) holds. Its `budget_tokens` bounds the
reasoning: `</think>` is forced once that many thinking tokens are written
(`SamplingParams.thinking_budget`), and `max_tokens` bounds thinking and answer together.
A last assistant message is a prefill:
the prompt opens the reply with its text, and the reply continues it (without it);
thinking must then be off, as Anthropic requires.

The reply goes out as content blocks in the order the model wrote them (`reply_parts`):
`thinking` (with an empty signature: nothing is signed here), `text`, `tool_use`.
Streams send Anthropic's events: message_start, ping, then per block content_block_start,
content_block_delta (text_delta, thinking_delta, input_json_delta) and content_block_stop,
then message_delta (stop_reason and usage) and message_stop.

Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with
its status codes (529 when the engine's queue is full); `AnthropicRoute` makes every
failure of these routes (authentication and request validation included) one of them.

Server-held threads (`thread`: "create", or "continue" from a stored reply with only the
new messages) are not held here: a request with one is a 400 whose
`error.details.error_code` is Anthropic's "thread_unsupported_request", on which the
client's tool runner sends that turn and the later ones again with the whole
conversation and no thread. Ignored, a "continue" would lose the history and the tools.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from qinfer.request.tool_calls import check_tool_schemas
from qinfer.server.anthropic.messages_answer import MessageEvent, ReplyMessage, TokenCount
from qinfer.server.anthropic.messages_request import ConversationRequest, MessagesRequest
from qinfer.server.choices import Completion
from qinfer.server.errors import APIError, error_from_exception
from qinfer.server.openapi import documented
from qinfer.server.reply_parts import Part, PartEvent, PartsFormat, ReplyParts
from qinfer.server.routing import Access, read_body

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from qinfer.server.model_server import ModelServer

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


#: Anthropic's error codes that its clients act on, sent as `error.details.error_code`.
ERROR_CODES = ("thread_unsupported_request",)


def threads_unsupported() -> APIError:
    """The refusal of a `thread` (module docstring), in the words the client acts on."""
    return APIError(
        400,
        "qinfer does not hold threads: send the whole conversation without 'thread'",
        param="thread",
        code="thread_unsupported_request",
    )


class AnthropicErrorDetails(BaseModel):
    error_code: str


class AnthropicErrorFields(BaseModel):
    type: str
    message: str
    details: AnthropicErrorDetails | None = None  # only for the codes clients act on (ERROR_CODES)


class AnthropicErrorBody(BaseModel):
    """The body of every error these routes answer (and /openapi.json documents)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorFields


def anthropic_error(error: APIError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in Anthropic's shape."""
    status = 529 if error.status == 503 else error.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    details = AnthropicErrorDetails(error_code=error.code) if error.code in ERROR_CODES else None
    body = AnthropicErrorBody(
        error=AnthropicErrorFields(type=kind, message=error.message, details=details)
    )
    return status, body.model_dump(exclude_none=True)


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
        content = [_block(part) for part in reply.parts if not part.cut]
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


def _block(part: Part) -> dict[str, Any]:
    """The content block of a whole part."""
    if part.kind == "text":
        return {"type": "text", "text": part.text}
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    arguments = json.loads(part.text)
    return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": arguments}


def _stop(completion: Completion, reply: ReplyParts) -> dict[str, Any]:
    """stop_reason (max_tokens, tool_use, stop_sequence, end_turn) and stop_sequence."""
    choice = completion.choices[0]
    matched = choice.output.stop_reason if isinstance(choice.output.stop_reason, str) else None
    if choice.finish_reason == "length":
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

    async def create(self, body: MessagesRequest, connection: Request) -> Response | dict[str, Any]:
        server = self.server
        if body.thread is not None:
            raise threads_unsupported()
        lora = server.check_model(body.model, adapters=True)
        await self._check_tools(body)
        params = server.settings.default_params.replace(**body.sampling_overrides())
        parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
        completion = await server.start_chat(
            _conversation(body),
            params,
            body.template_kwargs(server.template_kwargs(None)),
            tools=body.offered_tools(),
            forced_tool=body.forced_tool,
            parallel_tool_calls=parallel,
            id_prefix="msg",
            prefill=body.prefill or "",
            lora=lora,
        )
        answer_format = MessagesFormat(server.settings.model_name)
        return await server.respond(completion, answer_format, connection, stream=body.stream)

    async def count_tokens(self, body: ConversationRequest) -> dict[str, int]:
        """{"input_tokens": the prompt's length}, as `create` would encode it."""
        server = self.server
        server.check_model(body.model)
        await self._check_tools(body)
        parts = await server.encode_chat(
            _conversation(body),
            body.template_kwargs(server.template_kwargs(None)),
            body.offered_tools(),
            body.prefill or "",
        )
        # An image counts as its placeholder: its run's length needs the image decoded.
        return {"input_tokens": len(parts.token_ids)}

    async def _check_tools(self, body: ConversationRequest) -> None:
        if body.tools:  # compiling schemas can take a while: off the event loop
            tools = [tool.for_chat() for tool in body.tools]
            await run_in_threadpool(check_tool_schemas, tools, "tools.{}.input_schema")


def _conversation(body: ConversationRequest) -> list[dict[str, Any]]:
    """The messages of a request for the template, or a 400 naming `messages` when there
    are none: a lone assistant message is a prefill, which continues no turn."""
    messages = body.template_messages()
    if not messages:
        raise APIError(
            400,
            "Invalid value for 'messages': a prefill (a last assistant message) needs a "
            "system prompt or a message before it",
            param="messages",
            code="invalid_value",
        )
    return messages


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/messages and /v1/messages/count_tokens, for the generate task; every
    failure, the API key's included, answered in Anthropic's shape (`AnthropicRoute`)."""
    api = MessagesAPI(server)
    routes = APIRouter(dependencies=access.serving("generate"), route_class=AnthropicRoute)

    # Anthropic's statuses: 529 where the others answer 503 (`anthropic_error`); counting
    # tokens never reaches the engine's queue.
    errors = (400, 401, 404, 413, 529)
    # The documents' example (`model` names the served one: any other is a 404).
    message = {
        "model": server.settings.model_name,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hi"}],
    }

    @routes.post(
        "/v1/messages",
        **documented(
            ReplyMessage,
            MessagesRequest,
            message,
            errors=errors,
            error_body=AnthropicErrorBody,
            events=MessageEvent,
        ),
    )
    async def create_message(request: Request) -> Response | dict[str, Any]:
        return await api.create(await read_body(request, MessagesRequest), request)

    @routes.post(
        "/v1/messages/count_tokens",
        **documented(
            TokenCount,
            ConversationRequest,
            message,
            errors=errors[:-1],
            error_body=AnthropicErrorBody,
        ),
    )
    async def count_message_tokens(request: Request) -> dict[str, int]:
        return await api.count_tokens(await read_body(request, ConversationRequest))

    return routes
