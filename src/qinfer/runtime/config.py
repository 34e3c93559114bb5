"""What the runtime is told of the engine's settings: the pool's sizing and the step's bounds.

The engine's own `EngineConfig` (scheduling, prefix caching, speculation, queue limits)
gives one with `EngineConfig.runtime`; the runner and the executor see nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

#: KV pool size on CPU when no kv_cache_memory is given.
DEFAULT_CPU_KV_MEMORY = 512 * 2**20


@dataclass(frozen=True)
class RuntimeConfig:
    """block_size: tokens per KV block. max_num_seqs, max_num_batched_tokens: the most
    sequences and tokens one step holds (the step buffers' sizes). kv_cache_memory,
    num_kv_blocks, gpu_memory_utilization: the pool's size (`runner.kv_pool_blocks`).
    num_speculative_tokens: the most tokens proposed per sequence and step (what a
    window space must hold beyond a step's). whole_space_0: a draft model reads block
    space 0's tables for its own pool, so space 0 keeps whole histories.
    attention_backend, static_decode, cuda_graphs, state_snapshots: as `EngineConfig`'s
    (state_snapshots 0 when the engine keeps no prefix cache)."""

    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    num_speculative_tokens: int = 0
    whole_space_0: bool = False
    attention_backend: str = "auto"
    static_decode: bool = False
    cuda_graphs: bool | None = None
    state_snapshots: int | None = None
