"""Qwen3.5 and Qwen3.6 (`model_type: qwen3_5`, its text model `qwen3_5_text`): a hybrid of
Gated DeltaNet layers and gated full attention, as transformers' `modeling_qwen3_5.py`.

config.json: `layer_types` names each layer's kind, `linear_attention` (a Gated DeltaNet,
`layers/gated_deltanet.py`) or `full_attention`; absent, every `full_attention_interval`-th
layer (4) is full attention, the others linear, as transformers fills it. The DeltaNet's
shapes are `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
`linear_value_head_dim`, `linear_conv_kernel_dim`. Full attention is Qwen3's (QK-norm) with
an output gate (q_proj twice as wide), partial rotary (`partial_rotary_factor`, 0.25 by
default) and interleaved M-RoPE sections where the config gives `mrope_section` (the
released checkpoints' (11, 11, 10)): a text token's three positions are one, so text runs
as plain RoPE, and a config without sections is read as that. Every RMSNorm but the
DeltaNet's gated one is zero-centred (scale 1 + w).

The multimodal config (`qwen3_5`) keeps the text model's fields under `text_config` and its
tensors under `model.language_model.*`, its vision tower (Qwen3-VL's without DeepStack,
`qinfer.vision`) under `model.visual.*`; its `image_token_id` marks the rows an image's
embeddings take. A text config (`qwen3_5_text`) has no image token.

GGUF (llama.cpp's `qwen35`, written by its converter's `Qwen3_5TextModel`): the DeltaNet's
shapes are `ssm.*` metadata (`gguf_hybrid_fields`), the layer kinds
`attention.recurrent_layers`, the M-RoPE sections `rope.dimension_sections`; the DeltaNet's
tensors are `attn_qkv`, `attn_gate` (z), `ssm_beta`, `ssm_alpha`, `ssm_conv1d`, `ssm_a`,
`ssm_dt.bias`, `ssm_norm`, `ssm_out`, stored as `weights.gguf_deltanet` undoes (value heads
tiled, A as -exp(A_log)), every norm but the DeltaNet's as 1 + w. A file with the MTP head
(`nextn_predict_layers`) holds it as extra blocks after the model's: not the model's layers,
they load as its `mtp.*` tensors (`qinfer.weights.gguf`, `qinfer.model.mtp_head`) when asked.
The image token is found by its text in the vocabulary (`vl_gguf_fields`); the vision tower
is llama.cpp's projector file's (`qinfer.vision.mmproj`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SPLIT_PROJECTIONS,
    DeltaNetConfig,
    ModelConfig,
    RopeConfig,
)
from qinfer.models.base import (
    GGUF_LAYER_NAMES,
    Family,
    GGUFHeader,
    HFConfig,
    rope_config_from_hf,
    shared_fields,
)
from qinfer.models.llama import llama_wiring
from qinfer.models.qwen2_5_vl import mrope_config, vl_gguf_fields, vl_text_config

#: What transformers assumes where a Qwen3.5 text config leaves fields out.
DEFAULTS: dict[str, Any] = {"max_position_embeddings": 32768, "head_dim": 256}
PARTIAL_ROTARY_FACTOR = 0.25
#: The M-RoPE sections llama.cpp's converter writes where a checkpoint gives none.
CONVERTER_SECTIONS = [11, 11, 10]
#: llama.cpp's names of a hybrid layer's tensors (`weights.gguf.hf_tensor_name`): the norm
#: before the MLP is `post_attention_norm`; the DeltaNet's, some of them whole names.
GGUF_HYBRID_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}


def hybrid_rope(cfg: HFConfig) -> RopeConfig:
    """Qwen3.5's RoPE: interleaved M-RoPE with the config's `mrope_section`, plain RoPE
    where it gives none (the same rotation for text)."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    section = params.get("mrope_section")
    if section is None:
        return rope_config_from_hf({**cfg.values, "rope_parameters": params})
    return mrope_config(cfg, tuple(section), interleaved=True)


