"""What a request does with its prompt: generate tokens, pool hidden states, or score.

Every request runs its prompt through the same steps (batched, chunked, over the paged
pool); its task says which rows of the step it needs and what it makes of them once the
prompt has run:

    task       hidden rows            logits rows        once the prompt has run
    Generate   none                   the last (to       samples on (or, with max_tokens 0,
                                      sample)            finishes with "length")
    Pool       `PoolingState.rows`    none               finishes with `embedding`
    Score      none                   the last           finishes with `score`

The engine asks the task (`Engine.step`); no branch there names a kind. A new kind of
request is one more class here and its case in `make_task`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from qinfer.core.errors import RequestError
from qinfer.core.model_config import ModelConfig
from qinfer.request.pooling import PoolingParams, PoolingState
from qinfer.request.sampling import SamplingParams
from qinfer.request.scoring import ScoreParams


class Task(Protocol):
    """One request's kind (module docstring)."""

    #: Whether tokens are sampled once the prompt has run.
    samples: bool
    #: Whether the last row's logits are needed once the prompt has run (to sample or score).
    reads_last_logits: bool
    #: Whether the request may start from cached blocks (a hit skips rows; see `qinfer.request.pooling`).
    uses_prefix_cache: bool

    def hidden_rows(self, start: int, n: int) -> list[int]:
        """The rows (0 .. n - 1) of a step running positions start .. start + n - 1 whose
        final-normed hidden states the task needs."""
        ...

    def take_hidden(self, start: int, rows: torch.Tensor | None) -> None:
        """The fp32 rows (k, hidden) that `hidden_rows(start, n)` asked for (None: none)."""
        ...

    def prompt_ran(self, logits: torch.Tensor) -> tuple[str, dict[str, Any]]:
        """For a task that does not sample: its finish reason and the `RequestOutput`
        fields it fills, from the (k, V) logits rows it asked for in the last step."""
        ...


class _NoHiddenRows:
    """A task that reads logits only: it asks for no hidden rows and takes none."""

    def hidden_rows(self, start: int, n: int) -> list[int]:
        return []

    def take_hidden(self, start: int, rows: torch.Tensor | None) -> None:
        pass


class Generate(_NoHiddenRows):
    """Sample tokens after the prompt (none with max_tokens 0: the request then ends)."""

    uses_prefix_cache = True

    def __init__(self, max_tokens: int) -> None:
        self.samples = self.reads_last_logits = max_tokens > 0

    def prompt_ran(self, logits: torch.Tensor) -> tuple[str, dict[str, Any]]:
        return "length", {}  # max_tokens 0: nothing to sample


class Pool:
    """Pool the prompt's hidden states into one vector (`qinfer.request.pooling`)."""

    samples = reads_last_logits = False

    def __init__(self, params: PoolingParams, num_prompt_tokens: int) -> None:
        self.state = PoolingState(params, num_prompt_tokens)
        self.uses_prefix_cache = params.uses_prefix_cache

    def hidden_rows(self, start: int, n: int) -> list[int]:
        return self.state.rows(start, n)

    def take_hidden(self, start: int, rows: torch.Tensor | None) -> None:
        self.state.add(start, rows)

    def prompt_ran(self, logits: torch.Tensor) -> tuple[str, dict[str, Any]]:
        return "stop", {"embedding": self.state.result()}


class Score(_NoHiddenRows):
    """Score the prompt by two tokens' logits at its last row (`qinfer.request.scoring`)."""

    samples = False
    reads_last_logits = uses_prefix_cache = True

    def __init__(self, params: ScoreParams) -> None:
        self.params = params

    def prompt_ran(self, logits: torch.Tensor) -> tuple[str, dict[str, Any]]:
        return "stop", {"score": self.params.score(logits[-1])}


def check_task_params(params: object, config: ModelConfig) -> SamplingParams:
    """Refuse params that are not a kind's or that the model cannot serve; the
    SamplingParams the request's state is made with (pooling and scoring sample nothing,
    but the state also holds the output's text and stop rule)."""
    if isinstance(params, PoolingParams):
        params.check_hidden_size(config.hidden_size)
    elif isinstance(params, ScoreParams):
        vocab = config.vocab_size
        if not all(0 <= t < vocab for t in (params.yes_token_id, params.no_token_id)):
            raise RequestError(f"{params} names a token outside the vocabulary (0..{vocab - 1})")
    elif not isinstance(params, SamplingParams):
        raise RequestError(
            "params must be a SamplingParams, PoolingParams or ScoreParams, got "
            f"{type(params).__name__}"
        )
    return params if isinstance(params, SamplingParams) else SamplingParams(max_tokens=1)


def make_task(
    params: SamplingParams | PoolingParams | ScoreParams, num_prompt_tokens: int, max_tokens: int
) -> Task:
    """The task of a request made with `params` (checked by `check_task_params`), whose
    prompt has num_prompt_tokens and which may generate max_tokens."""
    if isinstance(params, PoolingParams):
        return Pool(params, num_prompt_tokens)
    if isinstance(params, ScoreParams):
        return Score(params)
    return Generate(max_tokens)
