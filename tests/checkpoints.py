"""Random-weight checkpoints built with `transformers`, the numerical oracle of the tests."""

from __future__ import annotations

from pathlib import Path

import torch

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