def hybrid_fields(
    cfg: HFConfig, rope: RopeConfig, projections: tuple[str, ...] = SPLIT_PROJECTIONS
) -> dict[str, Any]:
    """The ModelConfig fields every hybrid family reads alike: the layer kinds, the
    DeltaNet's shapes (its input projections as the checkpoint stores them: `projections`),
    the gated attention's wiring and zero-centred norms, `rope` with its partial rotary
    factor (0.25 where the config gives none)."""
    layers = cfg.number("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = cfg.number("full_attention_interval", 4)
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    if not isinstance(kinds, list) or not all(isinstance(kind, str) for kind in kinds):
        raise ConfigError(f"config field 'layer_types' must be a list of strings, got {kinds!r}")
    deltanet = DeltaNetConfig(
        num_key_heads=cfg.number("linear_num_key_heads", 16),
        num_value_heads=cfg.number("linear_num_value_heads", 32),
        key_head_dim=cfg.number("linear_key_head_dim", 128),
        value_head_dim=cfg.number("linear_value_head_dim", 128),
        conv_kernel=cfg.number("linear_conv_kernel_dim", 4),
        projections=projections,
    )
    if not _partial_rotary_given(cfg):
        rope = dataclasses.replace(rope, partial_rotary_factor=PARTIAL_ROTARY_FACTOR)
    wiring = llama_wiring(cfg, qk_norm=True, attention_output_gate=True, norm_weight_offset=1.0)
    return dict(layer_types=tuple(kinds), deltanet=deltanet, wiring=wiring, rope=rope)


def _partial_rotary_given(cfg: HFConfig) -> bool:
    """Whether the config sets partial_rotary_factor (at the top or among the RoPE's)."""
    params = [cfg.values] + [cfg.get(key, {}) for key in ("rope_parameters", "rope_scaling")]
    return any(isinstance(p, dict) and p.get("partial_rotary_factor") is not None for p in params)


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen3.5 config.json (its text model) -> ModelConfig."""
    if cfg.model_type != "qwen3_5_text":
        cfg = vl_text_config(cfg, "qwen3_5_text", DEFAULTS)
    cfg = HFConfig({**DEFAULTS, **cfg.values})
    hybrid = hybrid_fields(cfg, hybrid_rope(cfg))
    return ModelConfig(**shared_fields(cfg, **hybrid, image_token_id=image_token(cfg)))


def image_token(cfg: HFConfig) -> int | None:
    """The image token of a Qwen3.5 config with images (the multimodal config's, a qwen35
    file's); None: a text model's."""
    return None if cfg.get("image_token_id") is None else int(cfg.number("image_token_id"))


def gguf_hybrid_fields(header: GGUFHeader) -> dict[str, Any]:
    """The config.json fields of a hybrid GGUF's layers: the layer kinds (per layer, else by
    `full_attention_interval`) and the DeltaNet's shapes (`ssm.*`); the MTP head's blocks
    (`nextn_predict_layers`, counted in `block_count`) are not the model's."""
    layers = int(header.need("block_count")) - int(header.get("nextn_predict_layers", 0))
    value_heads, inner = int(header.need("ssm.time_step_rank")), int(header.need("ssm.inner_size"))
    if inner % value_heads:
        raise ConfigError(
            f"GGUF metadata {header.arch}.ssm.inner_size ({inner}) is not a multiple of "
            f"{header.arch}.ssm.time_step_rank ({value_heads}), the value heads"
        )
    recurrent = header.get("attention.recurrent_layers")
    if recurrent is not None and (
        not isinstance(recurrent, list)
        or len(recurrent) < layers
        or not all(isinstance(r, bool) for r in recurrent)
    ):
        raise ConfigError(
            f"GGUF metadata {header.arch}.attention.recurrent_layers must be {layers} or "
            f"more booleans, got {recurrent!r}"
        )
    kinds = (
        None
        if recurrent is None
        else [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:layers]]
    )
    return {
        "num_hidden_layers": layers,
        "layer_types": kinds,
        "full_attention_interval": header.get("full_attention_interval"),
        "linear_conv_kernel_dim": header.need("ssm.conv_kernel"),
        "linear_key_head_dim": header.need("ssm.state_size"),
        "linear_num_key_heads": header.need("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
    }


def gguf_fields(header: GGUFHeader) -> dict[str, Any]:
    """A qwen35 file's fields: the hybrid layers, the M-RoPE sections and the image token
    (`vl_gguf_fields`: every Qwen3.5 takes images, its tower in a projector file), as a text
    config.

    The converter writes the released sections (CONVERTER_SECTIONS) for a checkpoint that
    gives none; where they do not fit the file's rotary dimensions (a small test model), they
    are read as that checkpoint was: no sections, the same rotation for text."""
    vl = vl_gguf_fields(header)
    rope = vl["rope_parameters"]
    rotary_pairs = int(header.get("rope.dimension_count", 0)) // 2
    if rope["mrope_section"] == CONVERTER_SECTIONS and sum(CONVERTER_SECTIONS) != rotary_pairs:
        rope = {}
    return {
        **gguf_hybrid_fields(header),
        "rope_parameters": rope,
        "image_token_id": vl["image_token_id"],
        "model_type": "qwen3_5_text",
    }


FAMILY = Family(
    name="Qwen3.5 / Qwen3.6",
    model_types=("qwen3_5", "qwen3_5_text"),
    read_config=read_config,
    gguf_architectures=("qwen35",),
    gguf_fields=gguf_fields,
    gguf_layer_names=GGUF_HYBRID_LAYER_NAMES,
    gguf_value_heads_tiled=True,
)
