"""vLLM's run-time LoRA routes: `POST /v1/load_lora_adapter` {lora_name, lora_path} and
`POST /v1/unload_lora_adapter` {lora_name}, served only with `--allow-runtime-lora`
(`ServerSettings.allow_runtime_lora`). A loaded adapter is a model requests name in
`model` (`ModelServer.check_model`) and `GET /v1/models` lists; loading and unloading
happen between two engine steps, so the requests running meanwhile go on. Refusals name
the adapter in one line: 400 for a bad adapter, 503 where it would be resident past
`--max-loras` while every resident one serves a request (else the least recently used is
evicted: `qinfer.lora.adapters`), 404 for unloading one that is not loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from qinfer.core.errors import AdapterError, AdapterSlotsBusyError
from qinfer.server.errors import APIError
from qinfer.server.openapi import documented
from qinfer.server.routing import Access, read_body
from qinfer.server.schema import StrictModel

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer


class LoadLoraRequest(StrictModel):
    """vLLM's `LoadLoRAAdapterRequest`: the name requests will give as `model`, and the
    adapter's folder on the server's disk."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(StrictModel):
    """vLLM's `UnloadLoRAAdapterRequest` (its lora_int_id is accepted and unused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def router(server: ModelServer, access: Access) -> APIRouter:
    """The two routes, with --allow-runtime-lora (generate task); none without."""
    routes = APIRouter()
    if not server.settings.allow_runtime_lora:
        return routes
    serving = access.serving("generate")

    @routes.post(
        "/v1/load_lora_adapter",
        dependencies=serving,
        response_class=PlainTextResponse,
        **documented(str, LoadLoraRequest, {"lora_name": "mine", "lora_path": "/adapters/mine"}),
    )
    async def load(request: Request) -> str:
        body = await read_body(request, LoadLoraRequest)
        if body.lora_name == server.settings.model_name:
            raise APIError(
                400,
                f"lora_name '{body.lora_name}' is the base model's name",
                param="lora_name",
                code="invalid_value",
            )
        try:
            await server.engine.load_lora(body.lora_name, body.lora_path)
        except AdapterSlotsBusyError:
            raise  # a 503: every resident adapter serves a request; another load may go
        except AdapterError as error:
            raise APIError(400, str(error), param="lora_path", code="invalid_value") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @routes.post(
        "/v1/unload_lora_adapter",
        dependencies=serving,
        response_class=PlainTextResponse,
        **documented(str, UnloadLoraRequest, {"lora_name": "mine"}),
    )
    async def unload(request: Request) -> str:
        body = await read_body(request, UnloadLoraRequest)
        if body.lora_name not in server.lora_names():
            raise APIError(
                404,
                f"The LoRA adapter '{body.lora_name}' is not loaded",
                param="lora_name",
                code="model_not_found",
            )
        try:
            await server.engine.unload_lora(body.lora_name)
        except AdapterError as error:
            raise APIError(400, str(error), param="lora_name", code="invalid_value") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return routes
