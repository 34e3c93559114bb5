"""Where the engine's K/V live: one preallocated pool of blocks, read through block tables.

`KVPool` holds the keys and values of every layer as `num_blocks * block_size` token
slots; slot `block_id * block_size + i` holds position i of that block. `BatchLayout`
describes one forward of the engine: which slots receive the new tokens of each row and
which slots make up each row's history. `PagedCache` is the KV-cache protocol
(`qinfer.kv_cache`) for one layer over the pool, so the unchanged attention layer runs
over a batch of sequences that each sit at their own offset.

All rows of one forward add the same number of new tokens (the runner groups them so),
each at its own offset. This gather-based version copies each row's history
(B, S, Hkv, D) out of the pool on every layer, padded to the longest history S and
masked with `position_mask` (padding keys get position -1).

Sliding-window layers keep their whole history in the pool and are masked to their window
(correct, but they use as much memory as full-attention layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.errors import CacheError
from qinfer.kv_cache import Attends, Mask, position_mask


class KVPool:
    """K and V of every layer: (num_layers, num_slots, Hkv, D) each, allocated once."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (
            config.num_hidden_layers,
            num_blocks * block_size,
            config.num_key_value_heads,
            config.head_dim,
        )
        # Zeros, not empty: padded reads gather (masked) slots, and NaN garbage would
        # survive a mask in a matmul.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class BatchLayout:
    """One forward's placement of tokens in the pool, shared by every layer.

    block_tables: one list of block ids per row; num_computed: tokens already in the pool
    per row; num_new: tokens each row adds (the same for every row: rows are never padded
    on the query side, see `ModelRunner`).
    """

    def __init__(
        self,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        B, L = len(block_tables), num_new
        computed = torch.tensor(num_computed, dtype=torch.long)  # (B,)
        total = computed + L  # (B,) history length after this step
        S = int(total.max())
        width = max(len(t) for t in block_tables)
        tables = torch.zeros(B, width, dtype=torch.long)  # (B, blocks), padded with block 0
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)

        query_positions = computed[:, None] + torch.arange(L)  # (B, L)
        # The history each row reads: positions 0 .. total-1, then padding (-1, masked;
        # its slots point into block 0, whatever it holds).
        key_positions = torch.arange(S).expand(B, S)  # (B, S)
        read_slots = _slots(tables, key_positions, block_size)
        key_positions = torch.where(key_positions < total[:, None], key_positions, -1)

        self.offsets = computed.to(device)  # (B,) position of each row's first new token
        self.write_slots = _slots(tables, query_positions, block_size).flatten().to(device)
        self.read_slots = read_slots.to(device)  # (B, S)
        self.query_positions = query_positions.to(device)
        self.key_positions = key_positions.to(device)
        # Every row's history equally long: no key padding, bottom-right causal says it all.
        self.dense = bool((total == S).all())
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> Mask:
        """(B, 1, L, S) boolean: causal over each row's own history, inside `window`; or
        "causal" when that is all it says (lets attention use its causal fast paths)."""
        if self.dense and window is None:
            return "causal"
        if window not in self._masks:
            self._masks[window] = position_mask(self.query_positions, self.key_positions, window)
        return self._masks[window]


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots (B, n) of positions (B, n) through block tables (B, blocks)."""
    blocks = tables.gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool (slots, Hkv, D) read at slots (B, S) -> (B, S, Hkv, D). An embedding lookup of
    whole rows: on CPU about 3x faster than advanced indexing."""
    rows = pool.view(pool.shape[0], -1)  # (slots, Hkv * D)
    return F.embedding(slots, rows).view(*slots.shape, *pool.shape[1:])


class PagedCache(Attends):
    """The KV-cache protocol for one layer over a `KVPool`, for the rows of a `BatchLayout`."""

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout, window: int | None) -> None:
        self.keys, self.values = pool.keys[layer], pool.values[layer]  # (slots, Hkv, D)
        self.layout = layout
        self.window = window

    @property
    def offsets(self) -> torch.Tensor:
        return self.layout.offsets

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor, mask_length: int | None = None, mask: Mask = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new k, v (B, Hkv, L, D) into the pool; return each row's history
        (B, Hkv, S, D) with its mask ("causal" or (B, 1, L, S) boolean). A caller's boolean
        mask is combined with it."""
        B, H, L, D = k.shape
        layout = self.layout
        if layout.query_positions.shape != (B, L):
            raise CacheError(
                f"paged cache laid out for (rows, tokens) {tuple(layout.query_positions.shape)}, "
                f"got {(B, L)}"
            )
        # (B, Hkv, L, D) -> (B * L, Hkv, D), row-major like write_slots
        self.keys[layout.write_slots] = k.transpose(1, 2).reshape(B * L, H, D).to(self.keys.dtype)
        self.values[layout.write_slots] = (
            v.transpose(1, 2).reshape(B * L, H, D).to(self.values.dtype)
        )
        keys = _gather(self.keys, layout.read_slots).transpose(1, 2)  # (B, Hkv, S, D)
        values = _gather(self.values, layout.read_slots).transpose(1, 2)
        if isinstance(mask, torch.Tensor):  # the caller's own mask: combine explicitly
            allowed = position_mask(layout.query_positions, layout.key_positions, self.window)
            return keys, values, layout.offsets, allowed & mask
        return keys, values, layout.offsets, layout.mask(self.window)
