"""What OpenAI's chat and text completions share: the request fields (`GenerationRequest`),
their sampling over the server's defaults (`sampling_params`), and the JSON they answer
with (`ChoicesFormat`: whole completions, stream chunks, logprobs).

The two differ only in how a choice looks (`message` / `delta` with `content`,
`reasoning_content` and `tool_calls`, or `text`: `chat.ChatFormat`,
`completions.TextFormat`) and in their logprobs layout; everything else (ids, usage, the
order of stream events) is shared.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, field_validator, model_validator

from qinfer.request.chat_defaults import chat_sampling_params
from qinfer.request.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, SamplingParams
from qinfer.server.choices import Completion, Delta
from qinfer.server.errors import APIError, error_from_exception
from qinfer.server.schema import MAX_CONSTRAINT_BYTES, MAX_TOP_K, StrictModel
from qinfer.server.streaming import DONE_EVENT, sse_event
from qinfer.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from qinfer.server.model_server import ModelServer

#: Most choices (`n`) one request may ask for: each one is a separate engine request.
MAX_CHOICES = 8
#: The request fields that constrain the output, and the SamplingParams field each sets.
CONSTRAINT_FIELDS = {
    "response_format": "json_schema",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationRequest(StrictModel):
    """The fields chat and text completions share: model, sampling, stopping, streaming,
    and vLLM's constraint fields (`extra_body` in the openai client): guided_json,
    guided_regex, guided_choice, guided_grammar, at most one of them."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K, description="0 = no top-k cut")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    # Choice j of n samples with seed + j; torch seeds are 64-bit, so keep clear of the top.
    seed: int | None = Field(None, ge=0, le=2**62)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and not acted on: they tag or route a request on OpenAI's side.
    user: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    guided_json: dict[str, Any] | None = None
    # Empty constraints mean nothing: refused here, so that the 400 names the field.
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None
    ) = None
    guided_grammar: str | None = Field(None, min_length=1)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_of_token_ids(cls, bias: dict[str, float] | None) -> dict[int, float] | None:
        """{"token id": bias} in JSON -> {id: bias}; ids past the vocabulary are checked
        by the server, which knows it."""
        if bias is None:
            return None
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"the bias of token {key} is {value}; biases lie in "
                    f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        return {int(key): value for key, value in bias.items()}

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_constraint_of_bounded_size(self):
        given = self.constraint_fields()
        if len(given) > 1:
            names = ", ".join(name for name in CONSTRAINT_FIELDS if hasattr(self, name))
            raise ValueError(f"give at most one of {names}; got {' and '.join(given)}")
        for name, value in given.items():
            size = len(value.encode() if isinstance(value, str) else json.dumps(value).encode())
            if size > MAX_CONSTRAINT_BYTES:
                raise ValueError(
                    f"{name} is {size} bytes; constraints of at most "
                    f"{MAX_CONSTRAINT_BYTES} bytes are compiled"
                )
        return self

    def constraint_fields(self) -> dict[str, Any]:
        """{request field: value} of the output constraints this request sets."""
        values = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        return {name: value for name, value in values.items() if value is not None}

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_overrides(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (None = keep the server's default)."""
        fields = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.token_budget,
            seed=self.seed,
            stop=self.stop_strings or None,
            logprobs=self.top_logprobs_count,
            logit_bias=self.logit_bias,
            **self.constraint(),
        )
        return {name: value for name, value in fields.items() if value is not None}

    def constraint(self) -> dict[str, Any]:
        """The SamplingParams constraint field (json_schema, regex, choice, grammar) this
        request sets, if any."""
        return {CONSTRAINT_FIELDS[name]: value for name, value in self.constraint_fields().items()}

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        """None = no logprobs; k >= 0 = the sampled token's logprob and k alternatives."""
        raise NotImplementedError


def sampling_params(
    server: ModelServer, body: GenerationRequest, chat: bool = False
) -> SamplingParams:
    """The request's sampling fields over the server's defaults: a chat completion's
    over the chat defaults (`qinfer.request.chat_defaults`, under the checkpoint's
    generation_config.json), a text completion's over `settings.default_params`."""
    # The tokenizer's vocabulary is known here: a biased id past it names logit_bias.
    vocab_size = server.tokenizer.vocab_size
    bad = next((t for t in body.logit_bias or () if t >= vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"Invalid value for 'logit_bias': token id {bad} is outside the vocabulary "
            f"(0..{vocab_size - 1})",
            param="logit_bias",
            code="invalid_value",
        )
    if chat:
        return chat_sampling_params(
            server.settings.checkpoint_sampling, **body.sampling_overrides()
        )
    return server.settings.default_params.replace(**body.sampling_overrides())


#: The logprob sent for a token the sampler could not pick (masked by a grammar, cut by
#: top-k or top-p): its -inf has no JSON spelling, so it goes out as vLLM sends it.
MIN_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (and NaN) become MIN_LOGPROB."""
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


class ChoicesFormat:
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
