"""`POST /v1/rerank` (Jina's and Cohere's shape, as vLLM serves it) and `POST /v1/score`
(vLLM's), through the engine's scoring requests (`qinfer.request.scoring`).

    /v1/rerank {"model": "...", "query": "...", "documents": ["...", ...],
                "top_n": 2, "return_documents": true, "instruction": "..."}
            -> {"id": "rerank-...", "model": "...", "usage": {"prompt_tokens": n, "total_tokens": n},
                "results": [{"index": i, "relevance_score": s, "document": {"text": "..."}}]}
    /v1/score  {"model": "...", "text_1": "..." | ["..."], "text_2": "..." | ["...", ...]}
            -> {"id": "score-...", "object": "list", "created": t, "model": "...",
                "data": [{"index": i, "object": "score", "score": s}], "usage": {...}}

Every score is a reranker's P(yes) for (query, document) in Qwen3-Reranker's prompt
format, which the server writes (send plain texts, not pre-formatted ones);
`instruction` (qinfer's own field) sets its task line. Rerank results come best first,
the `top_n` best (0 or none: all). Score pairs text_1[i] with text_2[i], or one text_1
with every text_2.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from qinfer.core.errors import RequestError
from qinfer.request.scoring import reranker_params, reranker_prompt
from qinfer.server.errors import APIError
from qinfer.server.openapi import documented
from qinfer.server.prompt_runs import run_prompts
from qinfer.server.routing import Access, read_body
from qinfer.server.schema import Answer, StrictModel

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer

#: Most documents (or pairs) one request may score.
MAX_SCORED_DOCUMENTS = 1024


class RerankRequest(StrictModel):
    """The rerank request body (Jina's, Cohere's and vLLM's fields)."""

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1, max_length=MAX_SCORED_DOCUMENTS)
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    instruction: str | None = None


class ScoreRequest(StrictModel):
    """vLLM's score request body."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """(query, document) pairs: text_1[i] with text_2[i], or one text_1 with each text_2."""
        queries = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        documents = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not queries:
            raise APIError(400, "'text_1' is empty: give at least one text", param="text_1")
        if len(queries) == 1:
            queries = queries * len(documents)
        elif len(queries) != len(documents):
            raise APIError(
                400,
                f"'text_2' holds {len(documents)} texts for {len(queries)} in 'text_1': "
                "give as many, or one text_1",
                param="text_2",
            )
        return list(zip(queries, documents, strict=True))


class ScoreUsage(Answer):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0  # /v1/score's only


class Document(Answer):
    text: str


class RerankResult(Answer):
    index: int  # of the document in the request
    relevance_score: float
    document: Document | None = None  # absent when return_documents is false


class Reranking(Answer):
    """`POST /v1/rerank`: the results, best first."""

    id: str
    model: str
    usage: ScoreUsage
    results: list[RerankResult]


class Score(Answer):
    index: int
    object: Literal["score"]
    score: float


class Scores(Answer):
    """`POST /v1/score`: one score per pair, in the pairs' order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: ScoreUsage


class ScoresAPI:
    """The rerank and score routes' handling over a `ModelServer`."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        self.server.check_model(body.model)
        scores, tokens = await self._score(
            [(body.query, d) for d in body.documents], body.instruction, "documents"
        )
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        results = []
        for i in ranked:
            result = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": body.documents[i]}
            results.append(result)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.server.settings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        self.server.check_model(body.model)
        scores, tokens = await self._score(body.pairs(), body.instruction, "text_2")
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.server.settings.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    async def _score(
        self, pairs: list[tuple[str, str]], instruction: str | None, field: str
    ) -> tuple[list[float], int]:
        """The score of each (query, document) pair and the prompt tokens they took;
        `field` is the request field a refused pair is named by."""
        if not pairs:
            raise APIError(400, f"'{field}' is empty: give at least one text", param=field)
        if len(pairs) > MAX_SCORED_DOCUMENTS:
            raise APIError(
                400,
                f"'{field}' holds {len(pairs)} texts; at most {MAX_SCORED_DOCUMENTS} per request",
                param=field,
            )
        tokenizer = self.server.tokenizer
        try:
            params = reranker_params(tokenizer)
        except RequestError as error:
            raise APIError(400, str(error), param="model", code="invalid_value") from None
        # Tokenizing a thousand documents takes a while: off the event loop.
        prompts = await run_in_threadpool(
            lambda: [reranker_prompt(tokenizer, q, d, instruction) for q, d in pairs]
        )
        outputs = await run_prompts(self.server.engine, prompts, params, field)
        return [o.score for o in outputs], sum(o.num_prompt_tokens for o in outputs)


def router(server: ModelServer, access: Access) -> APIRouter:
    """POST /v1/rerank and /v1/score, for the generate and rerank tasks."""
    api = ScoresAPI(server)
    routes = APIRouter(dependencies=access.serving("generate", "rerank"))

    @routes.post(
        "/v1/rerank",
        **documented(
            Reranking,
            RerankRequest,
            {"query": "capital of France", "documents": ["Paris", "Rome"]},
        ),
    )
    async def rerank(request: Request) -> dict[str, Any]:
        return await api.rerank(await read_body(request, RerankRequest))

    @routes.post(
        "/v1/score",
        **documented(Scores, ScoreRequest, {"text_1": "capital of France", "text_2": "Paris"}),
    )
    async def score(request: Request) -> dict[str, Any]:
        return await api.score(await read_body(request, ScoreRequest))

    return routes
