"""Save a random-weight checkpoint shaped exactly like Qwen3-0.6B, the stand-in for speed work.

    python bench/make_qwen3_0p6b.py /tmp/qwen3-0.6b-random
    qinfer bench --model /tmp/qwen3-0.6b-random --compare-hf

Same shapes as the real model (28 layers, hidden 1024, 16 query / 8 KV heads of 128,
vocab 151936, tied embeddings; ~0.6 B parameters, ~1.2 GB in bfloat16), so every matmul
and every byte read per token matches; only the values are random. No tokenizer is saved:
`qinfer bench` works on token ids.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

# config.json of Qwen/Qwen3-0.6B (the fields that shape the network).
QWEN3_0P6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
)


def save(folder: Path, config_class: type, model_class: type, **fields) -> None:
    """Build a random `model_class` in bfloat16 (half the memory, no cast copy) and save it."""
    torch.set_default_dtype(torch.bfloat16)
    model = model_class(config_class(**fields)).eval()
    model.save_pretrained(folder)
    count = sum(p.numel() for p in model.parameters())
    print(f"saved {count / 1e9:.3f} B parameters (bfloat16) to {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to save the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    save(args.folder, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **QWEN3_0P6B)


if __name__ == "__main__":
    main()
