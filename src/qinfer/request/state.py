"""One request while it generates: what the engine keeps of it besides its tokens' KV.

    state = RequestState.create(token_ids, params, max_tokens, eos_ids, tokenizer, device)
    result = sample_next(logits, [state, ...])        # one token per state
    delta = state.accept(token_id)                     # text it makes safe to show
    state.finish_reason                                # None while it goes on

A state holds what turns sampled ids into a response: the SamplingParams, the request's
own generator (seeded sampling), the detokenizer (text and stop strings), the stop rule
(`qinfer.request.stopping`) and the logits processors (a grammar's mask). It owns no KV
cache: the engine keeps the request's blocks in its paged pool (every front-end, `generate`
included, runs through the engine). A preempted request keeps its state untouched (its
tokens are recomputed, not re-sampled), so a grammar's matcher stays where it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qinfer.core.errors import QinferError
from qinfer.request.sampling import (
    LogitBias,
    LogitsProcessor,
    SampleResult,
    SamplingParams,
    ThinkingBudget,
    make_generator,
    sample,
)
from qinfer.request.stopping import accept_token
from qinfer.text.detokenizer import IncrementalDetokenizer
from qinfer.text.reasoning import MAY_THINK, THINK_CLOSE, THINK_OPEN, THINKING, prompt_thinking
from qinfer.text.tokenizer import Tokenizer


class RequestState:
    """Params, generator, detokenizer, stop rule and logits processors of one request.

    token_ids: the list holding the prompt's ids; `accept` appends every sampled id to
    it (the engine passes its Sequence's own list, so both see the same tokens).
    max_tokens: the budget, already cut to the room the context leaves.
    """

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_ids: frozenset[int],
        detokenizer: IncrementalDetokenizer | None,
        generator: torch.Generator | None,
        logits_processors: Sequence[LogitsProcessor] = (),
        thinking: str | None = None,
    ) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.eos_ids = eos_ids
        self.detokenizer = detokenizer  # None: token ids only, no text
        self.generator = generator  # None: the global RNG
        self.logits_processors = list(logits_processors)
        # Where the prompt leaves a thinking model's <think> block (`prompt_thinking`):
        # decided once here, read by the grammar and by whoever splits the reasoning.
        self.thinking = thinking
        self.text = ""
        self.finish_reason: str | None = None  # "eos", "stop", "length" or "abort"
        self.stop_reason: str | int | None = None  # the stop string or id that ended it

    @classmethod
    def create(
        cls,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_ids: frozenset[int],
        tokenizer: Tokenizer | None,
        device: str | torch.device,
    ) -> RequestState:
        """A state with its detokenizer, generator and processors built from `params`.

        Raises a QinferError for params that need a tokenizer (stop strings, a grammar)
        when there is none, for an invalid grammar, or for a `logit_bias` id the
        tokenizer does not have.
        """
        if params.stop and tokenizer is None:
            raise QinferError("stop strings need a tokenizer; none was given")
        detokenizer = IncrementalDetokenizer(tokenizer, list(params.stop)) if tokenizer else None
        thinking = prompt_thinking(tokenizer, token_ids)
        processors: list[LogitsProcessor] = []
        if params.logit_bias:
            vocab = None if tokenizer is None else tokenizer.vocab_size
            bad = next((t for t, _ in params.logit_bias if vocab is not None and t >= vocab), None)
            if bad is not None:
                raise QinferError(
                    f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab - 1})"
                )
            processors.append(LogitBias(params.logit_bias))
        if params.thinking_budget is not None and thinking in (THINKING, MAY_THINK):
            processors.append(
                ThinkingBudget(
                    params.thinking_budget,
                    tokenizer.token_to_id(THINK_OPEN),
                    tokenizer.token_to_id(THINK_CLOSE),
                    inside=thinking == THINKING,
                )
            )
        if params.constraint is not None:
            from qinfer.request.grammar import GrammarProcessor  # llguidance only when asked for

            processors.append(GrammarProcessor.create(params, tokenizer, eos_ids, thinking))
        generator = make_generator(params, device)
        return cls(
            token_ids, params, max_tokens, eos_ids, detokenizer, generator, processors, thinking
        )

    @property
    def prompt_opened_think(self) -> bool | None:
        """Whether the prompt ended inside `<think>` (`split_reasoning`'s argument); None
        for a model that does not think (no reasoning split)."""
        return None if self.thinking is None else self.thinking == THINKING

    @property
    def rows_independent(self) -> bool:
        """True when the distribution of a row depends on its logits alone: no logits
        processors and no penalties (both read the tokens accepted before it), so that
        the rows verifying several proposed tokens can be sampled at once."""
        return not self.logits_processors and not self.params.has_penalties

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token_id: int) -> str:
        """Record a sampled token; return the text it makes safe to show (maybe "")."""
        self.token_ids.append(token_id)
        for processor in self.logits_processors:
            processor.accept(token_id)
        step = accept_token(
            token_id,
            self.params,
            self.eos_ids,
            self.detokenizer,
            self.num_generated_tokens,
            self.max_tokens,
        )
        self.text += step.text
        if step.finish_reason is not None:
            self.finish(step.finish_reason, step.stop_reason)
        return step.text

    def abort(self) -> str:
        """End the request now ("abort"); return the text the detokenizer held back."""
        tail = self.detokenizer.finish() if self.detokenizer is not None else ""
        self.text += tail
        self.finish("abort")
        return tail

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark the request finished and release its processors (once)."""
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason
        for processor in self.logits_processors:
            processor.release()
        self.logits_processors = []


def sample_next(
    logits: torch.Tensor,
    states: Sequence[RequestState],
    proposed: Sequence[int | None] | None = None,
) -> SampleResult:
    """One token for each state from its row of logits (R, V), with its own params,
    history, generator and processors; proposed[r] (speculative decoding) is kept exactly
    as often as the state's distribution would pick it (`qinfer.request.sampling.sample`)."""
    return sample(
        logits,
        [s.params for s in states],
        [s.token_ids for s in states],
        [s.generator for s in states],
        prompt_lens=[s.num_prompt_tokens for s in states],
        logits_processors=[s.logits_processors for s in states],
        proposed=proposed,
    )
