"""OpenAI-shaped JSON errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause (bad JSON, a field of the wrong type or out of range, a
field qinfer cannot honour, an unknown model, a prompt longer than the context, a missing API key, a full queue) leaves
the server as one of these with its HTTP status. Nothing reaches the client as a
traceback, and the server keeps serving.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from qinfer.core.errors import EngineOverloadedError, QinferError, RequestError

log = logging.getLogger("qinfer.server")

#: The OpenAI `type` of each status the server returns.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "overloaded_error",
}


class ErrorFields(BaseModel):
    """What went wrong: the message, its OpenAI `type`, the field at fault, a code."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error the OpenAI-shaped routes answer (its schema is the one
    /openapi.json documents for their 4xx and 503)."""

    error: ErrorFields


class APIError(Exception):
    """A request the server refuses: its HTTP status and the OpenAI error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The JSON body: {"error": {"message", "type", "param", "code"}} (`ErrorBody`)."""
        error_type = ERROR_TYPES.get(self.status, "invalid_request_error")
        fields = ErrorFields(
            message=self.message, type=error_type, param=self.param, code=self.code
        )
        return ErrorBody(error=fields).model_dump()

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_validation_error(error: pydantic.ValidationError, body: Any) -> APIError:
    """A 400 naming the first field at fault, as `messages.0.content` (dotted path).

    body: the parsed request (None when it is not JSON), to tell the fields of the path
    from pydantic's names of union members (`stop.str`), which are not in it.
    """
    first = error.errors(include_url=False)[0]
    kind = first["type"]
    param = _field_path(first["loc"], body, kind == "missing")
    if kind == "json_invalid":
        return APIError(400, f"Request body is not valid JSON: {first['msg']}", code="invalid_json")
    if kind in ("model_type", "json_type"):
        return APIError(400, "Request body must be a JSON object", code="invalid_json")
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    # Our validators' own words, without pydantic's "Value error, " before them.
    reason = str(first["ctx"]["error"]) if kind == "value_error" else first["msg"]
    # A check across fields (a model validator) has no location: its message says it all.
    message = f"Invalid value for '{param}': {reason}" if param else reason
    return APIError(400, message, param=param, code=code)


def _field_path(loc: tuple, body: Any, missing: bool) -> str | None:
    """The dotted path of `loc` through `body`, or None for the body itself; missing: the
    last part of `loc` is a field the body lacks (else a union member's name)."""
    parts, node = [], body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif missing and isinstance(node, dict) and i == len(loc) - 1:
            node = None  # a missing field: still its name
        else:
            continue  # a union member's name or tag: not a place in the request
        parts.append(str(part))
    return ".".join(parts) or None


def error_from_exception(error: Exception) -> APIError:
    """The API error a failure becomes: bad input is the client's (4xx), the rest ours (500)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineOverloadedError):
        return APIError(503, str(error), code="overloaded")
    if isinstance(error, QinferError):
        # Raised by the text layer or the engine on input the protocol's own checks do
        # not see: a prompt longer than the context, a template that cannot render.
        param = error.param if isinstance(error, RequestError) else None
        return APIError(400, str(error), param=param, code="invalid_value")
    if isinstance(error, StarletteHTTPException):
        # Unknown routes (404) and wrong methods (405) from the router itself.
        message = (
            error.detail if isinstance(error.detail, str) else HTTPStatus(error.status_code).phrase
        )
        return APIError(error.status_code, message)
    # A bug of ours: the traceback goes to the server log, one line to the client.
    log.error("internal error", exc_info=error)
    return APIError(500, f"Internal server error: {type(error).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    """Turn every exception that escapes a route into an OpenAI-shaped JSON error."""

    async def handle(request: Request, error: Exception) -> JSONResponse:
        return error_from_exception(error).response()

    for kind in (APIError, QinferError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, handle)
