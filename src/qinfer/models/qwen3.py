"""Qwen3: RMSNorm over head_dim on q and k before RoPE (QK-norm); Qwen's sliding windows
(`models/qwen2.py`)."""

from __future__ import annotations

from qinfer.core.model_config import ModelConfig
from qinfer.models.base import Family, HFConfig, shared_fields
from qinfer.models.llama import llama_wiring
from qinfer.models.qwen2 import qwen_windows


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen3 config.json -> ModelConfig."""
    wiring = llama_wiring(cfg, qk_norm=True)
    return ModelConfig(**shared_fields(cfg, **qwen_windows(cfg), wiring=wiring))


FAMILY = Family(
    name="Qwen3",
    model_types=("qwen3",),
    read_config=read_config,
    gguf_architectures=("qwen3",),
)
