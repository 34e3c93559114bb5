"""What every API's routes share: the body read and validated, the API key, the task.

Each API is one module with a `router(server, access) -> APIRouter` over the one
`ModelServer` (`qinfer.server.app` includes them all): a new endpoint is its module's
route, or a new module and its line in `app.API_MODULES`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pydantic
from fastapi import Depends, Request
from pydantic import BaseModel

from qinfer.server.errors import APIError, from_validation_error

if TYPE_CHECKING:
    from qinfer.server.model_server import ServerSettings

#: Largest request body accepted (HTTP 413 above): generous for long prompts.
MAX_BODY_BYTES = 16 * 2**20

#: What each task serves, as its refusals name it (`ServerSettings.task`).
TASK_ROUTES = {
    "generate": "every route",
    "embed": "POST /v1/embeddings",
    "rerank": "POST /v1/rerank and /v1/score",
}


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated as `model`; 413 when it is larger than MAX_BODY_BYTES."""
    too_large = APIError(
        413, f"Request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():  # a chunked body has no length to check upfront
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as error:
        # Valid JSON when the failure is a field's: walk it to name that field exactly.
        parsed = None if error.errors()[0]["type"] == "json_invalid" else json.loads(body)
        raise from_validation_error(error, parsed) from None


class Access:
    """Who may call a route: `authorized` (the API key, when the server has any) and
    `serving(*tasks)` (the key, then the server's task among `tasks`), as route
    dependencies."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.authorized = [Depends(self.check_api_key)]

    def check_api_key(self, request: Request) -> None:
        settings = self.settings
        if settings.api_key is None:
            return
        # Anthropic's clients send the key as `x-api-key`, OpenAI's as a bearer token.
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        if not settings.accepts_key(key.strip()):
            raise APIError(
                401,
                "Missing or invalid API key (send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>')",
                code="invalid_api_key",
            )

    def serving(self, *tasks: str) -> list[Any]:
        """The dependencies of a route the `tasks` serve: the API key, then the task."""
        task = self.settings.task

        def check_task(request: Request) -> None:
            if task not in tasks:
                raise APIError(
                    404,
                    f"{request.url.path} is not served: this server runs the "
                    f"'{task}' task (qinfer serve --task), which serves {TASK_ROUTES[task]}",
                    code="unsupported_task",
                )

        return [*self.authorized, Depends(check_task)]
