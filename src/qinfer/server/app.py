"""The OpenAI-compatible HTTP server: a FastAPI app over the engine's async API.

Routes, each in its API's module: OpenAI's `POST /v1/chat/completions` (`openai.chat`),
`POST /v1/completions` (`openai.completions`), `GET /v1/models` (`openai.models`),
`POST /v1/responses` (`openai.responses`), `POST /v1/embeddings` (`openai.embeddings`);
Anthropic's `POST /v1/messages` and `/v1/messages/count_tokens` (`anthropic.messages`);
vLLM's `POST /tokenize` and `POST /detokenize` (`vllm.tokenize`), `POST /v1/rerank` and
`/v1/score` (`vllm.scores`), `POST /v1/chat/completions/render` and `/v1/completions/render`
(`vllm.render`); what routers ask of a replica, `GET /v1/loads`, `POST /flush_cache`,
`GET /server_info` and `/model_info` (`worker`); qinfer's own `POST /v1/inspect`
(`inspection`); all behind the API keys when there are any. This module adds `GET /health`,
`GET /metrics`, and the web pages: the chat at `/`, the attention inspector at `/inspect`
(plain files from `server/static/`, which ask for the key once and send it to /v1 themselves), and the API
as a document at `/openapi.json`, shown at `/docs` and `/redoc` (`qinfer.server.openapi`).

Each API module has its own `APIRouter` (`API_MODULES`, over `qinfer.server.routing`'s
body reading, API key and task checks) and its handling over the shared `ModelServer`
(`qinfer.server.model_server`); this module includes them, adds the pages, health and
metrics, and starts the server.

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
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qinfer.core.checkpoint import resolve_model
from qinfer.engine import AsyncEngine
from qinfer.engine.build import LoadConfig
from qinfer.model.announcer import LoadAnnouncer, display_name
from qinfer.request.pooling import PoolingParams
from qinfer.request.sampling import SamplingParams, checkpoint_sampling
from qinfer.server import inspection, openapi, worker
from qinfer.server.anthropic import messages
from qinfer.server.errors import install_error_handlers
from qinfer.server.lifecycle import Server
from qinfer.server.model_server import ModelServer, ServerSettings
from qinfer.server.openai import chat, completions, embeddings, models, responses
from qinfer.server.routing import Access
from qinfer.server.schema import Answer
from qinfer.server.vllm import lora, render, scores, tokenize
from qinfer.text.tokenizer import Tokenizer, load_tokenizer

#: The APIs, each a module whose `router(server, access)` holds its routes
#: (`qinfer.server.routing`), in the order the app matches and documents them.
API_MODULES = (
    chat,
    completions,
    models,
    tokenize,
    responses,
    messages,
    embeddings,
    scores,
    render,
    lora,
    worker,
    inspection,
)


class Health(Answer):
    """/health's answer: "ok", or (with a 503) "error" and why the engine failed."""

    status: Literal["ok", "error"]
    message: str | None = None


#: /metrics' media type: Prometheus' text format.
PROMETHEUS = "text/plain; version=0.0.4"

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


def create_app(engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine`; the app shuts the engine down when it stops."""
    server = ModelServer(engine, tokenizer, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    # FastAPI's own /docs and /redoc load their scripts from a CDN: openapi's are offline.
    app = FastAPI(title="qinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    openapi.install(app)
    access = Access(settings)
    routers = [api.router(server, access) for api in API_MODULES]
    for router in routers:
        app.include_router(router)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_FILES / "chat.html")

    @app.get("/inspect", include_in_schema=False)
    async def inspect_page() -> FileResponse:
        return FileResponse(STATIC_FILES / "inspect.html")

    app.mount("/static", StaticFiles(directory=STATIC_FILES), name="static")

    stopping = {"description": "A tensor-parallel worker died: the server is stopping"}

    @app.get(
        "/health", response_model_exclude_unset=True, responses={503: {**stopping, "model": Health}}
    )
    async def health(response: Response) -> Health:
        if engine.failure is not None:  # a tensor-parallel worker died: the server is stopping
            response.status_code = 503
            return Health(status="error", message=str(engine.failure))
        return Health(status="ok")

    metrics_text = {"description": "Prometheus' text format", "content": {PROMETHEUS: {}}}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: metrics_text})
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=PROMETHEUS)

    # every route's path: the app's own and its routers' (an included router is one entry)
    routes = frozenset(
        path
        for router in (app.router, *routers)
        for path in (getattr(route, "path", None) for route in router.routes)
        if path is not None
    )
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
    allowed_media_domains: Sequence[str] = (),
    served_model_name: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    load: LoadConfig | None = None,
    log_level: str = "info",
    pooling: PoolingParams | None = None,
    task: str | None = None,
    allow_runtime_lora: bool = False,
    reasoning_budget: int | None = None,
    **engine_args: Any,
) -> None:
    """Load `model` (None: the embedded SmolLM2) and serve it until interrupted.

    api_key: one key or several (see `ServerSettings`); allowed_origins: CORS origins;
    allowed_media_domains: the hosts whose image URLs are fetched (`ServerSettings`).
    pooling: how `/v1/embeddings` pools (default: last token, normalised).
    task: "generate", "embed" or "rerank" (see the module doc; None: `checkpoint_task`).
    allow_runtime_lora: serve vLLM's load/unload LoRA routes (`ServerSettings`); the
    adapters loaded at start are the engine keywords' lora_modules. reasoning_budget: the
    default cap of a chat's thinking tokens (`ServerSettings`).

    load: how the checkpoint loads (`qinfer.engine.build.LoadConfig`; its fields may be
    given as keywords instead); when a tensor-parallel rank dies, `/health` answers 503,
    the server stops and this raises its `TensorParallelError`. The other keywords:
    `qinfer.engine.EngineConfig` fields (max_num_seqs, max_model_len, ...).
    """
    path = resolve_model(model)
    announcer = LoadAnnouncer(display_name(model, path), path)
    announcer.started()
    tokenizer = load_tokenizer(path)
    engine = AsyncEngine(path, tokenizer, load=load, **engine_args)
    announcer.finished(engine.engine.executor.model)
    settings = ServerSettings(
        model_name=served_model_name or served_name(path),
        api_key=api_key,
        allowed_origins=tuple(allowed_origins),
        allowed_media_domains=tuple(allowed_media_domains),
        pooling=pooling or PoolingParams(),
        task=task or checkpoint_task(path),
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        # As OpenAI does, a request without max_tokens may run to the end of the context.
        default_params=SamplingParams.from_generation_config(path, max_tokens=engine.context_len),
        checkpoint_sampling=checkpoint_sampling(path),
        allow_runtime_lora=allow_runtime_lora,
        reasoning_budget=reasoning_budget,
    )
    app = create_app(engine, tokenizer, settings)
    server = Server(app, engine, host, port, log_level)
    engine.on_failure = lambda error: setattr(server, "should_exit", True)
    if engine.failure is None:  # a worker may have died already
        server.run()
    if engine.failure is not None:
        raise engine.failure
