"""Qwen3-MoE: Qwen3's attention, and a mixture of experts in the layers the config says.

config.json: a layer i has experts when it is not in `mlp_only_layers` and (i + 1) is a
multiple of `decoder_sparse_step`, as in transformers; `num_experts` is also spelt
`num_local_experts` (transformers 5 writes it so). GGUF: a layer has experts when the file
holds its router (`blk.N.ffn_gate_inp`), each projection's experts stacked in one tensor
(`weights.gguf` reads them apart); the k routing weights are renormalised unless
`expert_weights_norm` says otherwise, as llama.cpp does for qwen3moe.
"""

from __future__ import annotations

from typing import Any

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import ModelConfig, MoeConfig
from qinfer.models.base import GGUF_LAYER_NAMES, Family, GGUFHeader, HFConfig, shared_fields
from qinfer.models.llama import llama_wiring
from qinfer.models.qwen2 import qwen_windows

#: llama.cpp's names of the router (the stacked experts are `weights.gguf`'s EXPERT_NAMES).
GGUF_MOE_LAYER_NAMES = {**GGUF_LAYER_NAMES, "ffn_gate_inp": "mlp.gate"}


def read_experts(cfg: HFConfig) -> MoeConfig:
    """The experts of a Qwen MoE config (`num_experts`, `num_experts_per_tok`,
    `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`,
    and Qwen2-MoE's `shared_expert_intermediate_size`)."""
    experts = cfg.number("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.number("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(
            f"config field 'num_experts_per_tok' ({top_k}) is more than num_experts ({experts})"
        )
    step = cfg.number("decoder_sparse_step", 1)
    shared_key = "shared_expert_intermediate_size"  # absent or 0: no shared expert
    dense = cfg.layer_indices("mlp_only_layers")
    layers = cfg.number("num_hidden_layers")
    return MoeConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=cfg.number("moe_intermediate_size"),
        norm_topk_prob=cfg.flag("norm_topk_prob"),
        sparse_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=cfg.number(shared_key) if cfg.get(shared_key) else 0,
    )


def gguf_experts(header: GGUFHeader, renormalise: bool) -> dict[str, Any]:
    """`{arch}.expert_*` metadata -> config.json's expert fields; `renormalise`: llama.cpp's
    default for `expert_weights_norm` in this architecture."""
    layers = int(header.need("block_count"))
    return {
        "num_experts": header.need("expert_count"),
        "num_experts_per_tok": header.need("expert_used_count"),
        "moe_intermediate_size": header.need("expert_feed_forward_length"),
        "norm_topk_prob": bool(header.get("expert_weights_norm", renormalise)),
        "shared_expert_intermediate_size": header.get("expert_shared_feed_forward_length"),
        "mlp_only_layers": [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in header.tensor_names
        ],
    }


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen3-MoE config.json -> ModelConfig."""
    wiring = llama_wiring(cfg, qk_norm=True)
    fields = shared_fields(cfg, **qwen_windows(cfg), wiring=wiring, moe=read_experts(cfg))
    return ModelConfig(**fields)


FAMILY = Family(
    name="Qwen3-MoE",
    model_types=("qwen3_moe",),
    read_config=read_config,
    gguf_architectures=("qwen3moe",),
    gguf_fields=lambda header: gguf_experts(header, renormalise=True),
    gguf_layer_names=GGUF_MOE_LAYER_NAMES,
)
