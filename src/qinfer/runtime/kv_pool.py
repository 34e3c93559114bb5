"""Where the engine's K/V live: one preallocated pool of blocks, plain storage.

Slot `block_id * block_size + i` holds position i of that block; a sequence's block table
lists its blocks in order (`qinfer.engine.block_manager` hands them out, shared between
sequences with a common prefix). Reading and writing the pool is the paged attention
backend's (`qinfer.attention.paged`).
"""

from __future__ import annotations

import torch

from qinfer.config import ModelConfig


class KVPool:
    """K and V of every layer: (num_layers, Hkv, num_slots, D) each, allocated once.

    Heads outermost: one head's keys of consecutive slots are contiguous, so a history
    lying in consecutive blocks is read as attention reads a contiguous cache, one
    stream per head (slots outermost cost ~7 us per layer of a 540-token batch-1 decode
    step on CPU, the keys read at a stride of Hkv * D).

    num_kv_heads: Hkv, the KV heads this rank holds (default: the config's, all of them;
    under tensor parallelism, `Parallel.attention_heads`).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (
            config.num_hidden_layers,
            num_kv_heads or config.num_key_value_heads,
            num_blocks * block_size,
            config.head_dim,
        )
        # Zeros, not empty: padded reads take (masked) slots, and NaN garbage would
        # survive a mask in a matmul.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # Each layer's (Hkv, slots, D) view, made once: a step's layers index no tensor.
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
    ) -> int:
        """Bytes one block takes across all layers, keys and values (of num_kv_heads KV
        heads; default: the config's)."""
        heads = num_kv_heads or config.num_key_value_heads
        per_token = 2 * config.num_hidden_layers * heads * config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()
