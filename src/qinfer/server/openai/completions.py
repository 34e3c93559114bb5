"""OpenAI's text completions: `POST /v1/completions`, its request body, its handling
(prompts encoded as given, or framed for fill-in-the-middle) and the `text_completion`
answer it gives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, ValidationInfo, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from qinfer.server.choices import Completion, Delta
from qinfer.server.errors import APIError
from qinfer.server.openai.answers import TextCompletion, TextEvent
from qinfer.server.openai.generation import (
    MAX_CHOICES,
    ChoicesFormat,
    GenerationRequest,
    json_logprob,
    sampling_params,
)
from qinfer.server.openapi import documented
from qinfer.server.routing import Access, read_body
from qinfer.text.fill_in_middle import fim_tokens
from qinfer.text.prompts import Prompt, encode_prompt

if TYPE_CHECKING:
    from qinfer.engine import TokenLogprob
    from qinfer.server.model_server import ModelServer


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`: one prompt, or a batch of them (one choice group each).

    echo: each choice's text starts with its prompt's; with `logprobs`, its logprobs
    start with the prompt tokens' (the first's null, as OpenAI's and vLLM's). max_tokens 0
    generates nothing: with echo and logprobs, the prompt's logprobs alone (what
    lm-eval's loglikelihood asks). suffix: the text after the completion (fill in the
    middle, for models with FIM tokens; see `qinfer.text.fill_in_middle`).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for text completions (chat runs to the end of the context).
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError(
                f"best_of {best_of} differs from n: qinfer returns every choice it samples "
                "and does not rank them; set n instead"
            )
        return best_of

    @model_validator(mode="after")
    def _prompts_not_empty(self):
        if not self.prompts:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """The list of prompts: a lone string or a lone list of ids is one prompt."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(token, int) for token in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def sampling_overrides(self) -> dict[str, Any]:
        fields = super().sampling_overrides()
        if self.echo and self.logprobs is not None:
            fields["prompt_logprobs"] = self.logprobs
        return fields


#: A body the route accepts, for the document (/docs' "Try it out" starts from it).
COMPLETION_EXAMPLE = {"prompt": "Once upon a time"}


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/completions (the generate task)."""
    routes = APIRouter()

    @routes.post(
        "/v1/completions",
        dependencies=access.serving("generate"),
        **documented(
            TextCompletion, CompletionRequest, COMPLETION_EXAMPLE, events=TextEvent, done=True
        ),
    )
    async def completions(request: Request) -> Response | dict[str, Any]:
        return await complete(server, await read_body(request, CompletionRequest), request)

    return routes


async def complete(
    server: ModelServer, body: CompletionRequest, connection: Request
) -> Response | dict[str, Any]:
    lora = server.check_model(body.model, adapters=True)
    params = sampling_params(server, body)
    prompts = await prompt_ids(server, body)
    echo = None
    if body.echo:  # the prompts as the client wrote them (ids decoded)
        echo = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in body.prompts]
    completion = Completion(
        server.engine, server.metrics, prompts, params, body.n, "cmpl", echo=echo, lora=lora
    )
    return await server.respond(
        completion,
        TextFormat(server.tokenizer, lora or server.settings.model_name),
        connection,
        stream=body.stream,
        include_usage=body.include_usage,
    )


async def prompt_ids(server: ModelServer, body: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids, as the engine gets them (framed for fill-in-the-middle
    when there is a `suffix`)."""
    framed = body.prompts if body.suffix is None else fill_in_middle(server, body)
    return [await run_in_threadpool(encode_prompt, server.tokenizer, prompt) for prompt in framed]


def fill_in_middle(server: ModelServer, body: CompletionRequest) -> list[str]:
    """The fill-in-the-middle prompts of a request with a `suffix`, or a 400 naming
    `suffix` when the model has no FIM tokens or a prompt is token ids."""
    tokens = fim_tokens(server.tokenizer)
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


class TextFormat(ChoicesFormat):
    """`text_completion`: plain `text` per choice."""

    object_name = chunk_object_name = "text_completion"

    def choice(self, delta: Delta, *, stream: bool) -> dict[str, Any]:
        return {
            "index": delta.index,
            "text": delta.content,
            "logprobs": self._logprobs(delta) if delta.logprobs else None,
            "finish_reason": delta.finish_reason,
        }

    def _logprobs(self, delta: Delta) -> dict[str, Any]:
        """Parallel lists: tokens, their logprobs, alternatives, character offsets."""
        tokens = [self.token_text(lp.token_id) for lp in delta.logprobs]
        offsets, offset = [], delta.text_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [
                None if lp.logprob is None else json_logprob(lp.logprob) for lp in delta.logprobs
            ],
            "top_logprobs": [self._alternatives(lp) for lp in delta.logprobs],
            "text_offset": offsets,
        }

    def _alternatives(self, logprob: TokenLogprob) -> dict[str, float] | None:
        """{token text: logprob}; ids that decode alike (stray bytes) keep the likeliest.
        None for an echoed prompt's first token, which nothing predicts."""
        if logprob.logprob is None:
            return None
        alternatives: dict[str, float] = {}
        for token_id, value in sorted(logprob.top_logprobs.items(), key=lambda item: -item[1]):
            alternatives.setdefault(self.token_text(token_id), json_logprob(value))
        return alternatives
