"""Qwen3-Next (`model_type: qwen3_next`): the hybrid layers Qwen3.5 took over
(`models/qwen3_5.py`: Gated DeltaNet and gated attention, zero-centred norms, partial
rotary 0.25) with plain RoPE (no M-RoPE sections), experts as Qwen3-MoE places them
(`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`, default true) plus a shared
expert with its sigmoid gate; the DeltaNet's projections are stored grouped by key head
(`in_proj_qkvz`, `in_proj_ba`: `DeltaNetConfig.grouped_projections`).
"""

from __future__ import annotations

from qinfer.core.model_config import ModelConfig
from qinfer.models.base import Family, HFConfig, rope_config_from_hf, shared_fields
from qinfer.models.qwen3_5 import hybrid_fields
from qinfer.models.qwen3_moe import read_experts


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen3-Next config.json -> ModelConfig."""
    cfg = HFConfig({"norm_topk_prob": True, **cfg.values})
    hybrid = hybrid_fields(cfg, rope_config_from_hf(cfg.values), True)
    return ModelConfig(**shared_fields(cfg, **hybrid, moe=read_experts(cfg)))


FAMILY = Family(
    name="Qwen3-Next",
    model_types=("qwen3_next",),
    read_config=read_config,
)
