"""vLLM's `POST /v1/chat/completions/render` and `/v1/completions/render`: the token ids a
chat or text completion request would hand the engine, without running it.

Routers that place requests by their tokens (vllm-router, llm-d's scheduler) ask a replica
to render a request first. The bodies are the generation routes' own (validated the same
way, so a bad field is the same 400); the answers are vLLM's: one rendered prompt for a
chat, a list of them (one per prompt) for a text completion. Image parts count as their
placeholder tokens (the engine expands each to its image's run).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from qinfer.server.openai.chat import CHAT_EXAMPLE, ChatCompletionRequest
from qinfer.server.openai.completions import COMPLETION_EXAMPLE, CompletionRequest, prompt_ids
from qinfer.server.openapi import documented
from qinfer.server.routing import Access, read_body
from qinfer.server.schema import Answer

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer


#: What these routes refuse: the body, the API key, the model, the body's size (the
#: engine never runs, so never a full queue).
RENDER_ERRORS = (400, 401, 404, 413)


class RenderedPrompt(Answer):
    """One prompt as the engine would get it (vLLM's `GenerateRequest`'s fields qinfer
    has: the id a generation would carry, the prompt's token ids, the model)."""

    request_id: str
    token_ids: list[int]
    model: str


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/chat/completions/render and /v1/completions/render (the generate task)."""
    routes = APIRouter(dependencies=access.serving("generate"))

    @routes.post(
        "/v1/chat/completions/render",
        **documented(RenderedPrompt, ChatCompletionRequest, CHAT_EXAMPLE, errors=RENDER_ERRORS),
    )
    async def render_chat(request: Request) -> RenderedPrompt:
        body = await read_body(request, ChatCompletionRequest)
        server.check_model(body.model)
        template_kwargs = server.template_kwargs(body.chat_template_kwargs, body.thinking)
        parts = await server.chat_prompt(
            body.template_messages(), template_kwargs, body.offered_tools()
        )
        return rendered(server, "chatcmpl", parts.token_ids)

    @routes.post(
        "/v1/completions/render",
        **documented(
            list[RenderedPrompt], CompletionRequest, COMPLETION_EXAMPLE, errors=RENDER_ERRORS
        ),
    )
    async def render_completion(request: Request) -> list[RenderedPrompt]:
        body = await read_body(request, CompletionRequest)
        server.check_model(body.model)
        return [rendered(server, "cmpl", ids) for ids in await prompt_ids(server, body)]

    return routes


def rendered(server: ModelServer, id_prefix: str, token_ids: list[int]) -> RenderedPrompt:
    return RenderedPrompt(
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        token_ids=token_ids,
        model=server.settings.model_name,
    )
