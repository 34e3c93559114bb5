"""Tensor parallelism, stage 2 (the engine): rank 0 schedules and samples, one spawned worker
follows its steps, and greedy decoding gives the single-process tokens.

Each `LLM(..., tensor_parallel_size=2)` spawns its worker (`qinfer.distributed`) and
`close()` stops it; a worker killed mid-generation ends the group with one clear error.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from checkpoints import build_chat_checkpoint

from qinfer import LLM, SamplingParams
from qinfer.distributed import TensorParallelError

#: Small pools and blocks, so that a few short prompts share blocks and get preempted.
ENGINE_ARGS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SHARED = list(range(40, 60))  # a 20-token prefix (5 full blocks) three prompts share
PROMPTS = [
    list(range(5, 8)),
    SHARED + [3, 4],
    list(range(100, 141)),  # 41 tokens: prefilled in two chunks
    SHARED + [9],
    list(range(200, 209)),
    SHARED + [11, 12, 13],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-tp")
    build_chat_checkpoint(folder, "qwen3", head_dim=32)  # QK-norm, 4 query and 2 KV heads
    return folder


def generate(checkpoint: Path, size: int, **engine_args) -> tuple[list[list[int]], dict]:
    """Every prompt's greedy tokens, and the engine's stats, at this tensor-parallel size."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", tensor_parallel_size=size, **engine_args)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = vars(llm.engine.stats())
        del stats["generation_tokens_per_s"]  # a timing
        return [out.token_ids for out in outputs], stats
    finally:
        llm.close()


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param(dict(num_kv_blocks=96), id="batching+prefix-cache"),
        pytest.param(dict(num_kv_blocks=20, enable_prefix_caching=False), id="preemption"),
    ],
)
def test_llm_generate_tp2_gives_the_tp1_tokens(checkpoint, pool):
    single, single_stats = generate(checkpoint, 1, **ENGINE_ARGS, **pool)
    split, split_stats = generate(checkpoint, 2, **ENGINE_ARGS, **pool)
    assert split == single
    assert split_stats == single_stats  # same schedule: same hits, same preemptions
    if pool.get("enable_prefix_caching", True):
        assert split_stats["prefix_cache_hits"] > 0
    else:
        assert split_stats["preemptions_total"] > 0


def test_the_pool_holds_the_ranks_kv_heads(checkpoint):
    """Two ranks of a model with 2 KV heads hold one each: twice the blocks in a budget."""
    budget = dict(kv_cache_memory=2**20)
    single = LLM(checkpoint, dtype="float32", device="cpu", **budget)
    split = LLM(checkpoint, dtype="float32", device="cpu", tensor_parallel_size=2, **budget)
    try:
        assert split.engine.runner.pool.keys.shape[2] == 1
        assert split.engine.runner.num_blocks == 2 * single.engine.runner.num_blocks
    finally:
        split.close()


def test_a_worker_killed_mid_generation_ends_the_group_with_one_line(checkpoint):
    llm = LLM(checkpoint, dtype="float32", device="cpu", tensor_parallel_size=2, **ENGINE_ARGS)
    engine = llm.engine
    try:
        engine.add_request(PROMPTS[2], GREEDY)
        engine.step()  # the first prefill chunk ran on both ranks
        (worker,) = engine.runner.group.workers
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(
            TensorParallelError, match=r"^tensor-parallel rank 1 died \(killed by SIGKILL\)$"
        ):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - started < 20
    finally:
        llm.close()
