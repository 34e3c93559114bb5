"""`POST /v1/inspect` (qinfer's own endpoint): a prompt's tokens, attention weights,
next-token probabilities and logit lens, as JSON (see docs/INSPECT.md).

The request is checked here (types) and by `qinfer.analysis.inspection.check_inspection` (what
depends on the model: layers, heads, the prompt's length), each refusal a 400 naming its
field. The forward runs in the engine's step thread between two steps
(`AsyncEngine.run_with_model`), never beside a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from qinfer.analysis.inspection import Inspection, TopTokens, inspect_tokens
from qinfer.core.model_config import ModelConfig
from qinfer.server.openai.chat import ChatMessage
from qinfer.server.openapi import documented
from qinfer.server.routing import Access, read_body
from qinfer.server.schema import Answer, StrictModel
from qinfer.text.prompts import encode_prompt
from qinfer.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer

#: Digits kept of each probability and weight: enough to sum to 1 within 1e-5, and a
#: third of the bytes of a full float.
DIGITS = 6


class InspectRequest(StrictModel):
    """The body of `POST /v1/inspect`.

    prompt: text (encoded as-is, no chat template), token ids, or chat messages (rendered
        with the chat template, ending where the reply begins).
    layers: whose attention weights to return; heads: which query heads (default all).
    top_k: candidates listed per position, for the next token and each layer's lens.
    """

    model: str | None = None
    prompt: str | list[int] | list[ChatMessage]
    layers: list[int] = Field(default_factory=lambda: [0])
    heads: list[int] | None = None
    top_k: int = 5
    chat_template_kwargs: dict[str, Any] | None = None

    def prompt_for_encoding(self) -> str | list[int] | list[dict[str, Any]]:
        """The prompt as `encode_prompt` takes it (messages as the chat template reads them)."""
        if (
            isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], ChatMessage)
        ):
            return [message.for_template(i) for i, message in enumerate(self.prompt)]
        return self.prompt


class InspectedToken(Answer):
    id: int
    text: str


class Candidate(InspectedToken):
    prob: float


class LayerAttention(Answer):
    layer: int
    heads: list[int]
    # [head][query][key]: row i is how token i spreads its attention over 0..i
    weights: list[list[list[float]]]


class InspectedPrompt(Answer):
    """`POST /v1/inspect` (docs/INSPECT.md): the prompt's tokens, the asked layers'
    attention, the top candidates for the next token at each position, and each layer's
    (logit lens: [layer][position][candidate])."""

    object: Literal["inspection"]
    model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tokens: list[InspectedToken]
    attention: list[LayerAttention]
    next_tokens: list[list[Candidate]]
    logit_lens: list[list[list[Candidate]]]


def encode_inspected_prompt(
    tokenizer: Tokenizer,
    body: InspectRequest,
    config: ModelConfig,
    template_kwargs: Mapping[str, Any],
) -> list[int]:
    """The token ids of `body.prompt` (a RequestError names ids outside the vocabulary)."""
    return encode_prompt(
        tokenizer, body.prompt_for_encoding(), vocab_size=config.vocab_size, **template_kwargs
    )


def inspection_json(
    inspection: Inspection, tokenizer: Tokenizer, model_name: str, config: ModelConfig
) -> dict[str, Any]:
    """The response body (documented in docs/INSPECT.md)."""

    def candidates(top: TopTokens) -> list[list[dict[str, Any]]]:
        return [
            [
                {"id": token_id, "text": tokenizer.decode([token_id]), "prob": round(prob, DIGITS)}
                for token_id, prob in zip(ids, probs, strict=True)
            ]
            for ids, probs in zip(top.ids.tolist(), top.probs.tolist(), strict=True)
        ]

    return {
        "object": "inspection",
        "model": model_name,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "tokens": [
            {"id": token_id, "text": tokenizer.decode([token_id])}
            for token_id in inspection.token_ids
        ],
        "attention": [
            {
                "layer": layer,
                "heads": inspection.heads,
                # [head][query][key]: row i is how token i spreads its attention over 0..i
                "weights": weights.round(decimals=DIGITS).tolist(),
            }
            for layer, weights in inspection.attention.items()
        ],
        "next_tokens": candidates(inspection.next_tokens),
        "logit_lens": [candidates(top) for top in inspection.logit_lens],
    }


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/inspect (any task)."""
    routes = APIRouter()

    @routes.post(
        "/v1/inspect",
        dependencies=access.authorized,
        **documented(InspectedPrompt, InspectRequest, {"prompt": "The capital of France is"}),
    )
    async def inspect(request: Request) -> dict[str, Any]:
        return await inspected(server, await read_body(request, InspectRequest))

    return routes


async def inspected(server: ModelServer, body: InspectRequest) -> dict[str, Any]:
    """The inspection `body` asks for: the prompt encoded and the JSON built off the
    event loop; only the forward runs in the engine's step thread (between two steps:
    never beside one), where it pauses the engine's requests."""
    server.check_model(body.model)
    template_kwargs = server.template_kwargs(body.chat_template_kwargs)
    config = server.engine.model_config
    ids = await run_in_threadpool(
        encode_inspected_prompt, server.tokenizer, body, config, template_kwargs
    )
    inspection = await server.engine.run_with_model(
        lambda model: inspect_tokens(model, ids, body.layers, body.heads, body.top_k)
    )
    return await run_in_threadpool(
        inspection_json, inspection, server.tokenizer, server.settings.model_name, config
    )
