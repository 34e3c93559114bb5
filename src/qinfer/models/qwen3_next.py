"""Qwen3-Next (`model_type: qwen3_next`): the hybrid layers Qwen3.5 took over
(`models/qwen3_5.py`: Gated DeltaNet and gated attention, zero-centred norms, partial
rotary 0.25) with plain RoPE (no M-RoPE sections), experts as Qwen3-MoE places them
(`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`, default true) plus a shared
expert with its sigmoid gate; the DeltaNet's projections are stored grouped by key head
(`in_proj_qkvz`, `in_proj_ba`: `DeltaNetConfig.projections`).

GGUF (llama.cpp's `qwen3next`, written by its converter's `Qwen3NextModel`): Qwen3.5's
metadata and tensor names (`gguf_hybrid_fields`), the experts' as Qwen2-MoE's. The converter
splits `in_proj_qkvz` into `attn_qkv` (every head's q, then k, then v: Qwen3.5's
`in_proj_qkv`) and `attn_gate` (z), and keeps `in_proj_ba` grouped as `ssm_ba`; the layer
reads those three as they are (GGUF_PROJECTIONS). The value heads stay in Hugging Face's
order (no tiling, unlike qwen35).
"""

from __future__ import annotations

from typing import Any

from qinfer.core.model_config import GROUPED_PROJECTIONS, ModelConfig
from qinfer.models.base import Family, GGUFHeader, HFConfig, rope_config_from_hf, shared_fields
from qinfer.models.qwen2_moe import GGUF_LAYER_NAMES as GGUF_MOE_LAYER_NAMES
from qinfer.models.qwen3_5 import GGUF_HYBRID_LAYER_NAMES, gguf_hybrid_fields, hybrid_fields
from qinfer.models.qwen3_moe import gguf_experts, read_experts

#: The DeltaNet's input projections of a qwen3next file, and the config field (not one of
#: config.json's: `gguf_fields` sets it) that says a config was read from one.
GGUF_PROJECTIONS = ("qkv", "z", "ba")
PROJECTIONS_FIELD = "gguf_deltanet_projections"


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen3-Next config.json (or a qwen3next file's fields) -> ModelConfig."""
    cfg = HFConfig({"norm_topk_prob": True, **cfg.values})
    projections = tuple(cfg.get(PROJECTIONS_FIELD) or GROUPED_PROJECTIONS)
    hybrid = hybrid_fields(cfg, rope_config_from_hf(cfg.values), projections)
    return ModelConfig(**shared_fields(cfg, **hybrid, moe=read_experts(cfg)))


def gguf_fields(header: GGUFHeader) -> dict[str, Any]:
    """A qwen3next file's fields: the hybrid layers, the experts (renormalised, as
    config.json's default), the DeltaNet's projections as the converter stores them."""
    fields = {**gguf_experts(header, renormalise=True), **gguf_hybrid_fields(header)}
    return {**fields, PROJECTIONS_FIELD: list(GGUF_PROJECTIONS)}


FAMILY = Family(
    name="Qwen3-Next",
    model_types=("qwen3_next",),
    read_config=read_config,
    gguf_architectures=("qwen3next",),
    gguf_fields=gguf_fields,
    gguf_layer_names={
        **GGUF_MOE_LAYER_NAMES,
        **GGUF_HYBRID_LAYER_NAMES,
        "ssm_ba": "linear_attn.in_proj_ba",
    },
)
