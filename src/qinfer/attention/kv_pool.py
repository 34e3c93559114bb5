"""Where the engine's K/V live: preallocated pools of blocks, plain storage.

Slot `block_id * block_size + i` holds position i of that block; a sequence's block table
lists its blocks in order (`qinfer.engine.block_manager` hands them out, shared between
sequences with a common prefix). A pool holds the layers of one block space
(`qinfer.attention.block_spaces`: a model with sliding-window and full-attention layers has
two pools, each with its own blocks). Reading and writing a pool is the paged attention
backend's (`qinfer.attention.paged`).

A quantized pool (`qinfer.kv_quant`: int8 or fp8) holds one fp32 scale per (layer, head,
slot) beside each element of keys and values: a block then takes D + 4 bytes per token,
head and layer for K and for V, against 2 * D in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.config import ModelConfig
from qinfer.kv_quant import KVFormat


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's part of the pool, as views: keys and values (Hkv, slots, D) in the pool's
    format and, when that is quantized, their scales (Hkv, slots) fp32 (else None)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    format: KVFormat


class KVPool:
    """K and V of the layers of one block space: (num_layers, Hkv, num_slots, D) each,
    allocated once.

    Heads outermost: one head's keys of consecutive slots are contiguous, so a history
    lying in consecutive blocks is read as attention reads a contiguous cache, one
    stream per head (slots outermost cost ~7 us per layer of a 540-token batch-1 decode
    step on CPU, the keys read at a stride of Hkv * D).

    num_kv_heads: Hkv, the KV heads this rank holds (default: the config's, all of them;
    under tensor parallelism, `Parallel.attention_heads`). num_layers: the layers it holds
    (default: every layer of the config). fmt: the storage, a dtype or a `KVFormat`; a
    quantized one adds key_scales and value_scales, (num_layers, Hkv, num_slots) fp32
    each (None otherwise).
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
    ) -> None:
        self.format = fmt if isinstance(fmt, KVFormat) else KVFormat(fmt)
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (
            config.num_hidden_layers if num_layers is None else num_layers,
            num_kv_heads or config.num_key_value_heads,
            num_blocks * block_size,
            config.head_dim,
        )
        # Zeros, not empty: padded reads take (masked) slots, and NaN garbage would
        # survive a mask in a matmul.
        self.keys = torch.zeros(shape, dtype=self.format.dtype, device=device)
        self.values = torch.zeros(shape, dtype=self.format.dtype, device=device)
        self.key_scales = self.value_scales = None
        key_scales = value_scales = [None] * shape[0]
        if self.format.quantized:  # (layers, Hkv, slots)
            self.key_scales = torch.zeros(shape[:3], device=device)
            self.value_scales = torch.zeros(shape[:3], device=device)
            key_scales, value_scales = self.key_scales.unbind(0), self.value_scales.unbind(0)
        # Each layer's views, made once: a step's layers index no tensor.
        self.layers = [
            LayerKV(*views, self.format)
            for views in zip(
                self.keys.unbind(0), self.values.unbind(0), key_scales, value_scales, strict=True
            )
        ]

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
