"""The tensors of a step's inputs, allocated once and written in place every step.

Building a step's inputs as fresh tensors costs a dozen small allocations and copies per
step, which a batch-1 decode step (a few ms) feels. `StepBuffers` keeps one flat int64
tensor whose fields sit at fixed offsets and writes each step's numbers into it through a
numpy view of its memory (no tensor is made); on a GPU the flat buffer travels in one
copy to its twin on the device. The same addresses serve every step, which is what
capturing a decode step in a CUDA graph needs (a graph reads its inputs where they were
when it was captured). The fields, capacities Tc tokens, Sc sequences, Wc blocks:

    token_ids       (Tc,)     the step's new tokens, flat, sequence after sequence
    positions       (Tc,)     each token's position in its sequence
    slots           (Tc,)     the pool slot each token's K/V is written to
    logits_indices  (Tc,)     the rows whose logits are wanted
    context_lens    (Sc,)     each sequence's history length after the step
    block_tables    (Sc, Wc)  each sequence's blocks, padded with block 0

A step sees views of their first T, R, S rows and W columns (`StepTensors`). A step larger
than the capacities reallocates the buffers (at most a few times: they double).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import torch


@dataclass(frozen=True)
class StepTensors:
    """One step's inputs as views of `StepBuffers` (valid until the next `write`).

    token_ids, positions, slots (T,); logits_indices (R,); context_lens (S,); block_tables
    (S, W) long, on the device; query_starts: S + 1 host ints (sequence s runs tokens
    query_starts[s]:query_starts[s + 1])."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits_indices: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_starts: list[int]


class StepBuffers:
    """Reused input tensors for the steps of one runner (see the module's docstring)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        max_tokens: int = 512,
        max_seqs: int = 32,
        max_blocks: int = 64,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self._allocate(max_tokens, max_seqs, max_blocks)

    def _allocate(self, tokens: int, seqs: int, blocks: int) -> None:
        self.capacity = (tokens, seqs, blocks)
        sizes = [tokens] * 4 + [seqs, seqs * blocks]
        self._host = torch.zeros(sum(sizes), dtype=torch.long)
        on_host = self.device.type == "cpu"
        self._flat = self._host if on_host else torch.zeros_like(self._host, device=self.device)
        host_np = self._host.numpy()  # shares the tensor's memory: writes land in it
        host_parts = [host_np[s - n : s] for s, n in zip(accumulate(sizes), sizes, strict=True)]
        parts = list(self._flat.split(sizes))
        self._tokens, self._positions, self._slots, self._logits, self._lens = host_parts[:5]
        self._tables = host_parts[5].reshape(seqs, blocks)
        self.token_ids, self.positions, self.slots, self.logits_indices = parts[:4]
        self.context_lens, self.block_tables = parts[4], parts[5].view(seqs, blocks)

    def write(
        self,
        new_tokens: list[list[int]],
        num_computed: list[int],
        block_tables: list[list[int]],
        num_logits: list[int],
    ) -> StepTensors:
        """Write one step (per sequence b: its new token ids, the tokens already in the
        pool, its block table, how many of its last new tokens produce logits) and return
        the views that hold it."""
        size = self.block_size
        num_new = [len(ids) for ids in new_tokens]
        starts = [0]
        for n in num_new:
            starts.append(starts[-1] + n)
        T, S = starts[-1], len(new_tokens)
        W = max(len(table) for table in block_tables)
        tokens, seqs, blocks = self.capacity
        if T > tokens or S > seqs or W > blocks:
            self._allocate(max(T, 2 * tokens), max(S, 2 * seqs), max(W, 2 * blocks))
        positions = [
            p
            for computed, n in zip(num_computed, num_new, strict=True)
            for p in range(computed, computed + n)
        ]
        first = 0
        for b, (table, n) in enumerate(zip(block_tables, num_new, strict=True)):
            last = first + n
            self._slots[first:last] = [
                table[p // size] * size + p % size for p in positions[first:last]
            ]
            self._tables[b, : len(table)] = table
            self._tables[b, len(table) : W] = 0
            first = last
        wanted = [
            row
            for end, count in zip(starts[1:], num_logits, strict=True)
            for row in range(end - count, end)
        ]
        R = len(wanted)
        self._tokens[:T] = list(chain.from_iterable(new_tokens))
        self._positions[:T] = positions
        self._logits[:R] = wanted
        self._lens[:S] = [c + n for c, n in zip(num_computed, num_new, strict=True)]
        if self._flat is not self._host:  # one host-to-device copy of every field
            self._flat.copy_(self._host)
        return StepTensors(
            token_ids=self.token_ids[:T],
            positions=self.positions[:T],
            slots=self.slots[:T],
            logits_indices=self.logits_indices[:R],
            context_lens=self.context_lens[:S],
            block_tables=self.block_tables[:S, :W],
            query_starts=starts,
        )
