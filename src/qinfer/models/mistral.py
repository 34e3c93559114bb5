"""Mistral: Llama's blocks, with `sliding_window` (int or null) on every layer.

Mistral's GGUF files are written as llama (`models/llama.py`).
"""

from __future__ import annotations

from qinfer.core.model_config import ModelConfig
from qinfer.models.base import Family, HFConfig, shared_fields, window_from
from qinfer.models.llama import llama_wiring


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Mistral config.json -> ModelConfig."""
    windows = window_from(cfg, cfg.number("num_hidden_layers"))
    return ModelConfig(**shared_fields(cfg, **windows, wiring=llama_wiring(cfg)))


FAMILY = Family(name="Mistral", model_types=("mistral",), read_config=read_config)
