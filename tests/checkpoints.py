"""Random-weight checkpoints built with `transformers`, the numerical oracle of the tests."""

from __future__ import annotations

from pathlib import Path

import torch

import qinfer

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

#: Families the cache and batch tests run on: full attention with GQA and QK-norm, a
#: sliding window on every layer, and a window only on the upper layers.
WINDOWED = {
    "qwen3": ("qwen3", dict(head_dim=32)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, num_hidden_layers=3),
    ),
}


def build_checkpoint(folder: Path, family: str, seed: int = 0, **overrides):
    """Save a random `family` model (qwen3, qwen2, llama, mistral) to `folder`; return the HF model."""
    import transformers

    classes = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_class, model_class = classes[family]
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Random init leaves norms at 1 and biases at 0: perturb every tensor so that each
    # weight actually matters to the comparison.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    return model


def load_pair(folder: Path, family: str, **overrides):
    """(transformers model, qinfer model in float32 on CPU) of one random checkpoint."""
    reference = build_checkpoint(folder, family, **overrides)
    return reference, qinfer.load_model(folder, dtype=torch.float32, device="cpu")


def reference_logits(reference, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits (B, L, V) for tokens (B, L), no padding, no cache."""
    with torch.no_grad():
        return reference(tokens).logits.float()


def random_tokens(batch: int, length: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    """(batch, length) random token ids, reproducible by seed."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def use_features(model, features) -> None:
    """Switch a loaded model's attention layers to other `qinfer.Features`."""
    model.features = features
    for layer in model.layers:
        layer.self_attn.features = features


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors of the same shape."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()
