"""The JSON the server answers with: whole completions, stream chunks, logprobs.

Chat and text completions differ only in how a choice looks (`message` / `delta` with
`content`, `reasoning_content` and `tool_calls`, or `text`) and in their logprobs layout. Each is a
`ResponseFormat`; everything else (ids, usage, the order of stream events) is shared.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from qinfer.request.tool_calls import ToolCallDelta
from qinfer.server.completions import Completion, Delta
from qinfer.server.errors import error_from_exception
from qinfer.server.streaming import DONE_EVENT, sse_event
from qinfer.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from qinfer.engine import TokenLogprob


#: The logprob sent for a token the sampler could not pick (masked by a grammar, cut by
#: top-k or top-p): its -inf has no JSON spelling, so it goes out as vLLM sends it.
MIN_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (and NaN) become MIN_LOGPROB."""
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


class ResponseFormat:
    """How one kind of completion (chat or text) shows its choices."""

    object_name: str  # of a whole response
    chunk_object_name: str  # of a stream chunk

    def __init__(self, tokenizer: Tokenizer, model_name: str):
        self.tokenizer, self.model_name = tokenizer, model_name

    def choice(self, delta: Delta, *, stream: bool) -> dict[str, Any]:
        """One entry of `choices`: a whole answer, or one delta of a stream."""
        raise NotImplementedError

    def opening_chunks(self, completion: Completion) -> list[dict[str, Any]]:
        """Choices sent before any text (chat announces the assistant role)."""
        return []

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs name it."""
        return self.tokenizer.decode([token_id])

    def response(self, completion: Completion, answers: Sequence[Delta]) -> dict[str, Any]:
        """The whole (non-streaming) response."""
        return {
            **self._header(completion, self.object_name),
            "choices": [self.choice(answer, stream=False) for answer in answers],
            "usage": completion.usage(),
        }

    async def whole(self, completion: Completion) -> dict[str, Any]:
        """Run every choice to its end; the whole (non-streaming) response."""
        return self.response(completion, await completion.collect())

    async def events(
        self, completion: Completion, first: Delta, rest: AsyncIterator[Delta], include_usage: bool
    ) -> AsyncIterator[str]:
        """The server-sent events of a stream whose first delta is already known.

        An error after the stream started cannot change the HTTP status any more; it
        goes out as an `{"error": ...}` event before `[DONE]`.
        """
        usage_field = {"usage": None} if include_usage else {}
        try:
            for choice in self.opening_chunks(completion):
                yield sse_event(self._chunk(completion, [choice], usage_field))
            yield sse_event(self._chunk(completion, [self.choice(first, stream=True)], usage_field))
            async for delta in rest:
                yield sse_event(
                    self._chunk(completion, [self.choice(delta, stream=True)], usage_field)
                )
            if include_usage:
                yield sse_event(self._chunk(completion, [], {"usage": completion.usage()}))
        except Exception as error:
            yield sse_event(error_from_exception(error).body())
        finally:
            await rest.aclose()
        yield DONE_EVENT

    def _header(self, completion: Completion, object_name: str) -> dict[str, Any]:
        return {
            "id": completion.id,
            "object": object_name,
            "created": completion.created,
            "model": self.model_name,
        }

    def _chunk(
        self, completion: Completion, choices: list[dict[str, Any]], usage_field: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            **self._header(completion, self.chunk_object_name),
            "choices": choices,
            **usage_field,
        }


def openai_tool_call(call: ToolCallDelta, whole: bool) -> dict[str, Any]:
    """The `tool_calls` entry of a message (whole) or of a stream delta (its index, then
    its id and name once, then fragments of its arguments)."""
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.name is not None:
        function = {"name": call.name, **function}
    entry: dict[str, Any] = {} if whole else {"index": call.index}
    if call.id is not None:
        entry |= {"id": call.id, "type": "function"}
    return {**entry, "function": function}


class ChatFormat(ResponseFormat):
    """`chat.completion`: an assistant message with `content`, `reasoning_content` and
    `tool_calls` (in a stream: a call's index, id and name once, then its arguments)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, delta: Delta, *, stream: bool) -> dict[str, Any]:
        if stream:
            message = {"content": delta.content} if delta.content else {}
            if delta.reasoning:
                message["reasoning_content"] = delta.reasoning
            if delta.tool_calls:
                message["tool_calls"] = [
                    openai_tool_call(call, whole=False) for call in delta.tool_calls
                ]
        else:
            message = {
                "role": "assistant",
                # OpenAI's content is null when the reply is only tool calls.
                "content": delta.content or (None if delta.tool_calls else ""),
                "reasoning_content": delta.reasoning or None,
            }
            if delta.tool_calls:
                message["tool_calls"] = [
                    openai_tool_call(call, whole=True) for call in delta.tool_calls
                ]
        return {
            "index": delta.index,
            "delta" if stream else "message": message,
            "logprobs": self._logprobs(delta.logprobs) if delta.logprobs else None,
            "finish_reason": delta.finish_reason,
        }

    def opening_chunks(self, completion: Completion) -> list[dict[str, Any]]:
        return [
            {
                "index": choice.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for choice in completion.choices
        ]

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.token_text(token_id)
            return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode())}

        content = [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(tid, value) for tid, value in lp.top_logprobs.items()],
            }
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}


class TextFormat(ResponseFormat):
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
