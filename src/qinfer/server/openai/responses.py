"""The OpenAI Responses API: `POST /v1/responses`, over the chat machinery.

A request's `input` (text, or items: messages, the function calls the model made, their
outputs, reasoning) becomes a conversation for the chat template, after `instructions`
(as a system message) and, with `previous_response_id`, after the conversation of that
earlier response and its output. Responses are stored for that in memory, the most recent
`ResponseStore.capacity` of them (`store: false` keeps one out), and `GET` / `DELETE
/v1/responses/{id}` read and drop them; the server is otherwise stateless, and a restart
forgets them.

The reply goes out as output items, in the order the model wrote them (`reply_parts`):
a `reasoning` item for Qwen3's `<think>` block, a `message` item for the text, a
`function_call` item per tool call (the family's own call format; `tool_choice`
"required" or a named function forces calls with a grammar). Streams send OpenAI's
documented events, each with its `sequence_number`:

    response.created, response.in_progress
    per item: response.output_item.added, then
        reasoning  response.content_part.added, response.reasoning_text.delta...,
                   response.reasoning_text.done, response.content_part.done
        message    response.content_part.added, response.output_text.delta...,
                   response.output_text.done, response.content_part.done
        call       response.function_call_arguments.delta...,
                   response.function_call_arguments.done
    then response.output_item.done
    response.completed, response.incomplete (max_output_tokens reached), or
    response.failed: the reply was stopped by the server (`qinfer serve` stopping) or
    failed (an `error` event before it)
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from qinfer.request.sampling import SamplingParams
from qinfer.request.tool_calls import check_tool_schemas
from qinfer.server.choices import Completion
from qinfer.server.errors import APIError
from qinfer.server.openai.responses_answer import (
    DeletedResponse,
    ResponseObject,
    ResponseStreamEvent,
)
from qinfer.server.openai.responses_request import (
    MAX_INPUT_ITEMS,
    ResponsesRequest,
    input_item,
    template_messages,
)
from qinfer.server.openapi import documented
from qinfer.server.reply_parts import Part, PartEvent, PartsFormat, ReplyParts
from qinfer.server.routing import Access, read_body
from qinfer.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from qinfer.server.model_server import ModelServer

#: Responses kept for `previous_response_id` (the least recently used go first).
STORED_RESPONSES = 1024


# --- the store ---------------------------------------------------------------------------


class ResponseStore:
    """Recent responses by id: each one's response object, and its conversation (input
    and output items) for `previous_response_id`; at most `capacity`, the least recently
    used dropped first."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        # id -> (conversation items, response object)
        self._responses: OrderedDict[str, tuple[list[Any], dict[str, Any]]] = OrderedDict()

    def conversation(self, response_id: str) -> list[Any]:
        """The items of a stored response's conversation, or a 400 naming the field."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(
                400,
                f"Previous response with id '{response_id}' not found (responses are kept in "
                f"memory, the latest {self.capacity}, and not when sent with store: false)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self._responses.move_to_end(response_id)
        return stored[0]

    def response(self, response_id: str) -> dict[str, Any]:
        """A stored response object, or a 404."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored[1]

    def delete(self, response_id: str) -> None:
        """Forget a stored response, or a 404."""
        if self._responses.pop(response_id, None) is None:
            raise _not_found(response_id)

    def save(self, response_id: str, items: list[Any], response: dict[str, Any]) -> None:
        self._responses[response_id] = (items, response)
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)


def _not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response found with id '{response_id}' (responses are kept in memory, the "
        "latest stored ones, and not when sent with store: false)",
        param="response_id",
        code="not_found",
    )


# --- the answer -----------------------------------------------------------------------

_ITEM_ID_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


