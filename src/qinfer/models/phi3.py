"""Phi-3 and Phi-4-mini: Llama's blocks with q/k/v and gate/up fused in the checkpoint,
LongRoPE and partial rotary.

config.json: `self_attn.qkv_proj` stacks q, k and v by rows and `mlp.gate_up_proj` stacks
gate and up (read apart by name: `fused_tensors`); no biases. RoPE: `rope_scaling` (or
`rope_parameters`) of type "longrope" ("su" and "yarn" mean it too, as in transformers)
with `short_factor` and `long_factor`; the top-level `original_max_position_embeddings`
(default 4096) wins over the one in the RoPE settings, and `max_position_embeddings /
original_max_position_embeddings` is the factor its attention scale follows.
`partial_rotary_factor` (Phi-4-mini: 0.75) rotates the first part of each head only.
`sliding_window`, where set, applies to every layer.

GGUF (llama.cpp's "phi3"): `blk.N.attn_qkv` and `blk.N.ffn_up` (gate then up) stay fused,
`rope.dimension_count` says the rotary dims, LongRoPE's factors are the tensors
`rope_factors_long` / `rope_factors_short` and its attention scale
`rope.scaling.attn_factor`; a `sliding_window` of 0 means none.
"""

from __future__ import annotations

from typing import Any

from qinfer.core.model_config import ModelConfig, Wiring
from qinfer.models.base import (
    GGUF_LAYER_NAMES,
    Family,
    FusedTensor,
    GGUFHeader,
    HFConfig,
    rope_config_from_hf,
    shared_fields,
    window_from,
)

LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Phi-3 / Phi-4-mini config.json -> ModelConfig."""
    rope: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            rope.update(cfg.get(key))
    kind = rope.get("rope_type", rope.get("type"))
    if kind is not None:
        rope["rope_type"] = "longrope" if kind in ("su", "yarn") else kind
        rope.pop("type", None)
    if rope.get("rope_type") == "longrope":
        original = cfg.number("original_max_position_embeddings", 4096)
        rope["original_max_position_embeddings"] = original
    values = {**cfg.values, "rope_scaling": None, "rope_parameters": rope}
    layers = cfg.number("num_hidden_layers")
    wiring = Wiring(hidden_act=cfg.activation())  # no biases, whatever the config says
    rope_config = rope_config_from_hf(values)
    fields = shared_fields(cfg, rope=rope_config, **window_from(cfg, layers), wiring=wiring)
    return ModelConfig(**fields)


def fused_tensors(config: ModelConfig) -> tuple[FusedTensor, ...]:
    """q/k/v stacked in qkv_proj (Hq * D, Hkv * D, Hkv * D rows); gate then up in
    gate_up_proj (intermediate rows each)."""
    q, kv = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    inter = config.intermediate_size
    return (
        FusedTensor(
            "self_attn.qkv_proj",
            (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
        ),
        FusedTensor("mlp.gate_up_proj", (("mlp.gate_proj", inter), ("mlp.up_proj", inter))),
    )


def gguf_fields(header: GGUFHeader) -> dict[str, Any]:
    """The window (0: none) and, where the file holds its factors, LongRoPE."""
    fields: dict[str, Any] = {"sliding_window": header.get("attention.sliding_window") or None}
    if LONG_FACTORS in header.tensor_names:
        original = header.need("rope.scaling.original_context_length")
        fields["original_max_position_embeddings"] = original
        fields["rope_parameters"] = {
            "rope_type": "longrope",
            "long_factor": header.read_floats(LONG_FACTORS),
            "short_factor": header.read_floats(SHORT_FACTORS),
            "attention_factor": header.get("rope.scaling.attn_factor"),
        }
    return fields


FAMILY = Family(
    name="Phi-3, Phi-4-mini",
    model_types=("phi3",),
    read_config=read_config,
    gguf_architectures=("phi3",),
    gguf_fields=gguf_fields,
    gguf_layer_names={
        **GGUF_LAYER_NAMES,
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
    },
    fused_tensors=fused_tensors,
)
