"""OpenAI's chat completions and completions, the model list, and vLLM's tokenize and
detokenize: the routes `ModelServer` answers itself (`qinfer.server.model_server`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from qinfer.server.model_server import ModelServer
from qinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from qinfer.server.routing import Access, read_body


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/chat/completions and /v1/completions (the generate task), GET /v1/models,
    POST /tokenize and /detokenize (any task)."""
    routes = APIRouter()
    generating, authorized = access.serving("generate"), access.authorized

    @routes.post("/v1/chat/completions", dependencies=generating)
    async def chat_completions(request: Request) -> Response:
        return await server.chat(await read_body(request, ChatCompletionRequest), request)

    @routes.post("/v1/completions", dependencies=generating)
    async def completions(request: Request) -> Response:
        return await server.complete(await read_body(request, CompletionRequest), request)

    @routes.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        return server.models()

    @routes.post("/tokenize", dependencies=authorized)
    async def tokenize(request: Request) -> dict[str, Any]:
        return await server.tokenize(await read_body(request, TokenizeRequest))

    @routes.post("/detokenize", dependencies=authorized)
    async def detokenize(request: Request) -> dict[str, Any]:
        return await server.detokenize(await read_body(request, DetokenizeRequest))

    return routes
