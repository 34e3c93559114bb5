"""The request handling every API shares: `ModelServer` (engine, tokenizer, settings,
metrics; the model check, the chat template's arguments, a conversation encoded and
started with its tools, the answer as JSON or as a stream) and the `ServerSettings` it
serves under. Each API (`openai/`, `anthropic/`, `vllm/`, `inspection`) is a module of
routes and handlers over a ModelServer; `app.create_app` includes them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from qinfer.engine import AsyncEngine
from qinfer.request.pooling import PoolingParams
from qinfer.request.sampling import SamplingParams
from qinfer.request.tool_calls import ToolUse, tool_call_format, tool_call_grammar, tool_prompt
from qinfer.server.choices import Completion, Delta
from qinfer.server.errors import APIError
from qinfer.server.images import ImageReader
from qinfer.server.metrics import ServerMetrics
from qinfer.server.streaming import EventStreamResponse
from qinfer.text.prompts import PromptParts, encode_prompt_parts
from qinfer.text.reasoning import THINK_CLOSE, splits_reasoning
from qinfer.text.tokenizer import Tokenizer


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
        conversation's defaults, under their own fields (`qinfer.request.chat_defaults`, as
        `qinfer chat` does).
    pooling: how `/v1/embeddings` pools a prompt (a request's `dimensions` overrides
        its dimensions); by default Qwen3-Embedding's: last token, normalised.
    task: "generate" (every route), "embed" (embeddings) or "rerank" (rerank and score);
        see the module doc.
    allowed_media_domains: the hosts whose http(s) image URLs the server fetches (exact
        names); none by default: only inline images (data URLs, base64) are read.
    allow_runtime_lora: serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
        (`qinfer.server.vllm.lora`); off by default, as vLLM's
        VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    reasoning_budget: the most tokens a thinking model's `<think>` block takes in a chat
        request that sets no budget of its own (`--reasoning-budget`; None: unbounded);
        then `</think>` is forced and the answer follows (`SamplingParams.thinking_budget`).
    """

    model_name: str
    api_key: str | Sequence[str] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    default_params: SamplingParams = field(default_factory=SamplingParams)
    allowed_origins: Sequence[str] = ()
    checkpoint_sampling: Mapping[str, Any] = field(default_factory=dict)
    pooling: PoolingParams = field(default_factory=PoolingParams)
    task: str = "generate"
    allowed_media_domains: Sequence[str] = ()
    allow_runtime_lora: bool = False
    reasoning_budget: int | None = None

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
    """How one API shows a finished completion and streams one (`openai.chat.ChatFormat`,
    `openai.completions.TextFormat`, the Responses and Messages APIs' own)."""

    async def whole(self, completion: Completion) -> dict[str, Any]: ...

    def events(
        self, completion: Completion, first: Delta, rest: AsyncIterator[Delta], include_usage: bool
    ) -> AsyncIterator[str]: ...


class ModelServer:
    """The request handling behind the routes: engine, tokenizer, settings, metrics."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.metrics = ServerMetrics(engine.stats, settings.model_name)
        self.created = int(time.time())
        self.splits_reasoning = splits_reasoning(tokenizer)
        self.tool_format = tool_call_format(tokenizer)
        self.images = ImageReader(settings.allowed_media_domains)

    @property
    def accepts_images(self) -> bool:
        """Whether the model reads images (a vision-language checkpoint with its tower)."""
        return self.engine.engine.vision.encoder is not None

    def lora_names(self) -> list[str]:
        """The LoRA adapters loaded now, each a model a request may name."""
        adapters = self.engine.engine.adapters
        return [] if adapters is None else adapters.names()

    def check_model(self, name: str | None, adapters: bool = False) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model, or no name);
        adapters: the route generates, so an adapter's name is a model it serves (vLLM's
        served LoRA names). Any other name is a 404."""
        if name is None or name == self.settings.model_name:
            return None
        if name in self.lora_names():
            if adapters:
                return name
            raise APIError(
                400,
                f"The model '{name}' is a LoRA adapter; this route serves the base model "
                f"'{self.settings.model_name}' only",
                param="model",
                code="invalid_value",
            )
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves "
            f"'{self.settings.model_name}'" + "".join(f", '{lora}'" for lora in self.lora_names()),
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

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any],
        tools: list[dict[str, Any]] | None = None,
        prefill: str = "",
    ) -> PromptParts:
        """The prompt ids and images of a conversation (messages as the template reads
        them, image parts the engine's) that offers `tools` (OpenAI function tools, None:
        none), in the family's tool format; prefill: text the reply starts with (after the
        template's opening of it)."""
        messages, tool_kwargs = tool_prompt(self.tool_format, messages, tools)
        # Templates and tokenizers can take milliseconds on long chats: off the event loop.
        parts = await run_in_threadpool(
            encode_prompt_parts, self.tokenizer, messages, **template_kwargs, **tool_kwargs
        )
        if prefill:
            ids = await run_in_threadpool(self.tokenizer.encode, prefill, False)
            parts = dataclasses.replace(parts, token_ids=parts.token_ids + ids)
        return parts

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any],
        tools: list[dict[str, Any]] | None = None,
        prefill: str = "",
    ) -> PromptParts:
        """A conversation's prompt as a chat request sends it to the engine: its image
        parts read (a bad one is a 400 naming it), then `encode_chat`."""
        messages = await self.images.read_images(messages, self.accepts_images)
        return await self.encode_chat(messages, template_kwargs, tools, prefill)

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
        lora: str | None = None,
    ) -> Completion:
        """The engine requests (not yet started) that answer a conversation: its prompt
        encoded, its `<think>` block split off for a thinking model, calls of `tools` parsed
        out of the reply and, with `forced_tool` ("required" or a tool's name), forced by a
        grammar in the model's own wrapping; prefill: text the reply continues (the
        Messages API's last assistant message); lora: the LoRA adapter the request's
        `model` named (`check_model`). The Responses and Messages APIs share it.
        Its prompt is `chat_prompt`'s, so a bad image is a 400 naming it before the engine
        sees the request."""
        parts = await self.chat_prompt(messages, template_kwargs, tools, prefill)
        if params.thinking_budget is None and self.settings.reasoning_budget is not None:
            params = params.replace(thinking_budget=self.settings.reasoning_budget)
        # With images the engine gets the parts: it expands each placeholder to its image's run.
        prompt = parts if parts.images else parts.token_ids
        names = tuple(tool["function"]["name"] for tool in tools or ())
        parameters = {t["function"]["name"]: t["function"].get("parameters") for t in tools or ()}
        tool_use = ToolUse(self.tool_format, names, forced_tool, parameters) if tools else None
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
            [prompt],
            params,
            n,
            id_prefix,
            self.splits_reasoning,
            tool_use,
            lora=lora,
            think_close=self.tokenizer.token_to_id(THINK_CLOSE) if self.splits_reasoning else None,
        )

    async def respond(
        self,
        completion: Completion,
        response_format: AnswerFormat,
        connection: Request,
        *,
        stream: bool,
        include_usage: bool = False,
    ) -> Response | dict[str, Any]:
        """A JSON answer (the dict, which the route validates as its answer type), or a
        stream of events once the first delta proves the request runs.

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
        return answer.result()  # the route's answer type validates it (`openapi.documented`)


async def wait_for_disconnect(connection: Request) -> None:
    """Return when the client closes the connection (its body must have been read)."""
    while (await connection.receive())["type"] != "http.disconnect":
        pass
