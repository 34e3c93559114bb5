"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt's ids, or a chat's as a chat
request renders it (tools included), and the text of ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from qinfer.server.errors import APIError
from qinfer.server.images import accepted_refs
from qinfer.server.openai.chat import ChatMessage, ToolDefinition
from qinfer.server.openapi import documented
from qinfer.server.routing import Access, read_body
from qinfer.server.schema import MAX_TOOLS, Answer, StrictModel, TemplateKwargs

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer


#: What these routes refuse: the body, the API key, the model, the body's size (the
#: engine never runs, so never a full queue).
TEXT_ERRORS = (400, 401, 404, 413)


class TokenizeRequest(StrictModel):
    """vLLM's `POST /tokenize`: a `prompt` (encoded as a text completion encodes it), or
    chat `messages` (rendered as a chat request renders them, tools included)."""

    # The document says what `_prompt_or_messages` checks: one of the two, not both.
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
                {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # the prompt's BOS/EOS, as a text completion adds them
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    """vLLM's `POST /detokenize`: the text of `tokens`."""

    model: str | None = None
    tokens: list[int]


class Tokens(Answer):
    """`POST /tokenize`: the ids, how many, and the context they must fit."""

    tokens: list[int]
    count: int
    max_model_len: int


class Text(Answer):
    """`POST /detokenize`."""

    prompt: str


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /tokenize and /detokenize (any task)."""
    routes = APIRouter()

    @routes.post(
        "/tokenize",
        dependencies=access.authorized,
        **documented(Tokens, TokenizeRequest, {"prompt": "Hello"}, errors=TEXT_ERRORS),
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        return await token_ids(server, await read_body(request, TokenizeRequest))

    @routes.post(
        "/detokenize",
        dependencies=access.authorized,
        **documented(Text, DetokenizeRequest, {"tokens": [100, 101]}, errors=TEXT_ERRORS),
    )
    async def detokenize(request: Request) -> dict[str, Any]:
        return await text(server, await read_body(request, DetokenizeRequest))

    return routes


async def token_ids(server: ModelServer, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's `/tokenize`: the ids of a prompt, or of a chat as a chat request sends it."""
    server.check_model(body.model)
    if body.prompt is not None:
        ids = await run_in_threadpool(server.tokenizer.encode, body.prompt, body.add_special_tokens)
    else:
        template_kwargs = server.template_kwargs(
            {
                "add_generation_prompt": body.add_generation_prompt,
                **(body.chat_template_kwargs or {}),
            }
        )
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()] or None
        messages = [message.for_template(i) for i, message in enumerate(body.messages)]
        # an image counts as its placeholder here (decoding it to count its tokens is
        # the chat request's work), and only where the model takes images at all
        accepted_refs(messages, server.accepts_images)
        ids = (await server.encode_chat(messages, template_kwargs, tools)).token_ids
    return {"tokens": ids, "count": len(ids), "max_model_len": server.engine.context_len}


async def text(server: ModelServer, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's `/detokenize`: the text of token ids."""
    server.check_model(body.model)
    vocab = server.tokenizer.vocab_size
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
    return {"prompt": await run_in_threadpool(server.tokenizer.decode, body.tokens)}
