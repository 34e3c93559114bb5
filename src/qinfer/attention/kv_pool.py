"""Where the engine's K/V live: preallocated pools of blocks, plain storage.

Slot `block_id * block_size + i` holds position i of that block; a sequence's block table
lists its blocks in order (`qinfer.engine.block_manager` hands them out, shared between
sequences with a common prefix). A pool holds the layers of one block space
(`qinfer.attention.block_spaces`: a model with sliding-window and full-attention layers has
two pools, each with its own blocks). Each layer's keys and values are laid out as the
attention backend that reads them declares (`KVLayout`, `qinfer.attention.backend`);
`store_kv` writes a step's K/V into either layout.

A quantized pool (`qinfer.attention.kv_quant`: int8 or fp8) holds N = D / 32 (or 1) fp16
scales per (layer, head, slot) beside the elements of keys and values: a block then takes
D + 2 * N bytes per token, head and layer for K and for V, against 2 * D in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from qinfer.attention.block_spaces import BlockSpaces
from qinfer.attention.kv_quant import KVFormat, raw_bytes
from qinfer.core.model_config import ModelConfig


class KVLayout(Enum):
    """How one layer's keys (and values) lie in a pool of num_slots slots.

    HEADS_FIRST (Hkv, slots, D): one head's keys of consecutive slots are contiguous, so a
        history lying in consecutive blocks is read as attention reads a contiguous cache,
        one stream per head (the CPU's paged backend, which slots first would slow: the
        keys read at a stride of Hkv * D; docs/BENCHMARKS.md, "Gathering blocks").
    SLOTS_FIRST (slots, Hkv, D): a token's K/V of every head are contiguous, as
        (num_blocks, block_size, Hkv, D): the layout of vLLM's and flash-attn's paged
        caches, and a step's k, v (T, Hkv, D) are written without a transpose.
    A quantized pool's scales are laid out the same, with N scales in place of D.
    """

    HEADS_FIRST = "heads_first"
    SLOTS_FIRST = "slots_first"

    def shape(self, num_slots: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        """One layer's keys (or values) in this layout."""
        if self is KVLayout.HEADS_FIRST:
            return (num_kv_heads, num_slots, head_dim)
        return (num_slots, num_kv_heads, head_dim)

    @property
    def slot_dim(self) -> int:
        """The dimension of a layer's keys that counts slots."""
        return 1 if self is KVLayout.HEADS_FIRST else 0


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's part of the pool, as views: keys and values in the pool's layout and
    format ((Hkv, slots, D) or (slots, Hkv, D), `KVLayout`) and, when that is quantized,
    their scales fp16 ((Hkv, slots, N) or (slots, Hkv, N), `KVFormat.scales_per_vector`;
    else None)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    format: KVFormat
    layout: KVLayout = KVLayout.HEADS_FIRST


