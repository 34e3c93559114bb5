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

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qinfer.chat_defaults import chat_sampling_params
from qinfer.checkpoint import resolve_model
from qinfer.engine import AsyncEngine
from qinfer.inspection import inspect_tokens
from qinfer.pooling import PoolingParams
from qinfer.sampling import SamplingParams, checkpoint_sampling
from qinfer.server.anthropic_messages import AnthropicRoute, MessagesAPI
from qinfer.server.anthropic_messages_request import ConversationRequest, MessagesRequest
from qinfer.server.completions import Completion, Delta
from qinfer.server.embeddings import EmbeddingRequest, EmbeddingsAPI
from qinfer.server.errors import APIError, from_validation_error, install_error_handlers
from qinfer.server.inspection import (
    InspectRequest,
    encode_inspected_prompt,
    inspection_json,
)
from qinfer.server.lifecycle import Server
from qinfer.server.metrics import ServerMetrics
from qinfer.server.openai_responses import ResponsesAPI
from qinfer.server.openai_responses_request import ResponsesRequest
from qinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
)
from qinfer.server.responses import ChatFormat, TextFormat
from qinfer.server.scores import RerankRequest, ScoreRequest, ScoresAPI
from qinfer.server.streaming import EventStreamResponse
from qinfer.startup import LoadAnnouncer, display_name
from qinfer.text.fill_in_middle import fim_tokens
from qinfer.text.prompts import encode_prompt
from qinfer.text.reasoning import splits_reasoning
from qinfer.text.tokenizer import Tokenizer, load_tokenizer
from qinfer.text.tool_calls import (
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
    api_key: one key or several; when set, /v1 routes (and /tokenize, /detokenize) need
        `Authorization: Bearer <key>` with one of them (stored as a tuple; see `accepts_key`).
    allowed_origins: the origins whose web pages may call the API (CORS), "*" for any;
        none by default (browsers then refuse cross-origin calls).
    chat_template_kwargs: server-wide defaults for the chat template (a request's own
        `chat_template_kwargs` override them key by key), e.g. {"enable_thinking": False}.
    default_params: sampling defaults that /v1/completions request fields override
        (typically from the checkpoint's generation_config.json).
    checkpoint_sampling: the sampling fields the checkpoint's generation_config.json sets
        (`sampling.checkpoint_sampling`); /v1/chat/completions requests get them over a
        conversation's defaults, under their own fields (`qinfer.chat_defaults`, as
        `qinfer chat` does).
    pooling: how `/v1/embeddings` pools a prompt (a request's `dimensions` overrides
        its dimensions); by default Qwen3-Embedding's: last token, normalised.
    task: "generate" (every route), "embed" (embeddings) or "rerank" (rerank and score);
        see the module doc.
    """

    model_name: str
    api_key: str | Sequence[str] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    default_params: SamplingParams = field(default_factory=SamplingParams)
    allowed_origins: Sequence[str] = ()
    checkpoint_sampling: Mapping[str, Any] = field(default_factory=dict)
    pooling: PoolingParams = field(default_factory=PoolingParams)
    task: str = "generate"

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):
            self.api_key = (self.api_key,)
        elif self.api_key is not None:
            self.api_key = tuple(self.api_key) or None

    def accepts_key(self, key: str) -> bool:
        """True when `key` is one of the API keys, or when there are none."""
        if self.api_key is None:
            return True
        # Every key is compared, so the time taken does not tell which one nearly matched.
        matches = [secrets.compare_digest(key.encode(), known.encode()) for known in self.api_key]
        return any(matches)


class AnswerFormat(Protocol):
    """How one API shows a finished completion and streams one (`responses.ChatFormat`,
    the Responses and Messages APIs' own)."""

    async def whole(self, completion: Completion) -> dict[str, Any]: ...

    def events(
        self, completion: Completion, first: Delta, rest: AsyncIterator[Delta], include_usage: bool
    ) -> AsyncIterator[str]: ...


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

    def template_kwargs(
        self, requested: Mapping[str, Any] | None, thinking: bool | None = None
    ) -> dict[str, Any]:
        """The chat template's keyword arguments: the server's, then `enable_thinking`
        when a request says whether to think (`reasoning_effort`), then the request's
        own `chat_template_kwargs`, each overriding the last key by key."""
        if thinking and not self.splits_reasoning:
            raise APIError(
                400,
                "Invalid value for 'reasoning_effort': this model does not think "
                "(no <think> block); send 'none' or leave it out",
                param="reasoning_effort",
                code="invalid_value",
            )
        asked = {} if thinking is None else {"enable_thinking": thinking}
        return {**self.settings.chat_template_kwargs, **asked, **(requested or {})}

    def sampling_params(self, body: GenerationRequest, chat: bool = False) -> SamplingParams:
        """The request's sampling fields over the server's defaults: a chat completion's
        over the chat defaults (`qinfer.chat_defaults`, under the checkpoint's
        generation_config.json), a text completion's over `settings.default_params`."""
        # The tokenizer's vocabulary is known here: a biased id past it names logit_bias.
        bad = next((t for t in body.logit_bias or () if t >= self.tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"Invalid value for 'logit_bias': token id {bad} is outside the vocabulary "
                f"(0..{self.tokenizer.vocab_size - 1})",
                param="logit_bias",
                code="invalid_value",
            )
        if chat:
            return chat_sampling_params(
                self.settings.checkpoint_sampling, **body.sampling_overrides()
            )
        return self.settings.default_params.replace(**body.sampling_overrides())

    async def chat(self, body: ChatCompletionRequest, connection: Request) -> Response:
        self.check_model(body.model)
        if body.tools:  # compiling schemas can take a while: off the event loop
            await run_in_threadpool(
                check_tool_schemas, [tool.model_dump(exclude_none=True) for tool in body.tools]
            )
        completion = await self.start_chat(
            [message.for_template() for message in body.messages],
            self.sampling_params(body, chat=True),
            self.template_kwargs(body.chat_template_kwargs, body.thinking),
            tools=body.offered_tools(),
            forced_tool=body.forced_tool,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            n=body.n,
        )
        return await self.respond(
            completion,
            ChatFormat(self.tokenizer, self.settings.model_name),
            connection,
            stream=body.stream,
            include_usage=body.include_usage,
        )

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any],
        tools: list[dict[str, Any]] | None = None,
        prefill: str = "",
    ) -> list[int]:
        """The prompt ids of a conversation (messages as the template reads them) that
        offers `tools` (OpenAI function tools, None: none), in the family's tool format;
        prefill: text the reply starts with (after the template's opening of it)."""
        messages, tool_kwargs = tool_prompt(self.tool_format, messages, tools)
        # Templates and tokenizers can take milliseconds on long chats: off the event loop.
        ids = await run_in_threadpool(
            encode_prompt, self.tokenizer, messages, **template_kwargs, **tool_kwargs
        )
        if prefill:
            ids += await run_in_threadpool(self.tokenizer.encode, prefill, False)
        return ids

    async def start_chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        template_kwargs: Mapping[str, Any],
        *,
        tools: list[dict[str, Any]] | None = None,
        forced_tool: str | None = None,
        parallel_tool_calls: bool = True,
        n: int = 1,
        id_prefix: str = "chatcmpl",
        prefill: str = "",
    ) -> Completion:
        """The engine requests (not yet started) that answer a conversation: its prompt
        encoded, its `<think>` block split off for a thinking model, calls of `tools` parsed
        out of the reply and, with `forced_tool` ("required" or a tool's name), forced by a
        grammar in the model's own wrapping; prefill: text the reply continues (the
        Messages API's last assistant message). The Responses and Messages APIs share it."""
        prompt_ids = await self.encode_chat(messages, template_kwargs, tools, prefill)
        names = tuple(tool["function"]["name"] for tool in tools or ())
        tool_use = ToolUse(self.tool_format, names, forced_tool) if tools else None
        if tools and forced_tool is not None:
            # A named tool is one call; "required" may make several unless not parallel.
            callable_tools = [
                t for t in tools if forced_tool in ("required", t["function"]["name"])
            ]
            parallel = forced_tool == "required" and parallel_tool_calls
            params = params.replace(
                grammar=tool_call_grammar(
                    self.tool_format, callable_tools, self.tokenizer, parallel
                )
            )
        return Completion(
            self.engine,
            self.metrics,
            [prompt_ids],
            params,
            n,
            id_prefix,
            self.splits_reasoning,
            tool_use,
        )

    async def complete(self, body: CompletionRequest, connection: Request) -> Response:
        self.check_model(body.model)
        params = self.sampling_params(body)
        framed = body.prompts if body.suffix is None else self.fill_in_middle(body)
        prompts = [
            await run_in_threadpool(encode_prompt, self.tokenizer, prompt) for prompt in framed
        ]
        echo = None
        if body.echo:  # the prompts as the client wrote them (ids decoded)
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in body.prompts]
        completion = Completion(
            self.engine, self.metrics, prompts, params, body.n, "cmpl", echo=echo
        )
        return await self.respond(
            completion,
            TextFormat(self.tokenizer, self.settings.model_name),
            connection,
            stream=body.stream,
            include_usage=body.include_usage,
        )

    def fill_in_middle(self, body: CompletionRequest) -> list[str]:
        """The fill-in-the-middle prompts of a request with a `suffix`, or a 400 naming
        `suffix` when the model has no FIM tokens or a prompt is token ids."""
        tokens = fim_tokens(self.tokenizer)
        problem = None
        if tokens is None:
            problem = (
                "this model has no fill-in-the-middle tokens (<|fim_prefix|>, "
                "<|fim_suffix|>, <|fim_middle|> or <fim_prefix>, ...) in its vocabulary"
            )
        elif not all(isinstance(prompt, str) for prompt in body.prompts):
            problem = "a suffix needs text prompts, not token ids"
        if problem is not None:
            raise APIError(
                400, f"Invalid value for 'suffix': {problem}", param="suffix", code="invalid_value"
            )
        return [tokens.prompt(prompt, body.suffix) for prompt in body.prompts]

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize`: the ids of a prompt, or of a chat as a chat request sends it."""
        self.check_model(body.model)
        if body.prompt is not None:
            ids = await run_in_threadpool(
                self.tokenizer.encode, body.prompt, body.add_special_tokens
            )
        else:
            template_kwargs = self.template_kwargs(
                {
                    "add_generation_prompt": body.add_generation_prompt,
                    **(body.chat_template_kwargs or {}),
                }
            )
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()] or None
            messages = [message.for_template() for message in body.messages]
            ids = await self.encode_chat(messages, template_kwargs, tools)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.context_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's `/detokenize`: the text of token ids."""
        self.check_model(body.model)
        vocab = self.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"Invalid value for 'tokens.{bad}': token id {body.tokens[bad]} is outside "
                f"the vocabulary (0..{vocab - 1})",
                param=f"tokens.{bad}",
                code="invalid_value",
            )
        # A body may hold millions of ids: decoded off the event loop.
        return {"prompt": await run_in_threadpool(self.tokenizer.decode, body.tokens)}

    async def respond(
        self,
        completion: Completion,
        response_format: AnswerFormat,
        connection: Request,
        *,
        stream: bool,
        include_usage: bool = False,
    ) -> Response:
        """A JSON answer, or a stream of events once the first delta proves the request runs.

        Waiting for the first delta lets an engine refusal (overloaded, prompt too long)
        still answer with its own status rather than inside a 200 stream. A client that
        leaves before its JSON answer is ready has its requests aborted, as a stream does.
        """
        if stream:
            deltas = completion.deltas()
            first = await anext(deltas)
            return EventStreamResponse(
                response_format.events(completion, first, deltas, include_usage)
            )
        answer = asyncio.ensure_future(response_format.whole(completion))
        client_left = asyncio.ensure_future(wait_for_disconnect(connection))
        try:
            await asyncio.wait({answer, client_left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            client_left.cancel()
            if not answer.done():
                answer.cancel()  # closes the deltas, which aborts the engine requests
        if answer.cancelled():
            # 499 (nginx's "client closed request"): logged, never read by anyone.
            return Response(status_code=499)
        return JSONResponse(answer.result())

    async def inspect(self, body: InspectRequest) -> dict[str, Any]:
        """The inspection `body` asks for: the prompt encoded and the JSON built off the
        event loop; only the forward runs in the engine's step thread (between two steps:
        never beside one), where it pauses the engine's requests."""
        self.check_model(body.model)
        template_kwargs = self.template_kwargs(body.chat_template_kwargs)
        config = self.engine.model_config
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
                    # qinfer's own: whether the model thinks (Qwen3's <think> blocks),
                    # so the chat page offers its thinking switch only then.
                    "thinking": self.splits_reasoning,
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
