"""Logits of qinfer against transformers, in float32, on random checkpoints of each family."""

import copy
import json

import pytest
import torch
from checkpoints import (
    GEMMA3,
    YARN_ROPE,
    build_checkpoint,
    llama3_rope,
    load_pair,
    max_diff,
    random_tokens,
    reference_logits,
    use_features,
)

import qinfer
from qinfer.linear.compute import bf16_matmul_is_fast

TOLERANCE = 2e-5  # fp32; logits are of order 1
HALF_TOLERANCE = 0.05  # a bf16/fp16 load against the fp32 reference (measured 0.011 / 0.001)

CASES = {
    "qwen3": ("qwen3", dict(head_dim=32)),  # head_dim != hidden / heads (64 / 4 = 16)
    "qwen3-mqa-tied": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-odd-ratio": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16)),
    "qwen2-bias": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64)),
    "llama3-rope": ("llama", dict(**llama3_rope(64), tie_word_embeddings=False)),
    "llama-yarn": ("llama", YARN_ROPE),
    "llama-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama-dynamic": ("llama", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "mistral-window": ("mistral", dict(sliding_window=8, head_dim=16)),
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, num_hidden_layers=3),
    ),
    "gemma3": ("gemma3", GEMMA3),
    "gemma3-vision": ("gemma3-vision", GEMMA3),  # the text model of a multimodal folder
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    return load_pair(tmp_path_factory.mktemp(request.param), family, **overrides)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, 40)


@pytest.mark.parametrize("fast_sdpa", [True, False])
def test_logits_match_transformers(pair, tokens, fast_sdpa):
    reference, model = pair
    use_features(model, qinfer.Features(fast_sdpa=fast_sdpa))
    assert max_diff(model(tokens), reference_logits(reference, tokens)) < TOLERANCE


def test_last_only_is_the_last_position(pair, tokens):
    reference, model = pair
    got = model(tokens, last_only=True)
    assert max_diff(got, reference_logits(reference, tokens)[:, -1:]) < TOLERANCE


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-for-loads")
    return folder, build_checkpoint(folder, "qwen3", head_dim=32)


def test_sharded_checkpoint(qwen3_folder, tmp_path, tokens):
    _, reference = qwen3_folder
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = qinfer.load_model(tmp_path, dtype="float32", device="cpu")
    assert max_diff(model(tokens), reference_logits(reference, tokens)) < TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_stays_close_to_float32(qwen3_folder, tokens, dtype):
    folder, reference = qwen3_folder
    model = qinfer.load_model(folder, dtype=dtype, device="cpu")
    attention = model.layers[0].self_attn
    assert {
        model.embed_tokens.weight.dtype,
        attention.wqkv.weight.dtype,
        attention.q_norm.weight.dtype,
    } == {dtype}
    logits = model(tokens)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert max_diff(logits, reference_logits(reference, tokens)) < HALF_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_left_padded_batch_has_no_nan(qwen3_folder, dtype):
    folder, _ = qwen3_folder
    model = qinfer.load_model(folder, dtype=dtype, device="cpu")
    cache = model.make_cache(3, left_padding=[0, 10, 30])
    assert torch.isfinite(model(random_tokens(3, 40), cache=cache)).all()
    assert torch.isfinite(model(random_tokens(3, 1), cache=cache)).all()


def test_checkpoint_stored_in_bfloat16_computes_in_the_faster_dtype(qwen3_folder, tmp_path):
    """bf16 where this CPU multiplies bf16 natively (AVX512-BF16, AMX), else fp32 (AVX2
    only: ~8x slower in bf16); the verdict is the CPU class's, the same in every process."""
    _, reference = qwen3_folder
    copy.deepcopy(reference).to(torch.bfloat16).save_pretrained(tmp_path)
    model = qinfer.load_model(tmp_path, device="cpu")
    fast = bf16_matmul_is_fast(torch.device("cpu"))
    expected = torch.bfloat16 if fast else torch.float32
    assert model.dtype == expected and model.embed_tokens.weight.dtype == expected
    assert qinfer.load_model(tmp_path, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
