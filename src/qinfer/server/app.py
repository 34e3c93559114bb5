"""The OpenAI-compatible HTTP server: a FastAPI app over the engine's async API.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`
(`openai_responses`), `POST /v1/messages` and `/v1/messages/count_tokens`
(`anthropic_messages`), `POST /v1/embeddings` (`embeddings`), `POST /v1/rerank` and
`/v1/score` (`scores`), `GET /v1/models`, vLLM's `POST /tokenize` and `POST /detokenize`,
and qinfer's own `POST /v1/inspect` (all behind the API keys when there are any),
`GET /health`, `GET /metrics`, and the web pages: the chat at `/`, the attention inspector
at `/inspect` (plain files from `server/static/`, which ask for the key once and send it
to /v1 themselves).

Every request shares the one `AsyncEngine`, which batches them (the model runs in its own
thread); the event loop only parses, tokenizes (in a worker thread) and relays deltas.

The server's task (`qinfer serve --task`, `ServerSettings.task`) says which of them it
serves: "generate" every one, "embed" embeddings, "rerank" rerank and score (the others
answer 404 naming the task); by default the checkpoint's name chooses (`checkpoint_task`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qinfer.checkpoint import resolve_model
from qinfer.engine import AsyncEngine
from qinfer.pooling import PoolingParams
from qinfer.sampling import SamplingParams, checkpoint_sampling
from qinfer.server.anthropic_messages import AnthropicRoute, MessagesAPI
from qinfer.server.anthropic_messages_request import ConversationRequest, MessagesRequest
from qinfer.server.embeddings import EmbeddingRequest, EmbeddingsAPI
from qinfer.server.errors import APIError, from_validation_error, install_error_handlers
from qinfer.server.inspection import (
    InspectRequest,
)
from qinfer.server.lifecycle import Server
from qinfer.server.model_server import ModelServer, ServerSettings
from qinfer.server.openai_responses import ResponsesAPI
from qinfer.server.openai_responses_request import ResponsesRequest
from qinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from qinfer.server.scores import RerankRequest, ScoreRequest, ScoresAPI
from qinfer.startup import LoadAnnouncer, display_name
from qinfer.text.tokenizer import Tokenizer, load_tokenizer

#: Largest request body accepted (HTTP 413 above): generous for long prompts.
MAX_BODY_BYTES = 16 * 2**20

#: The web pages' files (HTML, CSS, JavaScript: no build step, nothing fetched elsewhere).
STATIC_FILES = Path(__file__).parent / "static"


class ResponseCounter:
    """ASGI middleware: counts answered requests by route and status for /metrics."""

    def __init__(self, app: ASGIApp, server: ModelServer, routes: frozenset[str]):
        self.app, self.server, self.routes = app, server, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # Unknown paths share one label, so that probing clients cannot grow the metrics.
        endpoint = scope["path"] if scope["path"] in self.routes else "other"

        async def send_and_count(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.server.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_and_count)


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


def create_app(engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine`; the app shuts the engine down when it stops."""
    server = ModelServer(engine, tokenizer, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="qinfer", lifespan=lifespan)
    install_error_handlers(app)

    def check_api_key(request: Request) -> None:
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

    authorized = [Depends(check_api_key)]

    def serving(*tasks: str) -> list[Any]:
        """The dependencies of a route the `tasks` serve: the API key, then the task."""

        def check_task(request: Request) -> None:
            if settings.task not in tasks:
                raise APIError(
                    404,
                    f"{request.url.path} is not served: this server runs the "
                    f"'{settings.task}' task (qinfer serve --task), which serves "
                    f"{TASK_ROUTES[settings.task]}",
                    code="unsupported_task",
                )

        return [*authorized, Depends(check_task)]

    generating = serving("generate")

    @app.post("/v1/chat/completions", dependencies=generating)
    async def chat_completions(request: Request) -> Response:
        return await server.chat(await read_body(request, ChatCompletionRequest), request)

    @app.post("/v1/completions", dependencies=generating)
    async def completions(request: Request) -> Response:
        return await server.complete(await read_body(request, CompletionRequest), request)

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(request: Request) -> dict[str, Any]:
        return await server.tokenize(await read_body(request, TokenizeRequest))

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(request: Request) -> dict[str, Any]:
        return await server.detokenize(await read_body(request, DetokenizeRequest))

    responses = ResponsesAPI(server)

    @app.post("/v1/responses", dependencies=generating)
    async def create_response(request: Request) -> Response:
        return await responses.create(await read_body(request, ResponsesRequest), request)

    @app.get("/v1/responses/{response_id}", dependencies=generating)
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.store.response(response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=generating)
    async def delete_response(response_id: str) -> dict[str, Any]:
        responses.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    messages = MessagesAPI(server)

    async def create_message(request: Request) -> Response:
        return await messages.create(await read_body(request, MessagesRequest), request)

    async def count_message_tokens(request: Request) -> dict[str, int]:
        return await messages.count_tokens(await read_body(request, ConversationRequest))

    # Anthropic's routes answer every failure, the API key's included, in its own shape.
    for path, endpoint in [
        ("/v1/messages", create_message),
        ("/v1/messages/count_tokens", count_message_tokens),
    ]:
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            dependencies=generating,
            route_class_override=AnthropicRoute,
        )

    embeddings = EmbeddingsAPI(server)

    @app.post("/v1/embeddings", dependencies=serving("generate", "embed"))
    async def create_embeddings(request: Request) -> dict[str, Any]:
        return await embeddings.create(await read_body(request, EmbeddingRequest))

    scores = ScoresAPI(server)

    @app.post("/v1/rerank", dependencies=serving("generate", "rerank"))
    async def rerank(request: Request) -> dict[str, Any]:
        return await scores.rerank(await read_body(request, RerankRequest))

    @app.post("/v1/score", dependencies=serving("generate", "rerank"))
    async def score(request: Request) -> dict[str, Any]:
        return await scores.score(await read_body(request, ScoreRequest))

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        return server.models()

    @app.post("/v1/inspect", dependencies=authorized)
    async def inspect(request: Request) -> dict[str, Any]:
        return await server.inspect(await read_body(request, InspectRequest))

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_FILES / "chat.html")

    @app.get("/inspect", include_in_schema=False)
    async def inspect_page() -> FileResponse:
        return FileResponse(STATIC_FILES / "inspect.html")

    app.mount("/static", StaticFiles(directory=STATIC_FILES), name="static")

    @app.get("/health")
    async def health() -> Response:
        if engine.failure is not None:  # a tensor-parallel worker died: the server is stopping
            return JSONResponse({"status": "error", "message": str(engine.failure)}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    routes = frozenset(route.path for route in app.routes)
    if settings.allowed_origins:
        # Credentials travel as an Authorization header, which "*" headers allow; cookies
        # are never used, so credentialed CORS stays off.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(ResponseCounter, server=server, routes=routes)
    return app


def served_name(path: Path) -> str:
    """The default model id of a checkpoint: its folder's name, or a GGUF file's stem."""
    return path.stem if path.suffix == ".gguf" else path.name


#: What each task serves besides /v1/models, /tokenize and /detokenize (for its 404s).
TASK_ROUTES = {
    "generate": "every route",
    "embed": "POST /v1/embeddings",
    "rerank": "POST /v1/rerank and /v1/score",
}


def checkpoint_task(path: Path) -> str:
    """The task a checkpoint is made for, by the words of its name (its folder's or file's,
    a hub snapshot's repository, config.json's `_name_or_path`): "rerank" for a reranker
    (Qwen3-Reranker-0.6B), "embed" for an embedding model (Qwen3-Embedding-0.6B), else
    "generate"."""
    names = [served_name(path)]
    if path.parent.name == "snapshots":  # the hub's cache: models--Qwen--Qwen3-Reranker-0.6B
        names.append(path.parent.parent.name)
    config = path / "config.json"
    if config.is_file():
        try:
            names.append(str(json.loads(config.read_text(encoding="utf-8")).get("_name_or_path")))
        except (OSError, ValueError, AttributeError):
            pass  # the loader reports a broken config.json
    words = set(re.split(r"[^a-z0-9]+", " ".join(names).lower()))
    if "reranker" in words:
        return "rerank"
    return "embed" if "embedding" in words else "generate"


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    served_model_name: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    device: str | None = None,
    quantize: str | None = None,
    group_size: int = 32,
    kv_cache_dtype: str | None = None,
    batch_invariant: bool = False,
    tensor_parallel_size: int = 1,
    log_level: str = "info",
    pooling: PoolingParams | None = None,
    task: str | None = None,
    **engine_args: Any,
) -> None:
    """Load `model` (None: the embedded SmolLM2) and serve it until interrupted.

    api_key: one key or several (see `ServerSettings`); allowed_origins: CORS origins.
    pooling: how `/v1/embeddings` pools (default: last token, normalised).
    task: "generate", "embed" or "rerank" (see the module doc; None: `checkpoint_task`).

    dtype, device, quantize, group_size, kv_cache_dtype, batch_invariant: as for
    `qinfer.load_model`.
    tensor_parallel_size: ranks the model is split over (`qinfer.LLM`'s); when one dies,
    `/health` answers 503, the server stops and this raises its `TensorParallelError`.
    engine_args: `qinfer.engine.EngineConfig` fields (max_num_seqs, max_model_len, ...).
    """
    path = resolve_model(model)
    announcer = LoadAnnouncer(display_name(model, path), path)
    announcer.started()
    tokenizer = load_tokenizer(path)
    engine = AsyncEngine(
        path,
        tokenizer,
        dtype=dtype,
        device=device,
        quantize=quantize,
        group_size=group_size,
        kv_cache_dtype=kv_cache_dtype,
        batch_invariant=batch_invariant,
        tensor_parallel_size=tensor_parallel_size,
        **engine_args,
    )
    announcer.finished(engine.engine.executor.model)
    settings = ServerSettings(
        model_name=served_model_name or served_name(path),
        api_key=api_key,
        allowed_origins=tuple(allowed_origins),
        pooling=pooling or PoolingParams(),
        task=task or checkpoint_task(path),
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        # As OpenAI does, a request without max_tokens may run to the end of the context.
        default_params=SamplingParams.from_generation_config(path, max_tokens=engine.context_len),
        checkpoint_sampling=checkpoint_sampling(path),
    )
    app = create_app(engine, tokenizer, settings)
    server = Server(app, engine, host, port, log_level)
    engine.on_failure = lambda error: setattr(server, "should_exit", True)
    if engine.failure is None:  # a worker may have died already
        server.run()
    if engine.failure is not None:
        raise engine.failure
