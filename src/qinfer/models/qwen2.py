"""Qwen2 / Qwen2.5: q/k/v always carry a bias (its config has no switch for it), o_proj
never does.

Sliding windows (shared with Qwen3 and the MoE variants): only with `use_sliding_window`,
and only on the layers from `max_window_layers` up.
"""

from __future__ import annotations

from typing import Any

from qinfer.core.model_config import FULL_ATTENTION, ModelConfig
from qinfer.models.base import Family, HFConfig, shared_fields, window_from
from qinfer.models.llama import llama_wiring


def qwen_windows(cfg: HFConfig) -> dict[str, Any]:
    """`sliding_window` and `layer_types` of a Qwen config."""
    layers = cfg.number("num_hidden_layers")
    if not cfg.flag("use_sliding_window"):
        return dict(sliding_window=None, layer_types=(FULL_ATTENTION,) * layers)
    return window_from(cfg, layers, first_sliding=int(cfg.get("max_window_layers", 0)))


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen2 config.json -> ModelConfig."""
    wiring = llama_wiring(cfg, qkv_bias=True, o_bias=False)
    return ModelConfig(**shared_fields(cfg, **qwen_windows(cfg), wiring=wiring))


FAMILY = Family(
    name="Qwen2, Qwen2.5",
    model_types=("qwen2",),
    read_config=read_config,
    gguf_architectures=("qwen2",),
)
