"""The OpenAI-compatible HTTP server: a FastAPI app over the engine's async API.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, and qinfer's
own `POST /v1/inspect` (behind the API key when one is set), `GET /health`, `GET /metrics`,
and the web pages: the chat at `/`, the attention inspector at `/inspect` (plain files from
`server/static/`, which ask for the key once and send it to /v1 themselves).

Every request shares the one `AsyncEngine`, which batches them (the model runs in its own
thread); the event loop only parses, tokenizes (in a worker thread) and relays deltas.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qinfer.chat_defaults import chat_sampling_params
from qinfer.checkpoint import resolve_model
from qinfer.engine import AsyncEngine
from qinfer.inspection import inspect_tokens
from qinfer.prompts import encode_prompt
from qinfer.reasoning import prompt_opened_think, splits_reasoning
from qinfer.sampling import SamplingParams, checkpoint_sampling
from qinfer.server.completions import Completion
from qinfer.server.errors import APIError, from_validation_error, install_error_handlers
from qinfer.server.inspection import (
    InspectRequest,
    encode_inspected_prompt,
    inspection_json,
)
from qinfer.server.lifecycle import Server
from qinfer.server.metrics import ServerMetrics
from qinfer.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from qinfer.server.responses import ChatFormat, ResponseFormat, TextFormat
from qinfer.server.streaming import EventStreamResponse
from qinfer.startup import LoadAnnouncer, display_name
from qinfer.tokenizer import Tokenizer, load_tokenizer
from qinfer.tool_calls import (
    ToolUse,
    check_tool_schemas,
    tool_call_format,
    tool_call_grammar,
    tool_prompt,
)

#: Largest request body accepted (HTTP 413 above): generous for long prompts.
MAX_BODY_BYTES = 16 * 2**20

#: The web pages' files (HTML, CSS, JavaScript: no build step, nothing fetched elsewhere).
STATIC_FILES = Path(__file__).parent / "static"


@dataclass
class ServerSettings:
    """What the server adds around the engine.

    model_name: the id clients name in `model` (and `GET /v1/models` lists).
    api_key: when set, /v1 routes need `Authorization: Bearer <api_key>`.
    chat_template_kwargs: server-wide defaults for the chat template (a request's own
        `chat_template_kwargs` override them key by key), e.g. {"enable_thinking": False}.
    default_params: sampling defaults that /v1/completions request fields override
        (typically from the checkpoint's generation_config.json).
    checkpoint_sampling: the sampling fields the checkpoint's generation_config.json sets
        (`sampling.checkpoint_sampling`); /v1/chat/completions requests get them over a
        conversation's defaults, under their own fields (`qinfer.chat_defaults`, as
        `qinfer chat` does).
    """

    model_name: str
    api_key: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    default_params: SamplingParams = field(default_factory=SamplingParams)
    checkpoint_sampling: Mapping[str, Any] = field(default_factory=dict)


class ModelServer:
    """The request handling behind the routes: engine, tokenizer, settings, metrics."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.metrics = ServerMetrics(engine.stats)
        self.created = int(time.time())
        self.splits_reasoning = splits_reasoning(tokenizer)
        self.tool_format = tool_call_format(tokenizer)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.settings.model_name}'",
                param="model",
                code="model_not_found",
            )

    def template_kwargs(self, requested: Mapping[str, Any] | None) -> dict[str, Any]:
        """The chat template's keyword arguments: the server's, overridden key by key by
        the request's `chat_template_kwargs`."""
        return {**self.settings.chat_template_kwargs, **(requested or {})}

    def sampling_params(self, body: GenerationRequest) -> SamplingParams:
        return self.settings.default_params.replace(**body.sampling_overrides())

    async def chat(self, body: ChatCompletionRequest, connection: Request) -> Response:
        self.check_model(body.model)
        params = chat_sampling_params(
            self.settings.checkpoint_sampling, **body.sampling_overrides()
        )
        template_kwargs = self.template_kwargs(body.chat_template_kwargs)
        if body.tools:  # compiling schemas can take a while: off the event loop
            await run_in_threadpool(
                check_tool_schemas, [tool.model_dump(exclude_none=True) for tool in body.tools]
            )
        tools = body.offered_tools()
        messages, tool_kwargs = tool_prompt(
            self.tool_format, [message.for_template() for message in body.messages], tools
        )
        # Templates and tokenizers can take milliseconds on long chats: off the event loop.
        prompt_ids = await run_in_threadpool(
            encode_prompt, self.tokenizer, messages, **template_kwargs, **tool_kwargs
        )
        names = tuple(tool["function"]["name"] for tool in tools or ())
        tool_use = ToolUse(self.tool_format, names, body.forced_tool) if tools else None
        if tools and body.forced_tool is not None:
            # The call is forced by a grammar in the model's own wrapping. A named tool
            # is one call; "required" may make several unless parallel_tool_calls is false.
            callable_tools = [
                t for t in tools if body.forced_tool in ("required", t["function"]["name"])
            ]
            parallel = body.forced_tool == "required" and body.parallel_tool_calls is not False
            params = params.replace(
                grammar=tool_call_grammar(
                    self.tool_format, callable_tools, self.tokenizer, parallel
                )
            )
        reasoning = None
        if self.splits_reasoning:
            reasoning = [prompt_opened_think(self.tokenizer.decode(prompt_ids))]
        completion = Completion(
            self.engine,
            self.metrics,
            [prompt_ids],
            params,
            body.n,
            "chatcmpl",
            reasoning,
            tool_use,
        )
        return await self.respond(
            completion, ChatFormat(self.tokenizer, self.settings.model_name), body, connection
        )

    async def complete(self, body: CompletionRequest, connection: Request) -> Response:
        self.check_model(body.model)
        params = self.sampling_params(body)
        prompts = [
            await run_in_threadpool(encode_prompt, self.tokenizer, prompt)
            for prompt in body.prompts
        ]
        completion = Completion(self.engine, self.metrics, prompts, params, body.n, "cmpl")
        return await self.respond(
            completion, TextFormat(self.tokenizer, self.settings.model_name), body, connection
        )

    async def respond(
        self,
        completion: Completion,
        response_format: ResponseFormat,
        body: GenerationRequest,
        connection: Request,
    ) -> Response:
        """A JSON answer, or a stream of events once the first delta proves the request runs.

        Waiting for the first delta lets an engine refusal (overloaded, prompt too long)
        still answer with its own status rather than inside a 200 stream. A client that
        leaves before its JSON answer is ready has its requests aborted, as a stream does.
        """
        if body.stream:
            deltas = completion.deltas()
            first = await anext(deltas)
            return EventStreamResponse(
                response_format.events(completion, first, deltas, body.include_usage)
            )
        answers = asyncio.ensure_future(completion.collect())
        client_left = asyncio.ensure_future(wait_for_disconnect(connection))
        try:
            await asyncio.wait({answers, client_left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            client_left.cancel()
            if not answers.done():
                answers.cancel()  # closes the deltas, which aborts the engine requests
        if answers.cancelled():
            # 499 (nginx's "client closed request"): logged, never read by anyone.
            return Response(status_code=499)
        return JSONResponse(response_format.response(completion, answers.result()))

    async def inspect(self, body: InspectRequest) -> dict[str, Any]:
        """The inspection `body` asks for: the prompt encoded and the JSON built off the
        event loop; only the forward runs in the engine's step thread (between two steps:
        never beside one), where it pauses the engine's requests."""
        self.check_model(body.model)
        template_kwargs = self.template_kwargs(body.chat_template_kwargs)
        config = self.engine.engine.runner.model.config
        ids = await run_in_threadpool(
            encode_inspected_prompt, self.tokenizer, body, config, template_kwargs
        )
        inspection = await self.engine.run_with_model(
            lambda model: inspect_tokens(model, ids, body.layers, body.heads, body.top_k)
        )
        return await run_in_threadpool(
            inspection_json, inspection, self.tokenizer, self.settings.model_name, config
        )

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.settings.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "qinfer",
                }
            ],
        }


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


