"""The API as a document: /openapi.json states each route's body, its answers and the
errors it gives, built from the models the route validates and answers with, so that it
cannot drift from the code; /docs and /redoc show it without a network.

The routes read their bodies themselves (`routing.read_body`: the size bounded before
parsing, one line naming the field at fault, unknown fields logged), so FastAPI never
sees their models: `documented(...)` gives a route's decorator the `openapi_extra` (the
body's schema), its `response_model` (the answer's model, every key declared, which
FastAPI validates each JSON answer as) and `responses` (its errors, and its stream's
events, each event's data a JSON string of the events' model by `contentSchema`), and
`install(app)` moves the bodies' and events' nested definitions into the document's
components, where their references point. The pages' scripts and styles are those the
`fastapi-offline` package ships (Swagger UI, ReDoc), served from `/docs-files`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, TypeAdapter

from qinfer.server.errors import ErrorBody

#: Where the document keeps a definition that a schema refers to.
REF_TEMPLATE = "#/components/schemas/{model}"
#: Swagger UI's and ReDoc's scripts and styles (the package's `static/` folder).
DOCS_FILES = Path(fastapi_offline.__file__).parent / "static"
DOCS_FILES_URL = "/docs-files"

#: What a stream's events carry (OpenAPI 3.1 reads a stream's schema as each event's): its
#: name, in the APIs that name them, and its data, a JSON object of the route's event model
#: (as JSON Schema's `contentSchema` says of a string), or OpenAI's closing "[DONE]".
EVENT_FIELDS = {"event": {"type": "string"}}
#: Why a route answers each error status (the statuses a route lists in `documented`).
ERROR_REASONS = {
    400: "A field of the wrong type, out of range or not supported, named in the message",
    401: "No API key, or not one of the server's (only when the server has keys)",
    404: "A model, response or route this server does not serve",
    413: "The body is larger than the server reads",
    503: "The engine's queue is full, or the engine stopped",
    529: "The engine's queue is full, or the engine stopped (Anthropic's 503)",
}
#: The errors a route with a JSON body gives: its body, the API key, the model or the
#: server's task, the body's size, the engine's queue.
BODY_ERRORS = (400, 401, 404, 413, 503)


def documented(
    answer: Any,
    body: type[BaseModel] | None = None,
    example: Mapping[str, Any] | None = None,
    *,
    errors: Iterable[int] = BODY_ERRORS,
    error_body: type[BaseModel] = ErrorBody,
    events: Any = None,
    done: bool = False,
    links: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keywords of a route's decorator that document it: `answer`, the type of its 200
    JSON, which FastAPI then validates the route's answer as (a dict's keys kept as they
    are: a key the type lacks, or a field of another type, is a 500, so the answer cannot
    drift from the document; a `Response` the route builds itself goes out unchecked);
    `body`, the model its JSON body is validated as, and `example`, a body it accepts
    (/docs' "Try it out" starts from it; tests/test_openapi.py sends it); `errors`, the
    statuses it refuses with (a body of `error_body`); `events`, the type of each event's
    data when a body with `stream: true` is answered with server-sent events, and `done`,
    whether the stream ends with OpenAI's "[DONE]" (data that is no JSON); `links`, the
    OpenAPI links from its answer to other operations."""
    success: dict[str, Any] = {"description": "The answer"}
    if events is not None:
        success["content"] = {"text/event-stream": {"schema": event_schema(events, done)}}
    if links:
        success["links"] = dict(links)
    responses: dict[int | str, Any] = {200: success}
    for status in errors:
        responses[status] = {"description": ERROR_REASONS[status], "model": error_body}
    keywords: dict[str, Any] = {
        "responses": responses,
        "response_model": answer,
        "response_model_exclude_unset": True,
    }
    if body is not None:
        schema = body.model_json_schema(ref_template=REF_TEMPLATE)
        media = {"schema": schema, "example": dict(example or {})}
        request_body = {"required": True, "content": {"application/json": media}}
        keywords["openapi_extra"] = {"requestBody": request_body}
    return keywords


def event_schema(events: Any, done: bool = False) -> dict[str, Any]:
    """The schema of one server-sent event whose data is JSON of type `events`, or "[DONE]"
    when `done` (its definitions under `$defs`, which `install` moves into the components;
    schemathesis reads each event's data by its `contentMediaType` and `contentSchema`)."""
    data = TypeAdapter(events).json_schema(ref_template=REF_TEMPLATE, mode="serialization")
    definitions = data.pop("$defs", {})
    data_field: dict[str, Any] = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": data,
    }
    if done:
        data_field = {"anyOf": [data_field, {"const": "[DONE]"}]}
    return {
        "type": "object",
        "properties": {**EVENT_FIELDS, "data": data_field},
        "required": ["data"],
        "$defs": definitions,
    }


def install(app: FastAPI) -> None:
    """The document with the bodies' definitions in its components, and its offline pages
    (`app` made with docs_url=None and redoc_url=None: FastAPI's own load from a CDN)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        document = generate()  # FastAPI's, made once and cached (so is this move)
        components = document.setdefault("components", {}).setdefault("schemas", {})
        for path in document["paths"].values():
            for operation in path.values():
                contents = [operation.get("requestBody", {}).get("content", {})]
                contents += [
                    answer.get("content", {}) for answer in operation["responses"].values()
                ]
                for media in (media for content in contents for media in content.values()):
                    _move_definitions(media.get("schema", {}), components)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
    app.mount(DOCS_FILES_URL, StaticFiles(directory=DOCS_FILES), name="docs-files")
    title, openapi_url = app.title, app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{title} API",
            swagger_js_url=f"{DOCS_FILES_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_FILES_URL}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_FILES_URL}/favicon.png",
            # Swagger UI would otherwise send the document to an online validator.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{title} API",
            redoc_js_url=f"{DOCS_FILES_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{DOCS_FILES_URL}/favicon.png",
            with_google_fonts=False,
        )


def _move_definitions(schema: dict[str, Any], components: dict[str, Any]) -> None:
    """Move a body's or an event's `$defs` into the document's components; two models of
    one name with different schemas would make a reference ambiguous (ValueError naming
    it)."""
    for name, definition in schema.pop("$defs", {}).items():
        if components.setdefault(name, definition) != definition:
            raise ValueError(f"two models are named {name!r}; rename one of them")
