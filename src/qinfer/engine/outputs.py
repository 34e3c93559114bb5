"""What the engine hands back for a request: its text and tokens so far, and the new part."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a generated (or prompt) token, and of the most likely alternatives.
    logprob None: an echoed prompt's first token (nothing predicts it; the server's)."""

    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float]


@dataclass(frozen=True)
class RequestOutput:
    """One request's state after a step (see docs/INTERFACES.md, Engine).

    text / token_ids: everything generated so far; delta_text / delta_token_ids: what is
    new since the previous output of this request. finish_reason: "stop" (EOS, a stop
    token or a stop string; stop_reason says which of the last two), "length"
    (max_tokens, or the model's context / the KV pool is full) or "abort".
    logprobs: aligned with token_ids when the request asked for them.
    prompt_opened_think: for a thinking model, whether the prompt ended inside an open
    `<think>` block (decided once per request: `RequestState.thinking`); None otherwise.
    embedding: a pooling request's vector (fp32 (dimensions,) on the CPU, see
    `qinfer.request.pooling`), in its one, finished output (finish_reason "stop", no tokens).
    score: a scoring request's P(yes) (`qinfer.request.scoring`), likewise.
    prompt_logprobs: with `SamplingParams.prompt_logprobs`, once the prompt has run, one
    entry per prompt token, None for the first (nothing predicts it; see
    `qinfer.engine.prompt_logprobs`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    logprobs: list[TokenLogprob] | None
    prompt_opened_think: bool | None = None
    embedding: torch.Tensor | None = None
    score: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class Timings:
    """Wall-clock time of one request: the prefill (up to the first token) and the decode."""

    prefill_seconds: float
    decode_seconds: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which the prefill produced) per second of decoding."""
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


@dataclass(frozen=True)
class GenerationResult:
    """What one prompt produced, as `qinfer.generate` and `LLM.stream` hand it back.

    token_ids holds every generated id, including an EOS or stop id that ended the row;
    text holds their decoded text, without special tokens and cut before a stop string.
    finish_reason: "eos", "stop" (a stop id or string), "length" or "abort".
    reasoning / answer: for a thinking model (a vocabulary with `</think>`, as Qwen3's), the
    text split into its `<think>...</think>` block and the answer after it (None otherwise).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    timings: Timings
    reasoning: str | None = None
    answer: str | None = None
