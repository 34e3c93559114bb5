"""Tensor parallelism, stage 1 (the model core): two ranks give the single-process logits.

Two processes (torch.multiprocessing, spawned once for the whole module) join a gloo group,
load each checkpoint's shards and run the same inputs; every rank's logits must equal the
world-1 model's in fp32. What needs no communication (the shards' contents and bytes, the
refusals) is checked in this process: loading a shard exchanges nothing.
"""

from __future__ import annotations

import datetime
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoints import (
    GEMMA3,
    QWEN2_MOE,
    QWEN3_MOE,
    SMOLLM3,
    build_checkpoint,
    llama3_rope,
    max_diff,
    phi3_longrope,
    random_tokens,
)
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf_model

import qinfer
from qinfer.core.errors import QinferError, WeightsError
from qinfer.core.parallel import Parallel, tensor_parallel_sizes
from qinfer.linear import RowParallelLinear, VocabParallelLinear, quantize_int8

WORLD = 2
TOLERANCE = 1e-5  # fp32; the ranks' partial sums are added in another order

#: Random checkpoints: (family, config overrides).
CHECKPOINTS = {
    "qwen3": ("qwen3", dict(head_dim=32)),  # QK-norm, head_dim != hidden / heads
    "qwen3-1kv": ("qwen3", dict(num_key_value_heads=1, head_dim=32)),  # KV head replicated
    "llama3-untied": (  # llama3 RoPE, own lm_head, o_proj and down_proj biases (row-parallel)
        "llama",
        dict(**llama3_rope(64), tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    ),
    "llama3-tied": (  # a vocabulary of 255 is padded to 256: the last rank holds 127 rows
        "llama",
        dict(**llama3_rope(64), tie_word_embeddings=True, vocab_size=255),
    ),
    "qwen2": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=4)),  # q/k/v biases
    "mistral-window": ("mistral", dict(sliding_window=8, head_dim=16)),  # rotating caches
    # experts' FFN split by channels (64: a rank's 32 down columns are one int4 group)
    "qwen3-moe": ("qwen3_moe", dict(QWEN3_MOE, moe_intermediate_size=64)),
    "qwen2-moe": ("qwen2_moe", QWEN2_MOE),  # the shared expert split like the experts
    "gemma3": ("gemma3", GEMMA3),  # GeGLU, (1 + w) sandwich norms, a RoPE per layer kind
    # each rank's q/k/v and gate/up rows read out of the fused tensors; LongRoPE, partial rotary
    "phi3": ("phi3", dict(phi3_longrope(16), num_key_value_heads=2)),
    "smollm3": ("smollm3", SMOLLM3),  # a layer without RoPE, sliding
}
#: What each rank loads: (checkpoint, load_model keywords besides dtype float32). Shards
#: of int4 groups are the world-1 groups (shares of whole groups), so they match exactly.
LOADS = {
    **{name: (name, {}) for name in CHECKPOINTS},
    "qwen3-int4": ("qwen3", dict(quantize="int4")),
    "qwen3-moe-int4": ("qwen3-moe", dict(quantize="int4")),  # experts looped, not grouped
    "llama-gguf-q4_0": ("llama-gguf", {}),  # Q4_0 blocks dequantized: shards in whole blocks
}


STEPS = ("full", "prefill", "decode")


def run_model(model: qinfer.Transformer) -> dict[str, torch.Tensor]:
    """The logits of a full forward and of a left-padded prefill + 3 decode steps (STEPS),
    and "kv_heads": how many KV heads a layer's cache holds."""
    tokens = random_tokens(2, 12, vocab=model.config.vocab_size)
    cache = model.make_cache(2, left_padding=[0, 3])
    prefill = model(tokens[:, :9], cache=cache)
    decode = [model(tokens[:, i : i + 1], cache=cache) for i in range(9, 12)]
    return {
        "full": model(tokens),
        "prefill": prefill,
        "decode": torch.cat(decode, dim=1),
        "kv_heads": torch.tensor(cache[0].keys.shape[1]),
    }


def load(folder, parallel: Parallel | None = None, **options) -> qinfer.Transformer:
    return qinfer.load_model(folder, dtype="float32", device="cpu", parallel=parallel, **options)


