"""Tensor parallelism: which part of the model this process (rank) holds, and the collectives
that join the parts.

Each of N ranks holds 1/N of every projection (Megatron-style): the q/k/v and gate/up
projections are split by their outputs (column-parallel: a rank computes its own heads and
FFN channels, nothing exchanged), o_proj and down_proj by their inputs (row-parallel: each
rank's output is a partial sum, all-reduced), the embedding and lm_head by vocabulary rows
(vocab-parallel: a lookup is all-reduced, the logits all-gathered). Norms are replicated.
A forward then exchanges two all-reduces of (B, L, hidden) per layer, one more for the
embedding lookup, and one all-gather of the logits.

Quantized weights are split before they are quantized (each rank quantizes what it holds):
int4 groups, which must not straddle two ranks' shares, come out the same as in one
process; int8 rows of a row-parallel projection take one scale per row of the rank's
columns, so they round differently from (and a little finer than) a single process's.

A `Parallel` is handed to the layers next to `Features`; nothing reads a global. The world
of one, `Parallel()`, splits nothing and communicates nothing: every helper below then
answers "the whole", and the layers run exactly the single-process code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from qinfer.core.errors import QinferError


@dataclass(frozen=True)
class Shard:
    """This rank's part of a projection W (out_features, in_features), as the weights seam
    (`Weights.linear(..., shard=)`) reads it, and how the ranks' outputs meet.

    split "out" (column-parallel): rows `ranges[i]` of part i's out_features (a fused
        q/k/v takes q's rows by its query heads and k's and v's by its KV heads); the
        rank's output is its own slice and nothing is exchanged.
    split "in" (row-parallel): columns `ranges[0]` of in_features; the rank's output is a
        partial sum, all-reduced in the Linear's call, the bias added once after it.
    split "vocab" (vocab-parallel embedding and lm_head): rows `ranges[0]` of the
        vocabulary; lookups are all-reduced and logits all-gathered in the Linear's calls.
    """

    split: Literal["out", "in", "vocab"]
    ranges: tuple[range, ...]
    parallel: Parallel


@dataclass(frozen=True)
class Parallel:
    """Where this process stands in a tensor-parallel group.

    rank: this process's index, 0 .. world_size - 1.
    world_size: how many processes share the model (1: no tensor parallelism).
    group: the `torch.distributed` process group they talk through (None: the default
        group, which the caller initialised with `torch.distributed.init_process_group`).
    """

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise QinferError(
                f"rank {self.rank} is outside a tensor-parallel world of {self.world_size}"
            )

    # ------------------------------------------------------------------ collectives

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x added up, on every rank (x is overwritten); x at world 1."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) on every rank -> (..., world_size * n), rank 0's columns first, on every
        rank; x at world 1."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------ what this rank holds

    def shard_range(self, size: int, what: str) -> range:
        """This rank's equal share of `size` things (query heads, FFN channels), in order.

        A size that does not divide is refused, naming it and the sizes that would divide.
        """
        if size % self.world_size:
            raise QinferError(_not_divisible(size, what, self.world_size, _divisors(size)))
        share = size // self.world_size
        return range(self.rank * share, (self.rank + 1) * share)

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> tuple[range, range]:
        """(query heads, KV heads) of this rank.

        Query head h reads KV head h // (num_heads / num_kv_heads). With at least as many KV
        heads as ranks each rank takes num_kv_heads / N of them and its queries follow;
        with fewer, KV heads are replicated: N / num_kv_heads ranks share each one, and
        each rank's num_heads / N query heads are all of that KV head's group.
        """
        queries = self.shard_range(num_heads, "query heads")
        if num_kv_heads >= self.world_size:
            return queries, self.shard_range(num_kv_heads, "KV heads")
        if self.world_size % num_kv_heads:
            raise QinferError(
                _not_divisible(
                    num_kv_heads, "KV heads", self.world_size, _head_sizes(num_heads, num_kv_heads)
                )
            )
        kv_head = self.rank * num_kv_heads // self.world_size
        return queries, range(kv_head, kv_head + 1)

    def vocab_range(self, vocab_size: int) -> range:
        """This rank's rows of a vocabulary padded to a multiple of world_size: rank r holds
        ids r * ceil(V / N) up to the next rank's first id or V, whichever comes first."""
        share = -(-vocab_size // self.world_size)
        return range(min(self.rank * share, vocab_size), min((self.rank + 1) * share, vocab_size))

    def check_model(self, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        """Refuse, before anything loads, a world size that does not split a model evenly;
        the one line names the number that does not divide and the sizes that would."""
        sizes = tensor_parallel_sizes(num_heads, num_kv_heads, intermediate_size)
        world = self.world_size
        if world in sizes:
            return
        if num_heads % world:
            size, what = num_heads, "query heads"
        elif intermediate_size % world:
            size, what = intermediate_size, "FFN channels"
        else:
            size, what = num_kv_heads, "KV heads"
        raise QinferError(_not_divisible(size, what, world, sizes))

    # ------------------------------------------------------ shards for the weights seam

    def split_out(self, *ranges: range) -> Shard | None:
        """Column-parallel: rows `ranges[i]` of fused part i; None (the whole) at world 1."""
        return None if self.world_size == 1 else Shard("out", ranges, self)

    def split_in(self, columns: range) -> Shard | None:
        """Row-parallel: these input columns; None (the whole) at world 1."""
        return None if self.world_size == 1 else Shard("in", (columns,), self)

    def split_vocab(self, vocab_size: int) -> Shard | None:
        """Vocab-parallel: this rank's `vocab_range`; None (the whole) at world 1."""
        return (
            None if self.world_size == 1 else Shard("vocab", (self.vocab_range(vocab_size),), self)
        )


#: One process: nothing split, nothing exchanged (the layers' default).
SINGLE = Parallel()


def tensor_parallel_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """The world sizes N that split a model evenly: N divides the query heads and the FFN
    channels, and the KV heads either divide into N ranks or are replicated over N ranks
    (N a multiple of them, so that every rank owns whole GQA groups)."""
    return [n for n in _head_sizes(num_heads, num_kv_heads) if intermediate_size % n == 0]


def _head_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """The world sizes that split the attention heads evenly (see `tensor_parallel_sizes`)."""
    return [n for n in _divisors(num_heads) if num_kv_heads % n == 0 or n % num_kv_heads == 0]


def _divisors(size: int) -> list[int]:
    return [n for n in range(1, size + 1) if size % n == 0]


def _not_divisible(size: int, what: str, world: int, sizes: Sequence[int]) -> str:
    """The refusal: '9 query heads do not divide into 2 ranks; use 1, 3 or 9 ranks'."""
    listed = ", ".join(map(str, sizes[:-1])) + " or " if len(sizes) > 1 else ""
    return f"{size} {what} do not divide into {world} ranks; use {listed}{sizes[-1]} ranks"
