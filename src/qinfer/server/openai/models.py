"""OpenAI's model list: `GET /v1/models`, the one model this server serves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

from qinfer.server.openai.answers import ModelList
from qinfer.server.openapi import documented
from qinfer.server.routing import Access

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer


def router(server: ModelServer, access: Access) -> APIRouter:
    """GET /v1/models (any task)."""
    routes = APIRouter()

    @routes.get(
        "/v1/models", dependencies=access.authorized, **documented(ModelList, errors=(401,))
    )
    async def models() -> dict[str, Any]:
        return model_list(server)

    return routes


def model_list(server: ModelServer) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": server.settings.model_name,
                "object": "model",
                "created": server.created,
                "owned_by": "qinfer",
                # qinfer's own: whether the model thinks (Qwen3's <think> blocks),
                # so the chat page offers its thinking switch only then.
                "thinking": server.splits_reasoning,
            }
        ],
    }
