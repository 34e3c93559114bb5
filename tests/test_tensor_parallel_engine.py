"""Tensor parallelism, stage 2 (the engine): rank 0 schedules and samples, one spawned worker
follows its steps, and greedy decoding gives the single-process tokens.

Each `LLM(..., tensor_parallel_size=2)` spawns its worker (`qinfer.runtime.distributed`) and
`close()` stops it; a worker killed mid-generation ends the group with one clear error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from checkpoints import build_chat_checkpoint
from starlette.testclient import TestClient

from qinfer import LLM, SamplingParams
from qinfer.bench import Workload, run_engine_benchmark
from qinfer.core.errors import WeightsError
from qinfer.engine import AsyncEngine
from qinfer.runtime.distributed import (
    TensorParallelError,
    TensorParallelGroup,
    init_tensor_parallel,
    load_on_every_rank,
)
from qinfer.server.app import ServerSettings, create_app

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

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


def embed_then_generate(checkpoint: Path, size: int) -> tuple[list, list[list[int]]]:
    """Every prompt's last-token and mean embeddings, then its greedy tokens (the group is
    still in step after pooling requests that computed no logits on any rank)."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", tensor_parallel_size=size, **ENGINE_ARGS)
    try:
        vectors = llm.embed(PROMPTS) + llm.embed(PROMPTS, pooling="mean")
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return vectors, [out.token_ids for out in outputs]
    finally:
        llm.close()


def test_llm_embed_tp2_gives_the_tp1_vectors(checkpoint):
    single_vectors, single_tokens = embed_then_generate(checkpoint, 1)
    split_vectors, split_tokens = embed_then_generate(checkpoint, 2)
    torch.testing.assert_close(torch.tensor(split_vectors), torch.tensor(single_vectors))
    assert split_tokens == single_tokens


def test_the_pool_holds_the_ranks_kv_heads(checkpoint):
    """Two ranks of a model with 2 KV heads hold one each: twice the blocks in a budget."""
    budget = dict(kv_cache_memory=2**20)
    single = LLM(checkpoint, dtype="float32", device="cpu", **budget)
    split = LLM(checkpoint, dtype="float32", device="cpu", tensor_parallel_size=2, **budget)
    try:
        assert split.engine.executor.runner.pools[0].keys.shape[1] == 1
        assert split.engine.executor.num_blocks == [2 * single.engine.executor.num_blocks[0]]
    finally:
        split.close()


def test_a_worker_killed_mid_generation_ends_the_group_with_one_line(checkpoint):
    llm = LLM(checkpoint, dtype="float32", device="cpu", tensor_parallel_size=2, **ENGINE_ARGS)
    engine = llm.engine
    try:
        engine.add_request(PROMPTS[2], GREEDY)
        engine.step()  # the first prefill chunk ran on both ranks
        (worker,) = engine.executor.group.workers
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


def test_engine_benchmark_at_tp2_reports_the_bytes_all_reduced_per_token(checkpoint):
    workload = Workload(num_requests=4, max_prompt_tokens=32, max_output_tokens=8)
    load_args = dict(dtype="float32", device="cpu")
    report = run_engine_benchmark(str(checkpoint), load_args, workload, tensor_parallel_size=2)
    assert report["tensor_parallel_size"] == 2 and "one_by_one" not in report
    assert report["allreduce_bytes_per_token"] == (2 * 2 + 1) * 64 * 4  # 2 layers, hidden 64
    assert report["engine"]["output_tokens_per_second"] > 0


def fail_to_load(group: TensorParallelGroup) -> None:
    """A worker (spawned: a module-level function) whose shard does not load."""

    def load() -> None:
        raise WeightsError("model.layers.0.mlp.down_proj.weight is missing")

    load_on_every_rank(group, load)


def test_a_worker_that_fails_to_load_is_named_in_one_line_on_rank_0():
    group = init_tensor_parallel(2, "cpu", fail_to_load)
    try:
        with pytest.raises(TensorParallelError) as failed:
            load_on_every_rank(group, lambda: "rank 0 loaded")
    finally:
        group.close()
    assert str(failed.value) == (
        "tensor-parallel rank 1 failed to load: model.layers.0.mlp.down_proj.weight is missing"
    )
    assert group.workers[0].exitcode == 1


# -- the command line and the server -----------------------------------------------------

CLI_GREEDY = ["--dtype", "float32", "--device", "cpu", "--temperature", "0", "--max-tokens", "12"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "qinfer.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_cli_generate_at_tp2_prints_the_tp1_text(checkpoint):
    texts = []
    for size in (1, 2):
        done = run_cli(
            "generate", "--model", str(checkpoint), *CLI_GREEDY,
            "--tensor-parallel-size", str(size), "Hello there",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        texts.append(done.stdout)
    assert texts[1] == texts[0] and texts[0].strip()


def test_cli_refuses_a_size_that_does_not_divide_in_one_line(checkpoint):
    done = run_cli("generate", "--model", str(checkpoint), "--tensor-parallel-size", "3", "Hi")
    assert done.returncode == 2
    assert done.stderr == (
        "qinfer: error: 4 query heads do not divide into 3 ranks; use 1, 2 or 4 ranks\n"
    )


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (its resource tracker excluded)."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            children.append(int(entry.name))
    return children


def test_server_at_tp2_answers_and_exits_when_its_worker_dies(checkpoint, serve):
    running = serve(
        *("--model", str(checkpoint), "--dtype", "float32", "--device", "cpu"),
        *("--tensor-parallel-size", "2", "--num-kv-blocks", "64"),
    )
    server, url = running.process, running.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.completions.create(
        model=checkpoint.name, prompt="Hello there", max_tokens=12, temperature=0
    )
    llm = LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=64)
    (expected,) = llm.generate("Hello there", SamplingParams(max_tokens=12, temperature=0))
    assert reply.choices[0].text == expected.text

    (worker,) = spawned_children(server.pid)
    os.kill(worker, signal.SIGKILL)
    server.wait(timeout=30)  # the watch stops the idle server
    assert server.returncode == 2
    error = "qinfer: error: tensor-parallel rank 1 died (killed by SIGKILL)"
    assert error in server.stderr.read().decode().splitlines()


def test_health_turns_503_when_a_worker_of_an_idle_engine_dies(checkpoint):
    engine = AsyncEngine(
        checkpoint, dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=64
    )
    try:
        http = TestClient(create_app(engine, engine.tokenizer, ServerSettings("qwen3")))
        assert http.get("/health").status_code == 200
        (worker,) = engine.engine.executor.group.workers
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["message"] == "tensor-parallel rank 1 died (killed by SIGKILL)"
    finally:
        engine.shutdown()
