"""How rank 0's engine steps reach the other ranks of a tensor-parallel group.

The scheduler, block manager and sampler live on rank 0 only. Every rank must still run
each forward with the same inputs, in the same order (`qinfer.core.parallel`), so before each
forward rank 0 broadcasts the step (`qinfer.runtime.step.ScheduledStep`), and every worker
runs it over its own KV pools (same block ids: the pools have the same number of blocks)
through the same `Transformer.forward`. Two broadcasts per step, on the group's
CPU `control` group:

    header  (5,) int64: [S sequences, T new tokens, K block spaces, E block-table
            entries of every space, N state slots (S or 0)]; S = 0: stop
    payload (3 S + K S + T + E + N,) int64: new-token counts (S) | computed counts (S) |
            logits rows (S) | block-table lengths, space after space (K S) |
            new tokens (T) | tables, space after space (E) | state slots (N: a hybrid
            model's, `ScheduledStep.state_slots`)

A decode step of 32 sequences with 8-block tables in one space is 32 * 13 = 416 numbers
(3.3 KB).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qinfer.runtime.distributed import TensorParallelGroup
from qinfer.runtime.step import ScheduledStep


def pack(step: ScheduledStep) -> tuple[torch.Tensor, torch.Tensor]:
    """A step as the channel's (header, payload) int64 tensors (the module's docstring)."""
    tables = step.tables
    tokens = [t for ids in step.new_tokens for t in ids]
    entries = [b for space in tables for table in space for b in table]
    slots = list(step.state_slots or [])
    header = torch.tensor(
        [len(step.new_tokens), len(tokens), len(tables), len(entries), len(slots)]
    )
    payload = [len(ids) for ids in step.new_tokens] + list(step.num_computed)
    payload += list(step.num_logits) + [len(table) for space in tables for table in space]
    return header, torch.tensor(payload + tokens + entries + slots, dtype=torch.long)


def unpack(header: list[int], payload: list[int]) -> ScheduledStep:
    """The step `pack` made these numbers from (header as ints, payload as ints)."""
    S, T, K, E, N = header
    lengths, computed, num_logits = payload[:S], payload[S : 2 * S], payload[2 * S : 3 * S]
    table_lengths = payload[3 * S : 3 * S + K * S]
    tokens = payload[3 * S + K * S : 3 * S + K * S + T]
    entries_start = 3 * S + K * S + T
    tables = _split(payload[entries_start : entries_start + E], table_lengths)
    spaces = [tables[k * S : (k + 1) * S] for k in range(K)]
    slots = payload[entries_start + E :] if N else None
    return ScheduledStep(_split(tokens, lengths), computed, spaces, num_logits, state_slots=slots)


class StepChannel:
    """Rank 0 `send`s each step and finally `stop`s; the workers `receive` until stopped."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group.control

    def send(self, step: ScheduledStep) -> None:
        """Rank 0: broadcast a step (before running it itself)."""
        header, payload = pack(step)
        self._broadcast(header)
        self._broadcast(payload)

    def stop(self) -> None:
        """Rank 0: tell the workers there are no more steps."""
        self._broadcast(torch.zeros(5, dtype=torch.long))

    def receive(self) -> ScheduledStep | None:
        """A worker: the next step, or None once rank 0 has stopped."""
        header = self._broadcast(torch.empty(5, dtype=torch.long)).tolist()
        S, T, K, E, N = header
        if S == 0:
            return None
        payload = self._broadcast(torch.empty(3 * S + K * S + T + E + N, dtype=torch.long))
        return unpack(header, payload.tolist())

    def rank_0(self, value: int) -> int:
        """Every rank: rank 0's value (a setting only rank 0's config holds)."""
        return int(self._broadcast(torch.tensor([value], dtype=torch.long)).item())

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
