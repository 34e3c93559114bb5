"""Scoring how well a document answers a query: Qwen3-Reranker's yes/no judgement.

A reranker is a plain causal LM asked, in a fixed chat, whether the document meets the
query; the score is the probability of "yes" against "no" at the prompt's last position:

    <|im_start|>system
    Judge whether the Document meets the requirements based on the Query and the Instruct
    provided. Note that the answer can only be "yes" or "no".<|im_end|>
    <|im_start|>user
    <Instruct>: {instruction}
    <Query>: {query}
    <Document>: {document}<|im_end|>
    <|im_start|>assistant
    <think>

    </think>

    score = softmax([logit("yes"), logit("no")])[0]

(the model card's format; its three parts are tokenized apart, as the card does). A
request made with `ScoreParams` runs its prompt through the engine like any other
(batched, chunked prefill, prefix cache kept: it needs only the last row) and, instead of
a token, gets this score from its last row's logits (`RequestOutput.score`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.core.errors import RequestError
from qinfer.text.tokenizer import Tokenizer

#: Qwen3-Reranker's default task, used when a request gives no instruction.
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class ScoreParams:
    """Score a prompt by P(yes) = softmax over the logits of two tokens at its last row."""

    yes_token_id: int
    no_token_id: int

    def score(self, logits: torch.Tensor) -> float:
        """The score of one row of logits (V,)."""
        pair = logits[[self.yes_token_id, self.no_token_id]].float()
        return torch.softmax(pair, dim=0)[0].item()


def reranker_params(tokenizer: Tokenizer) -> ScoreParams:
    """The yes/no tokens of a reranker's vocabulary, or a RequestError saying which is missing."""
    ids = {word: tokenizer.token_to_id(word) for word in ("yes", "no")}
    missing = [word for word, token_id in ids.items() if token_id is None]
    if missing:
        raise RequestError(
            f"this model cannot score: its vocabulary has no {' or '.join(map(repr, missing))} "
            "token (a reranker answers with one of them)"
        )
    return ScoreParams(ids["yes"], ids["no"])


def reranker_prompt(
    tokenizer: Tokenizer, query: str, document: str, instruction: str | None = None
) -> list[int]:
    """The prompt ids that ask whether `document` meets `query` (see the module doc)."""
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return [
        token_id
        for part in (_PREFIX, pair, _SUFFIX)
        for token_id in tokenizer.encode(part, add_special_tokens=False)
    ]
