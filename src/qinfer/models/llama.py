"""Llama 2/3.x (and SmolLM2, which is Llama-shaped; Mistral's GGUF files, written as llama).

config.json: `attention_bias` puts a bias on q/k/v and o, `mlp_bias` on the MLP; Llama
never slides (a stray `sliding_window` is ignored, as transformers does). GGUF: llama.cpp's
converter permutes q/k rows for its interleaved RoPE (`weights.gguf` undoes it), and Llama
3.1's RoPE scaling is stored as `rope_freqs.weight`, read by `weights.gguf` for every
architecture.
"""

from __future__ import annotations

from typing import Any

from qinfer.core.model_config import ModelConfig, Wiring
from qinfer.models.base import Family, HFConfig, shared_fields


def llama_wiring(cfg: HFConfig, **differences: Any) -> Wiring:
    """Llama's wiring as its config.json says it, with a related family's `differences`."""
    bias = cfg.flag("attention_bias")
    fields = dict(qkv_bias=bias, o_bias=bias, mlp_bias=cfg.flag("mlp_bias"))
    return Wiring(**{**fields, "hidden_act": cfg.activation(), **differences})


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Llama config.json -> ModelConfig."""
    return ModelConfig(**shared_fields(cfg, wiring=llama_wiring(cfg)))


FAMILY = Family(
    name="Llama 2/3.x, SmolLM2",
    model_types=("llama",),
    read_config=read_config,
    gguf_architectures=("llama",),
    gguf_qk_permuted=True,
)
