"""The gathered attention backend: every sequence's history gathered from the pool, then
one sdpa call for the whole step.

The shortest paged attention that is right for any step on any device. Pools are laid out
slots first (`KVLayout.SLOTS_FIRST`: (slots, Hkv, D) per layer, vLLM's and flash-attn's
(num_blocks, block_size, Hkv, D)), so a step's k, v are written as they come, and each
sequence's blocks are read by slot:

    keys = pool[key_slots]                       # (G, S, Hkv, D): S = W * block_size
    out = sdpa(q, keys, values, scale, mask)     # q (G, Hq, L, D): padded to the longest L

The mask comes from positions alone: each key's position (-1 past its sequence's history,
so the padding of short tables is never read), each query's, and the layer's window. A
sequence with fewer new tokens than the step's longest repeats its last query, whose
result is dropped.

What it spends, that the paged backend (`paged.py`) does not: a copy of every history per
layer, and L queries per sequence (one long prompt chunk beside decode tokens pads each
decode to the chunk's length). What it keeps: one gather and one sdpa call per layer,
whatever the step holds, over metadata built once per step: the place where a paged GPU
kernel (flash-attn's `flash_attn_with_kvcache`, FlashInfer) would read the block tables
itself.
"""

from __future__ import annotations

import functools

import torch

from qinfer.attention.kv_cache import position_mask
from qinfer.attention.kv_pool import KVLayout, PagedLayer, store_kv
from qinfer.attention.kv_quant import KVFormat, raw_bytes
from qinfer.attention.sdpa import Sdpa
from qinfer.core.forward_batch import ForwardBatch


class GatheredBackend:
    """Pools slots first, a step's metadata as `_GatheredStep`s (one per block space),
    `GatheredAttention` to attend through `sdpa` (`qinfer.attention.backend`)."""

    layout = KVLayout.SLOTS_FIRST
    static_decode = True  # a step of equal query counts makes only views and op outputs

    def __init__(self, sdpa: Sdpa) -> None:
        self.sdpa = sdpa

    def plan(self, step: ForwardBatch, layers: list[PagedLayer]) -> GatheredAttention:
        """The step's attention over the pools that `layers` place."""
        spaces = [_GatheredStep(step, space) for space in range(len(step.spaces))]
        return GatheredAttention(layers, spaces, self.sdpa)


class _GatheredStep:
    """One block space's part of a step, shared by its layers.

    slots (T,): where each new token's K/V go. key_slots (G, S): the slot of each key a
    sequence reads, its table's blocks whole (S = W * block_size). key_positions (G, S):
    each key's position, -1 past the sequence's history. queries (G, L): each sequence's
    new tokens as flat indices into the step, its last repeated up to the longest L (None
    when every sequence runs L tokens: the step's tokens are then (G, L) as they are);
    kept (G, L): which of them are the sequence's own.
    """

    def __init__(self, step: ForwardBatch, space: int = 0) -> None:
        part = step.spaces[space]
        G, W = part.block_tables.shape
        size, device = step.block_size, part.block_tables.device
        self.slots, self.num_seqs = part.slots, G
        offsets = _arange(size, device)
        self.key_slots = (part.block_tables[:, :, None] * size + offsets).view(G, W * size)
        keys = _arange(W * size, device).expand(G, -1)
        if part.key_starts is not None:  # a window space's tables start past position 0
            keys = keys + part.key_starts[:, None]
        self.key_positions = torch.where(keys < step.context_lens[:, None], keys, -1)
        num_new = step.num_new
        L = max(num_new)
        self.queries = self.kept = None
        if min(num_new) == L:
            self.query_positions = step.positions.view(G, L)
        else:
            starts = torch.tensor(step.query_starts[:-1], device=device)[:, None]
            counts = torch.tensor(num_new, device=device)[:, None]
            columns = torch.arange(L, device=device)
            self.queries = starts + torch.minimum(columns, counts - 1)  # (G, L)
            self.kept = columns < counts
            self.query_positions = step.positions[self.queries]
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """(G, 1, L, S) boolean, True = may attend: causal over each sequence's own history,
        inside `window`; made once per step and window."""
        if window not in self._masks:
            self._masks[window] = position_mask(self.query_positions, self.key_positions, window)
        return self._masks[window]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """The step's flat (T, H, D) -> (G, L, H, D), each sequence's tokens in its row."""
        if self.queries is None:
            return x.view(self.num_seqs, -1, *x.shape[1:])
        return x[self.queries]

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """`padded`'s inverse: (G, L, H, D) -> (T, H, D), the repeated queries dropped."""
        return x.reshape(-1, *x.shape[2:]) if self.kept is None else x[self.kept]


class GatheredAttention:
    """The attention of one step over the pools of a model's block spaces: layers[l] says
    where layer l's K/V live (`paged_layers`), spaces[s] is this step's `_GatheredStep`
    over block space s."""

    def __init__(self, layers: list[PagedLayer], spaces: list[_GatheredStep], sdpa: Sdpa) -> None:
        self.layers, self.spaces, self.sdpa = layers, spaces, sdpa

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q (T, Hq, D) and the new k, v (T, Hkv, D) -> (T, Hq, D) in q's dtype."""
        kv, space, window = self.layers[layer]
        step = self.spaces[space]
        store_kv(kv, step.slots, k, v)
        keys = _gather(kv.keys, kv.key_scales, kv.format, step.key_slots, q.dtype)
        values = _gather(kv.values, kv.value_scales, kv.format, step.key_slots, q.dtype)
        queries = step.padded(q).transpose(1, 2)  # (G, Hq, L, D)
        out = self.sdpa(queries, keys, values, scale, step.mask(window))  # (G, Hq, L, D)
        return step.flat(out.transpose(1, 2))


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """0 .. n - 1 on `device`, made once per length (a step of a seen shape makes no tensor);
    read only."""
    return torch.arange(n, device=device)


def _gather(
    data: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: KVFormat,
    slots: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One layer's keys or values (slots, Hkv, D), stored as `fmt`, at slots (G, S) ->
    (G, Hkv, S, D) in `dtype`, dequantized with `scales` (slots, Hkv, N) read the same way."""
    if scales is None:
        history = data[slots]  # (G, S, Hkv, D)
        history = history if history.dtype == dtype else history.to(dtype)
    else:  # read as bytes: CPU torch indexes no fp8
        history = raw_bytes(data)[slots].view(data.dtype)
        history = fmt.dequantize(history, scales[slots], dtype)
    return history.transpose(1, 2)
