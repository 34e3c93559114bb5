"""How rank 0's engine steps reach the other ranks of a tensor-parallel group.

The scheduler, block manager and sampler live on rank 0 only. Every rank must still run
each forward with the same inputs, in the same order (`qinfer.parallel`), so before each
forward rank 0 broadcasts what a `StepLayout` is built from, and every worker builds the
same layout over its own KV pool (same block ids: the pools have the same number of
blocks) and runs the same `Transformer.forward`. Two broadcasts per step, on the group's
CPU `control` group:

    header  (3,) int64: [S sequences, T new tokens, E block-table entries]; S = 0: stop
    payload (4 S + T + E,) int64: new-token counts (S) | computed counts (S) |
            block-table lengths (S) | logits rows (S) | new tokens (T) | tables (E)

A decode step of 32 sequences with 8-block tables is 32 * 13 = 416 numbers (3.3 KB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qinfer.distributed import TensorParallelGroup


@dataclass(frozen=True)
class StepInputs:
    """One engine step: per sequence b, new_tokens[b] (ids to run now), num_computed[b]
    (tokens already in the pool), block_tables[b], and num_logits[b]: how many of its last
    new tokens produce logits (0 for a prompt chunk that leaves more for later steps; 1 to
    sample the next token; 1 + k to verify k proposed tokens; all of them for a prompt's
    logprobs)."""

    new_tokens: list[list[int]]
    num_computed: list[int]
    block_tables: list[list[int]]
    num_logits: list[int]


class StepChannel:
    """Rank 0 `send`s each step and finally `stop`s; the workers `receive` until stopped."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group.control

    def send(self, step: StepInputs) -> None:
        """Rank 0: broadcast a step (before running it itself)."""
        tokens = [t for ids in step.new_tokens for t in ids]
        tables = [b for table in step.block_tables for b in table]
        self._broadcast(torch.tensor([len(step.new_tokens), len(tokens), len(tables)]))
        payload = [len(ids) for ids in step.new_tokens] + list(step.num_computed)
        payload += [len(table) for table in step.block_tables] + list(step.num_logits)
        self._broadcast(torch.tensor(payload + tokens + tables, dtype=torch.long))

    def stop(self) -> None:
        """Rank 0: tell the workers there are no more steps."""
        self._broadcast(torch.zeros(3, dtype=torch.long))

    def receive(self) -> StepInputs | None:
        """A worker: the next step, or None once rank 0 has stopped."""
        header = self._broadcast(torch.empty(3, dtype=torch.long))
        S, T, E = header.tolist()
        if S == 0:
            return None
        payload = self._broadcast(torch.empty(4 * S + T + E, dtype=torch.long)).tolist()
        lengths, computed = payload[:S], payload[S : 2 * S]
        table_lengths, num_logits = payload[2 * S : 3 * S], payload[3 * S : 4 * S]
        return StepInputs(
            _split(payload[4 * S : 4 * S + T], lengths),
            computed,
            _split(payload[4 * S + T :], table_lengths),
            num_logits,
        )

    def min(self, value: int) -> int:
        """Every rank: the smallest of every rank's value (the KV pool size all can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self.group)
        return t


def _split(flat: list[int], lengths: list[int]) -> list[list[int]]:
    """flat cut into consecutive pieces of the given lengths."""
    pieces, start = [], 0
    for n in lengths:
        pieces.append(flat[start : start + n])
        start += n
    return pieces
