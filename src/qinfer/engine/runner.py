"""One scheduled step through the model: the KV pool, its size, and the logits of each row."""

from __future__ import annotations

import torch

from qinfer.engine.config import DEFAULT_CPU_KV_MEMORY, EngineConfig
from qinfer.engine.paged_cache import KVPool, PagedCache, StepLayout
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
        """Run the next num_new[b] tokens of each sequence (their blocks already allocated)
        through the model in one forward.

        Returns the fp32 logits (R, V) after the last new token of each sequence that reaches
        its end with them (num_new[b] == seq.num_uncomputed_tokens), in the order of seqs; a
        prompt chunk that leaves more of its prompt for later steps gets none. Token ids are
        not checked here: the engine checked every prompt when it came in, and sampled ids
        come from the logits, inside the vocabulary.
        """
        starts = [seq.num_computed_tokens for seq in seqs]
        layout = StepLayout(
            [seq.token_ids[i : i + n] for seq, i, n in zip(seqs, starts, num_new, strict=True)],
            starts,
            [seq.block_table for seq in seqs],
            [n == seq.num_uncomputed_tokens for seq, n in zip(seqs, num_new, strict=True)],
            self.block_size,
            self.model.device,
        )
        caches = [
            PagedCache(self.pool, layer, layout, window)
            for layer, window in enumerate(self.windows)
        ]
        logits = self.model.forward(layout.tokens, layout.positions, caches, last_only=True)
        return logits[: layout.num_logits, -1]  # (R, V)