class ResponsesFormat(PartsFormat):
    """A response object and its stream events, for one request."""

    def __init__(
        self,
        body: ResponsesRequest,
        conversation: list[Any],
        store: ResponseStore,
        params: SamplingParams,
        tokenizer: Tokenizer,
        model_name: str,
    ):
        self.body, self.conversation, self.store = body, conversation, store
        self.params, self.tokenizer, self.model_name = params, tokenizer, model_name
        self.id = f"resp_{uuid.uuid4().hex}"
        self.sequence_number = 0
        self._item_ids: dict[int, str] = {}

    def sse(self, payload: dict[str, Any]) -> str:
        payload = {**payload, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return super().sse(payload)

    # -- the response object ------------------------------------------------------------

    def response_object(
        self,
        completion: Completion,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text_format = body.text.format if body.text is not None else None
        tool_choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": completion.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning and body.reasoning.effort, "summary": None},
            "store": body.store,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "text": {
                "format": {"type": "text"}
                if text_format is None
                else text_format.model_dump(by_alias=True, exclude_none=True)
            },
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [tool.model_dump() for tool in body.tools or ()],
            "truncation": body.truncation,
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def item_id(self, part: Part) -> str:
        return self._item_ids.setdefault(
            part.index, f"{_ITEM_ID_PREFIX[part.kind]}_{uuid.uuid4().hex}"
        )

    def item(self, part: Part, status: str) -> dict[str, Any]:
        """The output item of a part: as announced (status "open": no text yet, shown as
        "in_progress"), or whole once the part closed ("completed", "incomplete")."""
        text = part.text if status != "open" else ""
        content = [_content(part.kind, text)] if status != "open" else []
        item: dict[str, Any] = {"id": self.item_id(part)}
        if part.kind == "reasoning":
            item |= {"type": "reasoning", "summary": [], "content": content}
        elif part.kind == "text":
            item |= {"type": "message", "role": "assistant", "content": content}
        else:
            item |= {"type": "function_call", "call_id": part.call_id, "name": part.name}
            item["arguments"] = text
        return {**item, "status": "in_progress" if status == "open" else status}

    def answer(self, completion: Completion, reply: ReplyParts) -> dict[str, Any]:
        status = _status(completion)
        error = _STOPPED if status == "failed" else None
        parts = reply.parts or [Part("text", 0)]  # a reply of nothing is an empty message
        # A call the reply's end cut is left out: its arguments are not JSON.
        output = [
            self.item(part, _last_status(part, status) if part is parts[-1] else "completed")
            for part in parts
            if not part.cut
        ]
        usage = self.usage(completion)
        response = self.response_object(completion, status, output, usage, error)
        if self.body.store:
            items = [*self.conversation, *(input_item(o) for o in output)]
            self.store.save(self.id, items, response)
        return response

    def usage(self, completion: Completion) -> dict[str, Any]:
        """OpenAI's usage; reasoning tokens are the generated ones up to and including
        `</think>` (all of them while the block is open), when the reply thought."""
        counts = completion.usage()
        details = counts.get("completion_tokens_details") or {"reasoning_tokens": 0}
        return {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": counts["prompt_tokens_details"],
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": details,
            "total_tokens": counts["total_tokens"],
        }

    # -- the stream -----------------------------------------------------------------------

    def opening_events(self, completion: Completion) -> list[dict[str, Any]]:
        response = self.response_object(completion, "in_progress", [])
        return [
            {"type": "response.created", "response": response},
            {"type": "response.in_progress", "response": response},
        ]

    def part_events(self, event: PartEvent, completion: Completion) -> list[dict[str, Any]]:
        part = event.part
        if event.action == "open":
            return self._opened(part)
        if event.action == "add":
            return [self._delta(part, event.text)]
        status = _last_status(part, _status(completion)) if event.final else "completed"
        return self._closed(part, status)

    def _where(self, part: Part) -> dict[str, Any]:
        """The fields that place an event: its item, and the item's text part."""
        where = {"item_id": self.item_id(part), "output_index": part.index}
        return where if part.kind == "call" else {**where, "content_index": 0}

    def _opened(self, part: Part) -> list[dict[str, Any]]:
        added = {"type": "response.output_item.added", "output_index": part.index}
        events = [{**added, "item": self.item(part, "open")}]
        if part.kind != "call":
            empty = _content(part.kind, "")
            events.append(
                {"type": "response.content_part.added", **self._where(part), "part": empty}
            )
        return events

    def _delta(self, part: Part, text: str) -> dict[str, Any]:
        if part.kind == "call":
            kind = "response.function_call_arguments.delta"
            return {"type": kind, **self._where(part), "delta": text}
        delta = {"type": f"response.{_CONTENT_TYPE[part.kind]}.delta", **self._where(part)}
        return {**delta, "delta": text, **_no_logprobs(part)}

    def _closed(self, part: Part, status: str) -> list[dict[str, Any]]:
        item = self.item(part, status)
        done = {"type": "response.output_item.done", "output_index": part.index, "item": item}
        if part.kind == "call":
            kind = "response.function_call_arguments.done"
            whole = {"arguments": part.text, "name": part.name}
            return [{"type": kind, **self._where(part), **whole}, done]
        text_done = {"type": f"response.{_CONTENT_TYPE[part.kind]}.done", **self._where(part)}
        part_done = {"type": "response.content_part.done", **self._where(part)}
        return [
            {**text_done, "text": part.text, **_no_logprobs(part)},
            {**part_done, "part": item["content"][0]},
            done,
        ]

    def closing_events(self, completion: Completion, reply: ReplyParts) -> list[dict[str, Any]]:
        events = []
        if not reply.parts:  # a reply of nothing: its empty message, as `answer` has
            empty = Part("text", 0)
            events = [
                payload
                for action in ("open", "close")
                for payload in self.part_events(PartEvent(action, empty, final=True), completion)
            ]
        response = self.answer(completion, reply)
        return [*events, {"type": f"response.{response['status']}", "response": response}]

    def error_events(self, error: APIError, completion: Completion) -> list[dict[str, Any]]:
        failure = {"code": "server_error", "message": error.message}
        failed = self.response_object(completion, "failed", [], error=failure)
        return [
            {"type": "error", "code": error.code, "message": error.message, "param": error.param},
            {"type": "response.failed", "response": failed},
        ]


#: The content part type of a reasoning and of a text part.
_CONTENT_TYPE = {"reasoning": "reasoning_text", "text": "output_text"}


def _content(kind: str, text: str) -> dict[str, Any]:
    """The content part of a reasoning or message item."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _no_logprobs(part: Part) -> dict[str, Any]:
    """Text events carry logprobs (none are computed here); reasoning events do not."""
    return {"logprobs": []} if part.kind == "text" else {}


#: The error of a response the server stopped before its end: the engine aborted its
#: request (`qinfer serve` stopping aborts every one), which is no reply the model finished.
_STOPPED = {"code": "server_error", "message": "the server stopped before the response ended"}


def _status(completion: Completion) -> str:
    """ "incomplete" when the reply ran out of tokens, "failed" when the server stopped
    it, else "completed"."""
    reason = completion.choices[0].finish_reason
    return {"length": "incomplete", "abort": "failed"}.get(reason, "completed")


def _last_status(part: Part, status: str) -> str:
    """The status of a reply's last part: "incomplete" when the reply was cut, but a whole
    call is "completed" whatever cut the reply after it (a repeat held back, the start of
    another call)."""
    if part.kind == "call" and not part.cut:
        return "completed"
    return "incomplete" if status == "failed" else status


# --- the endpoint -----------------------------------------------------------------------


class ResponsesAPI:
    """`POST /v1/responses` on a `ModelServer`, with its store of recent responses (`GET`
    and `DELETE /v1/responses/{id}`: `store.response`, `store.delete`)."""

    def __init__(self, server: ModelServer, store: ResponseStore | None = None):
        self.server = server
        self.store = store if store is not None else ResponseStore()

    async def create(
        self, body: ResponsesRequest, connection: Request
    ) -> Response | dict[str, Any]:
        server = self.server
        lora = server.check_model(body.model, adapters=True)
        tools = body.offered_tools()
        if body.tools:  # compiling schemas can take a while: off the event loop
            await run_in_threadpool(
                check_tool_schemas, [tool.for_chat() for tool in body.tools], "tools.{}.parameters"
            )
        earlier = []
        if body.previous_response_id is not None:
            earlier = self.store.conversation(body.previous_response_id)
        conversation = [*earlier, *body.items]
        if len(conversation) > MAX_INPUT_ITEMS:
            raise APIError(
                400,
                f"The conversation has {len(conversation)} items with the previous response's; "
                f"at most {MAX_INPUT_ITEMS} are read",
                param="input",
                code="invalid_value",
            )
        template_kwargs = server.template_kwargs(None)
        if body.reasoning is not None and body.reasoning.thinking is not None:
            template_kwargs["enable_thinking"] = body.reasoning.thinking
        params = server.settings.default_params.replace(**body.sampling_overrides())
        messages = template_messages(body.instructions, conversation, len(earlier))
        if not messages:  # reasoning items alone: no turn for the template to render
            raise APIError(
                400,
                "Invalid value for 'input': it holds no message to answer (only reasoning "
                "items); give some text or a message",
                param="input",
                code="invalid_value",
            )
        completion = await server.start_chat(
            messages,
            params,
            template_kwargs,
            tools=tools,
            forced_tool=body.forced_tool,
            parallel_tool_calls=body.parallel_tool_calls,
            id_prefix="resp",
            lora=lora,
        )
        answer_format = ResponsesFormat(
            body, conversation, self.store, params, server.tokenizer, server.settings.model_name
        )
        return await server.respond(completion, answer_format, connection, stream=body.stream)


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, for the generate task."""
    api = ResponsesAPI(server)
    routes = APIRouter(dependencies=access.serving("generate"))

    # A created response is read and deleted by its id (schemathesis follows these links).
    by_id = {"response_id": "$response.body#/id"}
    links = {
        "GetResponse": {"operationId": "get_response", "parameters": by_id},
        "DeleteResponse": {"operationId": "delete_response", "parameters": by_id},
    }

    @routes.post(
        "/v1/responses",
        **documented(
            ResponseObject,
            ResponsesRequest,
            {"input": "Hi"},
            events=ResponseStreamEvent,
            links=links,
        ),
    )
    async def create_response(request: Request) -> Response | dict[str, Any]:
        return await api.create(await read_body(request, ResponsesRequest), request)

    @routes.get(
        "/v1/responses/{response_id}",
        operation_id="get_response",
        **documented(ResponseObject, errors=(401, 404)),
    )
    async def get_response(response_id: str) -> dict[str, Any]:
        return api.store.response(response_id)

    @routes.delete(
        "/v1/responses/{response_id}",
        operation_id="delete_response",
        **documented(DeletedResponse, errors=(401, 404)),
    )
    async def delete_response(response_id: str) -> dict[str, Any]:
        api.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return routes
