"""Qwen3.5-MoE and Qwen3.6-MoE (`model_type: qwen3_5_moe`, its text model
`qwen3_5_moe_text`): Qwen3.5's hybrid layers (`models/qwen3_5.py`) with a mixture of
experts in every layer, plus a shared expert scaled by a sigmoid gate (Qwen2-MoE's,
`layers/moe.py`); the k routing weights are always renormalised to sum to 1, as
transformers' `Qwen3_5MoeTopKRouter` does (the config has no `norm_topk_prob`).

GGUF: llama.cpp's `qwen35moe`, read as Qwen3.5's `qwen35` (`models/qwen3_5.py`) with the
experts' metadata and tensors as Qwen2-MoE's (`models/qwen2_moe.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qinfer.core.model_config import ModelConfig
from qinfer.models.base import Family, GGUFHeader, HFConfig, shared_fields
from qinfer.models.qwen2_5_vl import vl_text_config
from qinfer.models.qwen2_moe import GGUF_LAYER_NAMES as GGUF_MOE_LAYER_NAMES
from qinfer.models.qwen3_5 import (
    DEFAULTS,
    GGUF_HYBRID_LAYER_NAMES,
    gguf_fields,
    hybrid_fields,
    hybrid_rope,
    image_token,
)
from qinfer.models.qwen3_moe import gguf_experts, read_experts


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen3.5-MoE config.json (its text model) -> ModelConfig."""
    if cfg.model_type != "qwen3_5_moe_text":
        cfg = vl_text_config(cfg, "qwen3_5_moe_text", DEFAULTS)
    # Every layer has experts: no dense FFN, whose width the config need not give.
    values = {**DEFAULTS, **cfg.values, "mlp_only_layers": [], "decoder_sparse_step": 1}
    values.setdefault("intermediate_size", values.get("moe_intermediate_size"))
    cfg = HFConfig(values)
    moe = dataclasses.replace(read_experts(cfg), norm_topk_prob=True)
    hybrid = hybrid_fields(cfg, hybrid_rope(cfg))
    return ModelConfig(**shared_fields(cfg, **hybrid, moe=moe, image_token_id=image_token(cfg)))


def gguf_moe_fields(header: GGUFHeader) -> dict[str, Any]:
    """A qwen35moe file's fields: Qwen3.5's and the experts' (renormalised, as above)."""
    fields = {**gguf_experts(header, renormalise=True), **gguf_fields(header)}
    return {**fields, "model_type": "qwen3_5_moe_text"}


FAMILY = Family(
    name="Qwen3.5-MoE / Qwen3.6-MoE",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    read_config=read_config,
    gguf_architectures=("qwen35moe",),
    gguf_fields=gguf_moe_fields,
    gguf_layer_names={**GGUF_MOE_LAYER_NAMES, **GGUF_HYBRID_LAYER_NAMES},
    gguf_value_heads_tiled=True,
)
