"""OpenAI's model list: `GET /v1/models`, the model this server serves and its loaded LoRA
adapters (each a model of its own, `parent` the base, as vLLM lists them)."""

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
    base = server.settings.model_name
    adapters = [
        {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "qinfer",
            "root": server.engine.engine.adapters.get(name).path,
            "parent": base,
            "thinking": server.splits_reasoning,
        }
        for name in server.lora_names()
    ]
    return {
        "object": "list",
        "data": [
            {
                "id": base,
                "object": "model",
                "created": server.created,
                "owned_by": "qinfer",
                # qinfer's own: whether the model thinks (Qwen3's <think> blocks),
                # so the chat page offers its thinking switch only then.
                "thinking": server.splits_reasoning,
            },
            *adapters,
        ],
    }
