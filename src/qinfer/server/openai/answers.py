"""OpenAI's answers as models: the chat completion and its stream chunk, the text completion
and its chunk, the embeddings list and the model list.

The routes build their answers as dicts and declare these as their answer types
(`openapi.documented`), so FastAPI validates every JSON answer as one of them and the
document shows them: a key an answer holds that its model lacks is a 500 in the tests,
never a silent difference between the document and the wire. Fields an answer may leave
out have a default (absent from `required`); those it always sends have none.
"""

from __future__ import annotations

from typing import Literal

from qinfer.server.errors import ErrorBody
from qinfer.server.schema import Answer

#: Why a choice ended (null while a stream's choice runs): its end of text or a stop
#: sequence, its token budget, tool calls made, or the server stopped it.
FinishReason = Literal["stop", "length", "tool_calls", "abort"] | None


class CachedTokens(Answer):
    cached_tokens: int  # prompt tokens read from the prefix cache


class ReasoningTokens(Answer):
    reasoning_tokens: int  # generated inside <think>, its closing </think> included


class Usage(Answer):
    """Tokens a request took; the n choices of one prompt count its tokens once. A chat
    answer of a thinking model says how many of its tokens were reasoning."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens
    completion_tokens_details: ReasoningTokens | None = None


class TopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]  # the token's UTF-8 bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Answer):
    content: list[TokenLogprob]
    refusal: None


class FunctionCall(Answer):
    """A call's function: its name (once, in a stream) and its arguments as JSON text (a
    stream's fragment of them)."""

    name: str | None = None
    arguments: str


class ToolCall(Answer):
    """A tool call of a message; in a stream, `index` places a call's fragment, whose
    first carries its id, type and name."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantMessage(Answer):
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    reasoning_content: str | None  # a thinking model's reasoning, apart from content
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(Answer):
    """`POST /v1/chat/completions` without `stream`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Answer):
    """What a stream chunk adds to a choice's message: the role first, then text."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChunkChoice(Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(Answer):
    """One event of a chat completion's stream; `usage` is null but in the last chunk
    (no choices) when `stream_options.include_usage` asks for it, absent otherwise."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextLogprobs(Answer):
    """Parallel lists over a choice's tokens; an echoed prompt's first token has no
    logprob and no alternatives (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TextChoice(Answer):
    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason


class TextCompletion(Answer):
    """`POST /v1/completions`: the whole answer, or (with `stream`) one event of it,
    whose `usage` is as a chat chunk's."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class Embedding(Answer):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # "base64": little-endian float32 bytes


class PromptUsage(Answer):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Answer):
    """`POST /v1/embeddings`."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: PromptUsage


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    # qinfer's own: whether the model thinks (Qwen3's <think> blocks), so that the chat
    # page offers its thinking switch only then.
    thinking: bool
    # a LoRA adapter's card (vLLM's): its folder, and the base model it runs on
    root: str | None = None
    parent: str | None = None


class ModelList(Answer):
    """`GET /v1/models`: the model this server serves, then its LoRA adapters."""

    object: Literal["list"]
    data: list[ModelCard]


#: The data of a chat stream's event: a chunk, or the error that ended it (then "[DONE]").
ChatEvent = ChatCompletionChunk | ErrorBody
#: The data of a text completion stream's event.
TextEvent = TextCompletion | ErrorBody
