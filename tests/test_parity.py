"""Logits of qinfer against transformers, in float32, on random checkpoints of each family."""

import pytest
import torch
from checkpoints import build_checkpoint

import qinfer

CASES = {
    "qwen3": ("qwen3", dict(head_dim=32)),  # head_dim != hidden / heads (64 / 4 = 16)
    "qwen3-mqa-tied": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-odd-ratio": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16)),
    "qwen2-bias": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64)),
    "llama3-rope": (
        "llama",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
    ),
    "llama-yarn": (
        "llama",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),
    ),
    "llama-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral-window": ("mistral", dict(sliding_window=8, head_dim=16)),
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, num_hidden_layers=3),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_checkpoint(folder, family, **overrides)
    model = qinfer.load_model(folder, dtype=torch.float32, device="cpu")
    return reference, model


def reference_logits(reference, tokens):
    with torch.no_grad():
        return reference(tokens).logits.float()


@pytest.mark.parametrize("fast_sdpa", [True, False])
def test_logits_match_transformers(pair, fast_sdpa):
    reference, model = pair
    model.features = qinfer.Features(fast_sdpa=fast_sdpa)
    for layer in model.layers:
        layer.self_attn.features = model.features
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    got = model(tokens)
    want = reference_logits(reference, tokens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 2e-5