def rank_main(rank: int, port: int, loads: dict, results) -> None:
    """One rank: join the group, run every load, put (rank, logits by load) or a traceback.

    The logits travel as numpy arrays, pickled by value: a tensor would travel as shared
    memory that the parent fetches from this process, which may have exited by then.
    """
    torch.set_num_threads(1)  # two ranks on two shared cores
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=30),  # a lost peer fails the test, never hangs
        )
        parallel = Parallel(rank, WORLD)
        logits = {
            name: {
                step: t.numpy() for step, t in run_model(load(path, parallel, **options)).items()
            }
            for name, (path, options) in loads.items()
        }
        results.put((rank, logits))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    built = {}
    for name, (family, overrides) in CHECKPOINTS.items():
        built[name] = tmp_path_factory.mktemp(name)
        build_checkpoint(built[name], family, **overrides)
    reference = build_checkpoint(tmp_path_factory.mktemp("llama-hf"), "llama")
    path = tmp_path_factory.mktemp("llama-gguf") / "model.gguf"
    built["llama-gguf"] = write_gguf_model(reference, path, "llama", Q.Q4_0)
    return built


@pytest.fixture(scope="module")
def ranks(folders) -> dict[int, dict]:
    """Every rank's logits for every load: one spawn of WORLD processes for the module."""
    loads = {name: (folders[path], options) for name, (path, options) in LOADS.items()}
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=rank_main, args=(rank, port, loads, results))
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    try:
        got = dict(results.get(timeout=120) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
    failed = {rank: out for rank, out in got.items() if isinstance(out, str)}
    assert not failed, "\n".join(f"rank {rank}:\n{out}" for rank, out in failed.items())
    return got


@pytest.mark.parametrize("name", sorted(LOADS))
def test_two_ranks_give_the_single_process_logits(ranks, folders, name):
    path, options = LOADS[name]
    expected = run_model(load(folders[path], **options))
    for rank in range(WORLD):
        for step in STEPS:
            diff = max_diff(torch.from_numpy(ranks[rank][name][step]), expected[step])
            assert diff < TOLERANCE, (rank, step, diff)


@pytest.mark.parametrize("name, kv_heads", [("qwen3", 1), ("qwen3-1kv", 1), ("qwen2", 2)])
def test_a_rank_caches_only_its_kv_heads(ranks, name, kv_heads):
    # qwen3: 2 KV heads split; qwen3-1kv: its one KV head on both ranks; qwen2: 4 split.
    assert [int(ranks[rank][name]["kv_heads"]) for rank in range(WORLD)] == [kv_heads] * WORLD


# ------------------------------------------------------------- one rank's shard, no group


def rank_models(folder, **options) -> list[qinfer.Transformer]:
    """The shards of every rank, loaded in this process (loading exchanges nothing)."""
    return [load(folder, Parallel(rank, WORLD), **options) for rank in range(WORLD)]


def held_bytes(model: qinfer.Transformer) -> int:
    """Bytes of weights the model holds: its projections and its norms."""
    norms = [model.norm] + [norm for layer in model.layers for norm in layer.norms()]
    return sum(w.nbytes for w in model.linears().values()) + sum(n.weight.nbytes for n in norms)


@pytest.mark.parametrize("name", ["qwen3", "llama3-untied"])
def test_a_rank_holds_about_half_of_the_weight_bytes(folders, name):
    whole = held_bytes(load(folders[name]))
    for model in rank_models(folders[name]):
        share = held_bytes(model) / whole
        assert 0.5 <= share < 0.52, share  # norms and row-parallel biases are replicated


def test_shards_are_the_slices_of_the_whole_weights(folders):
    whole = load(folders["qwen3"])
    q_rows, kv_rows, D = 4 * 32 // WORLD, 2 * 32 // WORLD, 32
    for rank, model in enumerate(rank_models(folders["qwen3"])):
        attention, full = model.layers[1].self_attn, whole.layers[1].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
        q, k, v = full.wqkv.dequantize().split([4 * D, 2 * D, 2 * D])
        rows = (
            slice(rank * q_rows, (rank + 1) * q_rows),
            slice(rank * kv_rows, (rank + 1) * kv_rows),
        )
        assert torch.equal(
            attention.wqkv.dequantize(), torch.cat([q[rows[0]], k[rows[1]], v[rows[1]]])
        )
        assert isinstance(attention.wo, RowParallelLinear)
        assert torch.equal(attention.wo.dequantize(), full.wo.dequantize()[:, rows[0]])


def test_the_vocabulary_is_split_by_rows_padded_to_the_world(folders):
    whole = load(folders["llama3-tied"]).embed_tokens.dequantize()  # 255 rows
    for rank, model in enumerate(rank_models(folders["llama3-tied"])):
        assert isinstance(model.embed_tokens, VocabParallelLinear)
        assert model.lm_head is model.embed_tokens  # tied: one table, split once
        vocab = range(128 * rank, min(128 * (rank + 1), 255))  # rank 1: 127 rows and 1 pad
        assert model.embed_tokens.vocab == vocab
        assert torch.equal(model.embed_tokens.dequantize(), whole[vocab.start : vocab.stop])


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_quantized_shards_are_quantized_from_their_slices(folders, quantize):
    dense = load(folders["qwen3"]).layers[0].mlp
    whole = load(folders["qwen3"], quantize=quantize).layers[0].mlp
    for rank, model in enumerate(rank_models(folders["qwen3"], quantize=quantize)):
        mlp, channels = model.layers[0].mlp, slice(rank * 64, (rank + 1) * 64)
        gate, up = whole.gate_up.dequantize().chunk(2)
        assert torch.equal(mlp.gate_up.dequantize(), torch.cat([gate[channels], up[channels]]))
        if quantize == "int4":  # whole groups: the world-1 groups themselves
            expected = whole.down.dequantize()[:, channels]
        else:  # int8 rows of the rank's columns take their own scale per row
            expected = quantize_int8(dense.down.dequantize()[:, channels]).dequantize()
        torch.testing.assert_close(mlp.down.dequantize(), expected, rtol=0, atol=0)


def test_gguf_int4_blocks_shard_bit_for_bit(folders):
    path = folders["llama-gguf"]
    whole = qinfer.load_model(path, device="cpu").layers[0]  # Q4_0 kept as int4 groups
    for rank in range(WORLD):
        layer = qinfer.load_model(path, device="cpu", parallel=Parallel(rank, WORLD)).layers[0]
        q_rows = slice(rank * 32, (rank + 1) * 32)  # 2 of 4 heads of 16, unpermuted alone
        assert torch.equal(
            layer.self_attn.wqkv.dequantize()[:32], whole.self_attn.wqkv.dequantize()[q_rows]
        )
        assert torch.equal(
            layer.self_attn.wo.dequantize(), whole.self_attn.wo.dequantize()[:, q_rows]
        )
        channels = slice(rank * 64, (rank + 1) * 64)
        assert torch.equal(layer.mlp.down.dequantize(), whole.mlp.down.dequantize()[:, channels])


# ------------------------------------------------------------------------- refusals


def test_a_size_that_does_not_divide_the_heads_is_refused(tmp_path):
    # SmolLM2's shape in small: 9 query heads, 3 KV heads, an FFN that 3 divides and 9 does not.
    build_checkpoint(
        tmp_path,
        "llama",
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=1,
    )
    with pytest.raises(
        QinferError, match=r"^9 query heads do not divide into 2 ranks; use 1 or 3 ranks$"
    ):
        load(tmp_path, Parallel(0, 2))
    with pytest.raises(
        QinferError, match=r"^96 FFN channels do not divide into 9 ranks; use 1 or 3"
    ):
        load(tmp_path, Parallel(0, 9))


def test_tensor_parallel_sizes():
    assert tensor_parallel_sizes(9, 3, 1536) == [1, 3]  # SmolLM2-135M
    assert tensor_parallel_sizes(16, 8, 3072) == [1, 2, 4, 8, 16]  # Qwen3-0.6B
    assert tensor_parallel_sizes(12, 4, 48) == [1, 2, 4, 12]  # 6 ranks would split a group
    # KV heads replicated: each rank reads the KV head of its whole group of query heads.
    heads = [Parallel(rank, 4).attention_heads(8, 2) for rank in range(4)]
    assert heads == [(range(2 * r, 2 * r + 2), range(r // 2, r // 2 + 1)) for r in range(4)]
    with pytest.raises(QinferError, match="rank 2 is outside a tensor-parallel world of 2"):
        Parallel(2, 2)


def test_int4_groups_that_would_straddle_ranks_are_refused_naming_the_layer(tmp_path):
    # o_proj takes 4 heads of 8 = 32 input columns: one Q4_0 block, 16 columns per rank.
    reference = build_checkpoint(tmp_path / "hf", "llama", head_dim=8)
    path = write_gguf_model(reference, tmp_path / "model.gguf", "llama", Q.Q4_0)
    with pytest.raises(
        WeightsError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight'.*straddle"
    ):
        qinfer.load_model(path, device="cpu", parallel=Parallel(1, WORLD))
    # Dequantized, the whole block is decoded and each rank keeps its 16 columns.
    whole = load(path).layers[0].self_attn.wo.dequantize()
    shard = load(path, Parallel(1, WORLD)).layers[0].self_attn.wo.dequantize()
    assert torch.equal(shard, whole[:, 16:])
    # Groups quantized at load must fit a rank's share too.
    with pytest.raises(
        WeightsError, match=r"o_proj\.weight' split over 2 ranks: int4 group size 32"
    ):
        load(tmp_path / "hf", Parallel(0, WORLD), quantize="int4", group_size=32)
