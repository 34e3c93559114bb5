"""The tensors of a step's inputs, allocated once and written in place every step.

Building a step's inputs as fresh tensors costs a dozen small allocations and copies per
step, which a batch-1 decode step (a few ms) feels. `StepBuffers` keeps one flat int64
tensor whose fields sit at fixed offsets and writes each step's numbers into it through a
numpy view of its memory (no tensor is made); on a GPU the flat buffer travels in one
copy to its twin on the device. The same addresses serve every step, which is what
capturing a decode step in a CUDA graph needs (a graph reads its inputs where they were
when it was captured). The fields, capacities Tc tokens, Sc sequences, Wc blocks (per
block space, `qinfer.attention.block_spaces`):

    token_ids       (Tc,)     the step's new tokens, flat, sequence after sequence
    positions       (Tc,)     each token's position in its sequence
    logits_indices  (Tc,)     the rows whose logits are wanted
    context_lens    (Sc,)     each sequence's history length after the step
    and per block space:
    slots           (Tc,)     the slot each token's K/V is written to in the space's pool
    block_tables    (Sc, Wc)  the blocks each sequence's step reads, padded with block 0
    key_starts      (Sc,)     a window space's only: the position of each table's first
                              block (the blocks before it were released)

A step sees views of their first T, R, S rows and W columns, as a `ForwardBatch` to plan
(`qinfer.core.forward_batch`). A step larger than the capacities reallocates the buffers
(at most a few times: they double).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, chain

import numpy as np
import torch

from qinfer.attention.block_spaces import first_block
from qinfer.core.forward_batch import ForwardBatch, SpaceTensors


class _SpaceBuffers:
    """One block space's fields of the flat buffer: host (numpy) views to write, device
    views to read, and the table rows as last written (a row that has not changed since,
    as in most decode steps, is not written again)."""

    def __init__(self, host: list[np.ndarray], parts: list[torch.Tensor], seqs: int) -> None:
        self.slots_host, self.slots = host[0], parts[0]
        self.tables_host = host[1].reshape(seqs, -1)
        self.tables = parts[1].view(seqs, -1)
        self.starts_host = host[2] if len(host) > 2 else None
        self.starts = parts[2] if len(parts) > 2 else None
        # per row: its table as last written, and the width it was padded to
        self.written: list[tuple[list[int], int]] = [([], 0)] * seqs


class StepBuffers:
    """Reused input tensors for the steps of one runner (see the module's docstring).

    windows: each block space's window (None: whole histories; default one such space)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        max_tokens: int = 512,
        max_seqs: int = 32,
        max_blocks: int = 64,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.windows = tuple(windows)
        self._allocate(max_tokens, max_seqs, (max_blocks,) * len(self.windows))

    def _allocate(self, tokens: int, seqs: int, blocks: tuple[int, ...]) -> None:
        self.capacity = (tokens, seqs, blocks)
        shared = [tokens] * 3 + [seqs]
        per_space = [
            [tokens, seqs * width] + ([] if window is None else [seqs])
            for window, width in zip(self.windows, blocks, strict=True)
        ]
        sizes = shared + list(chain.from_iterable(per_space))
        self._host = torch.zeros(sum(sizes), dtype=torch.long)
        on_host = self.device.type == "cpu"
        self._flat = self._host if on_host else torch.zeros_like(self._host, device=self.device)
        host_np = self._host.numpy()  # shares the tensor's memory: writes land in it
        host_parts = [host_np[s - n : s] for s, n in zip(accumulate(sizes), sizes, strict=True)]
        parts = list(self._flat.split(sizes))
        self._tokens, self._positions, self._logits, self._lens = host_parts[:4]
        self.token_ids, self.positions, self.logits_indices, self.context_lens = parts[:4]
        self._spaces = []
        self._views_key: tuple | None = None  # the views of the last step's shape
        first = 4
        for fields in per_space:
            last = first + len(fields)
            self._spaces.append(_SpaceBuffers(host_parts[first:last], parts[first:last], seqs))
            first = last

    def write(
        self,
        new_tokens: list[list[int]],
        num_computed: list[int],
        tables: Sequence[list[list[int]]],
        logits_rows: list[int],
        min_widths: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """Write one step (per sequence b: its new token ids, the tokens already in the
        pool, its block table in each space) and the flat rows whose logits are wanted
        (`qinfer.runtime.step.logits_rows`), and return the views that hold it: a batch
        to plan (its attention not yet planned).
        tables[s][b]: sequence b's blocks in space s, from `first_block(num_computed[b], windows[s])` on (a window space's
        step reads no released block). min_widths[s]: space s's tables padded to at least
        this many blocks (default: the longest table's).

        A batch-1 decode step takes a few ms, and this runs between two of them with the
        CPU's caches full of the model's: each numpy write and tensor view costs several
        times what it costs in a loop of its own. So each field is written in one call,
        table rows only when they changed, and a step shaped like the previous one (same
        T, R, S and widths: decode steps) gets the same views back."""
        num_new = [len(ids) for ids in new_tokens]
        starts = list(accumulate(num_new, initial=0))
        T, S = starts[-1], len(new_tokens)
        widths = tuple(max(map(len, space)) for space in tables)
        if min_widths is not None:
            widths = tuple(map(max, widths, min_widths))
        tokens, seqs, blocks = self.capacity
        if T > tokens or S > seqs or any(w > c for w, c in zip(widths, blocks, strict=True)):
            grown = tuple(max(w, 2 * c) for w, c in zip(widths, blocks, strict=True))
            self._allocate(max(T, 2 * tokens), max(S, 2 * seqs), grown)
        positions = [
            p
            for computed, n in zip(num_computed, num_new, strict=True)
            for p in range(computed, computed + n)
        ]
        firsts = [
            self._write_space(space, window, own, W, positions, num_new, num_computed)
            for space, window, own, W in zip(
                self._spaces, self.windows, tables, widths, strict=True
            )
        ]
        R = len(logits_rows)
        self._tokens[:T] = list(chain.from_iterable(new_tokens))
        self._positions[:T] = positions
        self._logits[:R] = logits_rows
        self._lens[:S] = [c + n for c, n in zip(num_computed, num_new, strict=True)]
        if self._flat is not self._host:  # one host-to-device copy of every field
            self._flat.copy_(self._host)
        if (T, R, S, widths) != self._views_key:
            self._views_key = (T, R, S, widths)
            self._views = (
                self.token_ids[:T],
                self.positions[:T],
                self.logits_indices[:R],
                self.context_lens[:S],
                [
                    (
                        space.slots[:T],
                        space.tables[:S, :W],
                        None if space.starts is None else space.starts[:S],
                    )
                    for space, W in zip(self._spaces, widths, strict=True)
                ],
            )
        token_ids, positions, logits_indices, context_lens, space_views = self._views
        return ForwardBatch(
            token_ids=token_ids,
            positions=positions,
            logits_indices=logits_indices,
            context_lens=context_lens,
            query_starts=starts,
            num_computed=list(num_computed),
            block_size=self.block_size,
            spaces=[
                SpaceTensors(slots, padded, own, first, None if first is None else key_starts)
                for (slots, padded, key_starts), own, first in zip(
                    space_views, tables, firsts, strict=True
                )
            ],
        )

    def _write_space(
        self,
        space: _SpaceBuffers,
        window: int | None,
        tables: list[list[int]],
        W: int,
        positions: list[int],
        num_new: list[int],
        num_computed: list[int],
    ) -> list[int] | None:
        """One space's slots and tables into its host fields; the logical index of each
        table's first block in a window space (None in a whole-history one)."""
        size = self.block_size
        firsts = None
        if window is not None:
            firsts = [first_block(c, window, size) for c in num_computed]
            space.starts_host[: len(tables)] = [f * size for f in firsts]
        slots, first = [], 0
        for b, (table, n) in enumerate(zip(tables, num_new, strict=True)):
            skip = 0 if firsts is None else firsts[b]  # the logical index of table[0]
            slots += [
                table[p // size - skip] * size + p % size for p in positions[first : first + n]
            ]
            first += n
            written, padded = space.written[b]
            if written != table or padded < W:  # padded with block 0 to the step's width
                space.tables_host[b, :W] = table + [0] * (W - len(table))
                space.written[b] = (list(table), W)
        space.slots_host[:first] = slots
        return firsts


def step_batch(
    num_new: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
    window: int | None = None,
) -> ForwardBatch:
    """One step of one block space (of this `window`) in buffers of its own, without token
    ids or logits: a step to attend over, outside a runner (the attention tests)."""
    buffers = StepBuffers(block_size, device, sum(num_new), len(num_new), windows=[window])
    no_ids = [[0] * n for n in num_new]
    return buffers.write(no_ids, num_computed, [block_tables], [])
