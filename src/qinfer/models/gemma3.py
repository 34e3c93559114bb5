"""Gemma 3 (text; and the text model of its multimodal checkpoints, `model_type: gemma3`).

What sets it apart, as wiring of the shared layers: a RoPE of its own for sliding-window
layers (theta 10k, never scaled: `rope_local_base_freq`), attention scaled by
`query_pre_attn_scalar ** -0.5`, embeddings times sqrt(hidden_size), norms that scale by
(1 + weight), norms after attention and MLP too (four per block), QK-norm, a GELU-gated MLP
(`hidden_activation`) and `final_logit_softcapping`. Every `sliding_window_pattern`-th
layer is global when `layer_types` is absent.

GGUF (llama.cpp): the norms after attention and MLP have names of their own, and llama.cpp's
"ffn_norm" is Gemma's pre_feedforward_layernorm; the converter stores each norm's whole
scale 1 + w (`weights.gguf` takes the 1 back off, as `norm_weight_offset` says). Which
layers slide (every sixth is global), the sliding layers' RoPE base (10k) and the attention
scale are llama.cpp's constants: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the
62-layer 27B, whose Hugging Face config says query_pre_attn_scalar 168.
"""

from __future__ import annotations

from typing import Any

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeConfig,
    Wiring,
)
from qinfer.models.base import (
    GGUF_LAYER_NAMES,
    Family,
    GGUFHeader,
    HFConfig,
    rope_config_from_hf,
    shared_fields,
)

#: What `transformers` assumes for fields a Gemma 3 config.json may leave out
#: (Gemma3TextConfig's defaults; every sixth layer global when `layer_types` is absent).
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Gemma 3 config.json (text, or multimodal: its text_config) -> ModelConfig."""
    if cfg.model_type == "gemma3":  # with its vision tower: the text model alone
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config field 'text_config' (Gemma 3's text model) must be an object")
        outer = {k: cfg.values[k] for k in ("dtype", "torch_dtype") if k in cfg.values}
        # transformers' Gemma3ForConditionalGeneration never softcaps its logits, whatever
        # its text_config says (null in Google's checkpoints).
        text = {**outer, **text, "final_logit_softcapping": None, "model_type": "gemma3_text"}
        return read_config(HFConfig(text))
    cfg = HFConfig({**DEFAULTS, **cfg.values})
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError(
            "config field 'attn_logit_softcapping' is set; qinfer's attention has no "
            "score softcapping (Gemma 3 checkpoints leave it null)"
        )
    pattern = cfg.number("sliding_window_pattern")  # read first: a bad value is named
    local_theta = cfg.number("rope_local_base_freq", kind=float)
    hidden, layers = cfg.number("hidden_size"), cfg.number("num_hidden_layers")
    rope, sliding_rope = _layer_ropes(cfg.values, local_theta)
    cap = cfg.get("final_logit_softcapping")
    bias = cfg.flag("attention_bias")  # on q/k/v and o alike, as in Gemma3Attention
    wiring = Wiring(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        hidden_act=cfg.activation(
            "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        ),
        attention_scale=cfg.number("query_pre_attn_scalar", kind=float) ** -0.5,
        sliding_rope=sliding_rope,
        embedding_scale=hidden**0.5,
        norm_weight_offset=1.0,
        sandwich_norms=True,
        final_logit_softcapping=None if cap is None else float(cap),
    )
    window = cfg.get("sliding_window")
    explicit = cfg.get("layer_types")
    if window is None:
        kinds = (FULL_ATTENTION,) * layers
    elif explicit is not None:
        kinds = tuple(explicit)
    else:
        kinds = tuple(
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)
        )
    windows = dict(sliding_window=None if window is None else int(window), layer_types=kinds)
    return ModelConfig(**shared_fields(cfg, **windows, rope=rope, wiring=wiring))


def _layer_ropes(cfg: dict[str, Any], local_theta: float) -> tuple[RopeConfig, RopeConfig]:
    """(global, sliding) RoPE: `rope_parameters` keyed by layer type (transformers >= 5); a
    layer type it leaves out (or the old spelling) takes, as in transformers, `rope_theta` +
    `rope_scaling` for the global layers and `rope_local_base_freq` (never scaled) for the
    sliding ones."""
    local_rope = rope_config_from_hf({"rope_parameters": {"rope_theta": local_theta}})
    by_type = cfg.get("rope_parameters")
    if not (isinstance(by_type, dict) and {FULL_ATTENTION, SLIDING_ATTENTION} & set(by_type)):
        return rope_config_from_hf(cfg), local_rope

    def given(params: dict[str, Any]) -> RopeConfig:
        return rope_config_from_hf({**cfg, "rope_scaling": None, "rope_parameters": params})

    full, sliding = by_type.get(FULL_ATTENTION), by_type.get(SLIDING_ATTENTION)
    return (
        given(full) if full else rope_config_from_hf({**cfg, "rope_parameters": None}),
        given(sliding) if sliding else local_rope,
    )


def gguf_fields(header: GGUFHeader) -> dict[str, Any]:
    """The window is metadata; the rest are llama.cpp's constants (module docstring)."""
    hidden, heads = int(header.need("embedding_length")), int(header.need("attention.head_count"))
    head_dim = int(header.get("attention.key_length") or hidden // heads)
    return {
        "sliding_window": header.get("attention.sliding_window"),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": hidden // heads
        if int(header.need("block_count")) == 62
        else head_dim,
    }


FAMILY = Family(
    name="Gemma 3",
    model_types=("gemma3_text", "gemma3"),
    read_config=read_config,
    gguf_architectures=("gemma3",),
    gguf_fields=gguf_fields,
    gguf_layer_names={
        **GGUF_LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
)
