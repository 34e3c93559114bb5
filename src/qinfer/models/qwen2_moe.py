"""Qwen2-MoE: Qwen2's attention (q/k/v biases unless `qkv_bias` is false), experts as in
Qwen3-MoE (`models/qwen3_moe.py`), plus a shared expert every token goes through, scaled
by a sigmoid gate. llama.cpp does not renormalise its k routing weights by default."""

from __future__ import annotations

from qinfer.core.model_config import ModelConfig
from qinfer.models.base import Family, HFConfig, shared_fields
from qinfer.models.llama import llama_wiring
from qinfer.models.qwen2 import qwen_windows
from qinfer.models.qwen3_moe import GGUF_MOE_LAYER_NAMES, gguf_experts, read_experts

GGUF_LAYER_NAMES = {
    **GGUF_MOE_LAYER_NAMES,
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen2-MoE config.json -> ModelConfig."""
    wiring = llama_wiring(cfg, qkv_bias=cfg.flag("qkv_bias", True), o_bias=False)
    fields = shared_fields(cfg, **qwen_windows(cfg), wiring=wiring, moe=read_experts(cfg))
    return ModelConfig(**fields)


FAMILY = Family(
    name="Qwen2-MoE",
    model_types=("qwen2_moe",),
    read_config=read_config,
    gguf_architectures=("qwen2moe",),
    gguf_fields=lambda header: gguf_experts(header, renormalise=False),
    gguf_layer_names=GGUF_LAYER_NAMES,
)
