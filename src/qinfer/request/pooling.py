"""Pooling a prompt's hidden states into one vector (embeddings), instead of sampling.

A request made with `PoolingParams` runs its prompt through the engine like any other
(batched, chunked prefill) and, instead of a token, gets one vector from the final-normed
hidden states of its prompt:

    last   the last token's (Qwen3-Embedding's "lasttoken" pooling)
    mean   the mean over every prompt token
    cls    the first token's

then, with `dimensions`, its first `dimensions` numbers (Matryoshka truncation), then,
with `normalize`, divided by its L2 norm. The engine's runner hands back only the rows a
pooling needs (`PoolingState.rows`), final-normed, in fp32.

Prefix cache: `last` needs only the last row, which a prefix-cache hit never skips (one
token is always left to compute), so it keeps the cache. `mean` and `cls` need rows a hit
would skip, so those requests do not look up the prefix cache (`uses_prefix_cache`);
their blocks are still registered in it for later requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from qinfer.core.errors import RequestError

if TYPE_CHECKING:  # `qinfer serve --help` reads POOLING_METHODS: no torch until pooling runs
    import torch

PoolingMethod = Literal["last", "mean", "cls"]
POOLING_METHODS: tuple[str, ...] = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """How a pooling request turns its prompt into a vector (see the module doc).

    method: "last", "mean" or "cls"; normalize: L2-normalise the vector (after the
    truncation); dimensions: keep only the first `dimensions` numbers (None: all).
    """

    method: PoolingMethod = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise RequestError(
                f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}",
                param="pooling",
            )
        if not isinstance(self.normalize, bool):
            raise RequestError(f"normalize must be a bool, got {self.normalize!r}", "normalize")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise RequestError(
                f"dimensions must be a positive integer, got {d!r}", param="dimensions"
            )

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the request may start from cached blocks (only `last` can: see module)."""
        return self.method == "last"

    def check_hidden_size(self, hidden_size: int) -> None:
        """Refuse dimensions larger than the model's hidden size."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise RequestError(
                f"dimensions is {self.dimensions}, larger than the model's hidden size "
                f"({hidden_size})",
                param="dimensions",
            )


class PoolingState:
    """What one pooling request has gathered so far, step by step (chunked prefill)."""

    def __init__(self, params: PoolingParams, num_prompt_tokens: int) -> None:
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self._sum: torch.Tensor | None = None  # "mean": sum of the rows seen; else the row

    def rows(self, start: int, n: int) -> list[int]:
        """The rows (0 .. n - 1) of a step running prompt positions start .. start + n - 1
        that this pooling needs."""
        method = self.params.method
        if method == "last":
            return [n - 1] if start + n == self.num_prompt_tokens else []
        if method == "cls":
            return [0] if start == 0 else []
        return list(range(n))

    def add(self, start: int, rows: torch.Tensor | None) -> None:
        """Take the final-normed fp32 rows (k, hidden) that `rows(start, n)` asked for
        (None: none). A step from position 0 starts over (a preempted request computes its
        prompt again)."""
        if start == 0:
            self._sum = None
        if rows is None or rows.shape[0] == 0:
            return
        total = rows.sum(dim=0)
        self._sum = total if self._sum is None else self._sum + total

    def result(self) -> torch.Tensor:
        """The pooled vector (dimensions,) fp32 on the CPU, once the prompt has run."""
        import torch.nn.functional as F

        vector = self._sum.float().cpu()
        if self.params.method == "mean":
            vector = vector / self.num_prompt_tokens
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        if self.params.normalize:
            vector = F.normalize(vector, dim=-1)
        return vector