async def wait_for_disconnect(connection: Request) -> None:
    """Return when the client closes the connection (its body must have been read)."""
    while (await connection.receive())["type"] != "http.disconnect":
        pass


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
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip(), settings.api_key):
            raise APIError(
                401,
                "Missing or invalid API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
            )

    authorized = [Depends(check_api_key)]

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        return await server.chat(await read_body(request, ChatCompletionRequest), request)

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        return await server.complete(await read_body(request, CompletionRequest), request)

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
    app.add_middleware(ResponseCounter, server=server, routes=routes)
    return app


def served_name(path: Path) -> str:
    """The default model id of a checkpoint: its folder's name, or a GGUF file's stem."""
    return path.stem if path.suffix == ".gguf" else path.name


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    device: str | None = None,
    quantize: str | None = None,
    group_size: int = 32,
    tensor_parallel_size: int = 1,
    log_level: str = "info",
    **engine_args: Any,
) -> None:
    """Load `model` (None: the embedded SmolLM2) and serve it until interrupted.

    dtype, device, quantize, group_size: as for `qinfer.load_model`.
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
        tensor_parallel_size=tensor_parallel_size,
        **engine_args,
    )
    announcer.finished(engine.engine.runner.model)
    settings = ServerSettings(
        model_name=served_model_name or served_name(path),
        api_key=api_key,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        # As OpenAI does, a request without max_tokens may run to the end of the context.
        default_params=SamplingParams.from_generation_config(
            path, max_tokens=engine.engine.context_len
        ),
        checkpoint_sampling=checkpoint_sampling(path),
    )
    app = create_app(engine, tokenizer, settings)
    server = Server(app, engine, host, port, log_level)
    engine.on_failure = lambda error: setattr(server, "should_exit", True)
    if engine.failure is None:  # a worker may have died already
        server.run()
    if engine.failure is not None:
        raise engine.failure