def store_kv(kv: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A step's k, v (T, Hkv, D) -> the layer's pool at the tokens' slots (T,), in its
    layout; quantized per block of each token's head vector first if its format is."""
    dim = kv.layout.slot_dim
    if kv.key_scales is None:
        if k.dtype != kv.keys.dtype:  # (a no-op `.to` still costs a call per layer)
            k, v = k.to(kv.keys.dtype), v.to(kv.values.dtype)
        kv.keys.index_copy_(dim, slots, k.transpose(0, dim))
        kv.values.index_copy_(dim, slots, v.transpose(0, dim))
        return
    for data, scales, x in ((kv.keys, kv.key_scales, k), (kv.values, kv.value_scales, v)):
        stored, x_scales = kv.format.quantize(x)  # (T, Hkv, D), (T, Hkv, N)
        raw_bytes(data).index_copy_(dim, slots, raw_bytes(stored).transpose(0, dim))
        scales.index_copy_(dim, slots, x_scales.transpose(0, dim))


class KVPool:
    """K and V of the layers of one block space, (num_layers, *layout.shape(num_slots, Hkv,
    D)) each, allocated once.

    num_kv_heads: Hkv, the KV heads this rank holds (default: the config's, all of them;
    under tensor parallelism, `Parallel.attention_heads`). num_layers: the layers it holds
    (default: every layer of the config). fmt: the storage, a dtype or a `KVFormat`; a
    quantized one adds key_scales and value_scales, fp16, shaped as keys with N scales in
    place of D (None otherwise). layout: as the backend that reads the pool declares (`KVLayout`).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        fmt: torch.dtype | KVFormat,
        device: torch.device,
        num_kv_heads: int | None = None,
        num_layers: int | None = None,
        layout: KVLayout = KVLayout.HEADS_FIRST,
    ) -> None:
        self.format = fmt if isinstance(fmt, KVFormat) else KVFormat(fmt)
        self.num_blocks, self.block_size, self.layout = num_blocks, block_size, layout
        layers = config.num_hidden_layers if num_layers is None else num_layers
        heads = num_kv_heads or config.num_key_value_heads
        shape = (layers, *layout.shape(num_blocks * block_size, heads, config.head_dim))
        # Zeros, not empty: padded reads take (masked) slots, and NaN garbage would
        # survive a mask in a matmul.
        self.keys = torch.zeros(shape, dtype=self.format.dtype, device=device)
        self.values = torch.zeros(shape, dtype=self.format.dtype, device=device)
        self.key_scales = self.value_scales = None
        key_scales = value_scales = [None] * shape[0]
        if self.format.quantized:  # (layers, Hkv, slots, N) or (layers, slots, Hkv, N)
            scales = (*shape[:3], self.format.scales_per_vector(config.head_dim))
            self.key_scales = torch.zeros(scales, dtype=self.format.scale_dtype, device=device)
            self.value_scales = torch.zeros_like(self.key_scales)
            key_scales, value_scales = self.key_scales.unbind(0), self.value_scales.unbind(0)
        # Each layer's views, made once: a step's layers index no tensor.
        self.layers = [
            LayerKV(*views, self.format, layout)
            for views in zip(
                self.keys.unbind(0), self.values.unbind(0), key_scales, value_scales, strict=True
            )
        ]

    @property
    def nbytes(self) -> int:
        """Bytes the pool's tensors take (keys, values and their scales)."""
        tensors = (self.keys, self.values, self.key_scales, self.value_scales)
        return sum(t.nbytes for t in tensors if t is not None)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Keys and values, then their scales when quantized: what a block holds."""
        scales = [] if self.key_scales is None else [self.key_scales, self.value_scales]
        return [self.keys, self.values, *scales]

    def _block(self, tensor: torch.Tensor, block_id: int) -> torch.Tensor:
        """A block's part of one pool tensor as (layers, block_size, Hkv, X), a view."""
        start = block_id * self.block_size
        if self.layout is KVLayout.HEADS_FIRST:  # (layers, Hkv, slots, X)
            return tensor[:, :, start : start + self.block_size].transpose(1, 2)
        return tensor[:, start : start + self.block_size]

    def block_shapes(self) -> list[tuple[torch.Size, torch.dtype]]:
        """The shape and dtype of each of `read_block`'s tensors."""
        return [(self._block(t, 0).shape, t.dtype) for t in self.tensors]

    def read_block(self, block_id: int) -> list[torch.Tensor]:
        """A copy of one block's K/V (and scales) on the CPU, (layers, block_size, Hkv, X)
        each whatever the layout: the form a block is kept in outside the pool (the prompt
        cache's files)."""
        # as bytes: torch has no CPU copy kernel of fp8 (`raw_bytes`)
        return [
            raw_bytes(self._block(t, block_id)).contiguous().cpu().view(t.dtype)
            for t in self.tensors
        ]

    def write_block(self, block_id: int, parts: list[torch.Tensor]) -> None:
        """Fill one block with what `read_block` gave (of a pool of the same shapes)."""
        for tensor, part in zip(self.tensors, parts, strict=True):
            raw_bytes(self._block(tensor, block_id)).copy_(raw_bytes(part))

    @staticmethod
    def bytes_per_block(
        config: ModelConfig,
        block_size: int,
        fmt: torch.dtype | KVFormat,
        num_kv_heads: int | None = None,
        num_layers: int | None = None,
    ) -> int:
        """Bytes one block takes across num_layers layers (default: all of them), keys and
        values, their scales included (of num_kv_heads KV heads; default: the config's)."""
        fmt = fmt if isinstance(fmt, KVFormat) else KVFormat(fmt)
        heads = num_kv_heads or config.num_key_value_heads
        layers = config.num_hidden_layers if num_layers is None else num_layers
        per_token = 2 * layers * heads * fmt.element_bytes(config.head_dim)
        return per_token * block_size


class PagedLayer(NamedTuple):
    """Where one layer's K/V live: its part of its block space's pool, the space, and the
    layer's own sliding window (None: full attention)."""

    kv: LayerKV
    space: int
    window: int | None


def paged_layers(pools: list[KVPool], spaces: BlockSpaces) -> list[PagedLayer | None]:
    """Every layer's `PagedLayer` over the pools of `spaces` (made once per runner); None
    for a layer without K/V (linear attention)."""
    return [
        None if where is None else PagedLayer(pools[where[0]].layers[where[1]], where[0], window)
        for where, window in zip(spaces.layers, spaces.layer_windows, strict=True)
    ]
