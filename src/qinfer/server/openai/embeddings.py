"""`POST /v1/embeddings`, in OpenAI's shape, through the engine's pooling requests.

    {"model": "...", "input": "text" | ["text", ...] | [ids] | [[ids], ...],
     "encoding_format": "float" | "base64", "dimensions": 256}
 -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
     "model": "...", "usage": {"prompt_tokens": n, "total_tokens": n}}

The pooling (last token, mean or first token; normalised or not) is the server's, chosen
by `qinfer serve --pooling` (`ServerSettings.pooling`); every input is one engine request
(`qinfer.request.pooling.PoolingParams`, run by `prompt_runs.run_prompts`). A "base64" embedding is its little-endian float32
bytes in base64, as OpenAI sends it.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field

from qinfer.core.errors import RequestError
from qinfer.server.errors import APIError
from qinfer.server.openai.answers import EmbeddingList
from qinfer.server.openapi import documented
from qinfer.server.prompt_runs import run_prompts
from qinfer.server.routing import Access, read_body
from qinfer.server.schema import StrictModel

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer

#: Most inputs one request may embed (OpenAI's own bound).
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(StrictModel):
    """OpenAI's embeddings request body (`user` is accepted and ignored)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The inputs as engine prompts: texts, or token-id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(item, int) for item in value):
            return [value]  # one prompt of token ids
        return list(value)


class EmbeddingsAPI:
    """The embeddings route's handling over a `ModelServer`."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server

    async def create(self, body: EmbeddingRequest) -> dict[str, Any]:
        server = self.server
        server.check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "'input' is empty: give at least one input", param="input")
        if len(prompts) > MAX_EMBEDDING_INPUTS:
            raise APIError(
                400,
                f"'input' holds {len(prompts)} inputs; at most {MAX_EMBEDDING_INPUTS} per request",
                param="input",
            )
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise APIError(400, f"'input.{i}' is empty", param=f"input.{i}")
        params = replace(server.settings.pooling, dimensions=body.dimensions)
        try:
            params.check_hidden_size(server.engine.model_config.hidden_size)
        except RequestError as error:
            raise APIError(400, str(error), param="dimensions", code="invalid_value") from None
        outputs = await run_prompts(server.engine, prompts, params, "input")
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encode(output.embedding.numpy(), body.encoding_format),
            }
            for i, output in enumerate(outputs)
        ]
        tokens = sum(output.num_prompt_tokens for output in outputs)
        return {
            "object": "list",
            "data": data,
            "model": server.settings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/embeddings, for the generate and embed tasks."""
    api = EmbeddingsAPI(server)
    routes = APIRouter(dependencies=access.serving("generate", "embed"))

    @routes.post(
        "/v1/embeddings",
        **documented(EmbeddingList, EmbeddingRequest, {"input": "The capital of France"}),
    )
    async def create_embeddings(request: Request) -> dict[str, Any]:
        return await api.create(await read_body(request, EmbeddingRequest))

    return routes
