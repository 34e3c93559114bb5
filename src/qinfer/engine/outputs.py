"""What the engine hands back for a request: its text and tokens so far, and the new part."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a generated token, and of the most likely alternatives."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass(frozen=True)
class RequestOutput:
    """One request's state after a step (see docs/INTERFACES.md, Engine).

    text / token_ids: everything generated so far; delta_text / delta_token_ids: what is
    new since the previous output of this request. finish_reason: "stop" (EOS, a stop
    token or a stop string; stop_reason says which of the last two), "length"
    (max_tokens, or the model's context / the KV pool is full) or "abort".
    logprobs: aligned with token_ids when the request asked for them.
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
