"""One scheduled step through the model: the KV pool, its size, and the logits of each row."""

from __future__ import annotations

import torch

from qinfer.engine.config import DEFAULT_CPU_KV_MEMORY, EngineConfig
from qinfer.engine.paged_cache import BatchLayout, KVPool, PagedCache
from qinfer.engine.sequence import Sequence
from qinfer.errors import QinferError
from qinfer.model import Transformer


def kv_pool_blocks(model: Transformer, config: EngineConfig) -> int:
    """How many blocks the pool gets: num_kv_blocks, else the byte budget divided by a block's
    size (the budget: kv_cache_memory, or a share of free GPU memory, or the CPU default)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory
    if budget is None:
        if model.device.type == "cuda":
            budget = _gpu_budget(model, config)
        else:
            budget = DEFAULT_CPU_KV_MEMORY
    per_block = KVPool.bytes_per_block(model.config, config.block_size, model.dtype)
    blocks = budget // per_block
    if blocks < 1:
        raise QinferError(
            f"the KV pool budget of {budget} bytes holds no block ({per_block} bytes each): "
            "raise kv_cache_memory or gpu_memory_utilization"
        )
    return blocks


def _gpu_budget(model: Transformer, config: EngineConfig) -> int:
    """Bytes for the pool on a GPU: gpu_memory_utilization of the memory free now, less the
    activation peak of a warm-up forward as long as the longest step (kept for the steps)."""
    device = model.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    length = min(config.max_num_batched_tokens, model.config.max_position_embeddings)
    model(torch.zeros(1, length, dtype=torch.long, device=device), last_only=True)
    activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * config.gpu_memory_utilization) - activations


class ModelRunner:
    """Owns the KV pool and turns a list of (sequence, new tokens) into next-token logits."""

    def __init__(self, model: Transformer, config: EngineConfig) -> None:
        self.model = model
        self.block_size = config.block_size
        self.pool = KVPool(
            model.config,
            kv_pool_blocks(model, config),
            config.block_size,
            model.dtype,
            model.device,
        )
        self.windows = [model.config.window(i) for i in range(model.config.num_hidden_layers)]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def run(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        """Compute the next num_new[b] tokens of each sequence (their blocks already allocated)
        and return the fp32 logits (B, V) at each row's last new token.

        Rows are grouped by their number of new tokens, one forward per group: the decode
        rows (one token each) run together, and no row is padded to a longer prefill chunk
        (padding a decode row to a 500-token chunk would cost 500x its work).
        """
        groups: dict[int, list[int]] = {}
        for row, n in enumerate(num_new):
            groups.setdefault(n, []).append(row)
        logits = None
        for n, rows in groups.items():
            group_logits = self._forward([seqs[row] for row in rows], n)  # (len(rows), V)
            if logits is None:
                logits = group_logits.new_empty(len(seqs), group_logits.shape[-1])
            logits[rows] = group_logits
        return logits

    def _forward(self, seqs: list[Sequence], n: int) -> torch.Tensor:
        """Logits (B, V) after the next n tokens of each of these sequences."""
        layout = BatchLayout(
            [seq.block_table for seq in seqs],
            [seq.num_computed_tokens for seq in seqs],
            n,
            self.block_size,
            self.model.device,
        )
        tokens = torch.tensor(  # (B, n)
            [seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n] for seq in seqs]
        )
        caches = [
            PagedCache(self.pool, layer, layout, window)
            for layer, window in enumerate(self.windows)
        ]
        logits = self.model(tokens, offsets=layout.offsets, cache=caches, last_only=True)
        return logits[:, -1]  # (B, V)
