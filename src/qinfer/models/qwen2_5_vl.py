"""Qwen2.5-VL's language model (`model_type: qwen2_5_vl`): a Qwen2 (q/k/v biases) with
M-RoPE, whose image tokens' rows hold the vision tower's embeddings (`qinfer.vision`).

The config.json keeps the text model's fields under `text_config` (transformers 5) or at
the top level (the original checkpoints); the tie, dtype and image token id are the outer
config's. M-RoPE: `rope_scaling` / `rope_parameters` say `"type": "mrope"` (RoPE's default
frequencies) and `mrope_section`, the frequencies of each of a token's three positions, in
runs (t, then h, then w). transformers' attention takes head_dim = hidden / heads, whatever
the config says.

Tensor names: `model.layers.*` (original saves) or `model.language_model.*` (transformers 5),
both read as the text model's (`weights.safetensors.TEXT_MODEL_PREFIXES`).

GGUF: llama.cpp's `qwen2vl` architecture (its converter writes Qwen2-VL's and Qwen2.5-VL's
text models so), the M-RoPE sections in `qwen2vl.rope.dimension_sections` (padded to four
with zeros), the image token found by its text in the vocabulary (`vl_gguf_fields`); the
vision tower is the separate projector file's (`qinfer.vision.mmproj`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import ModelConfig, RopeConfig
from qinfer.models.base import Family, GGUFHeader, HFConfig, rope_config_from_hf, shared_fields
from qinfer.models.llama import llama_wiring
from qinfer.models.qwen2 import qwen_windows

#: Qwen-VL's <|image_pad|>: the token each merged patch block of an image replaces.
IMAGE_TOKEN_ID = 151655
IMAGE_TOKEN = "<|image_pad|>"

#: What transformers assumes where a Qwen2.5-VL text config leaves fields out.
DEFAULTS: dict[str, Any] = {"rope_theta": 1_000_000.0, "max_position_embeddings": 32768}
MROPE_SECTION = (16, 24, 24)


def vl_text_config(cfg: HFConfig, text_type: str, defaults: dict[str, Any]) -> HFConfig:
    """The text model's fields of a Qwen-VL config.json (its `text_config`, else the top
    level), under model_type `text_type`, with the outer config's tie, dtype and image
    token id, and transformers' `defaults` where both leave a field out."""
    text = cfg.get("text_config", cfg.values)
    if not isinstance(text, dict):
        raise ConfigError(f"config field 'text_config' ({cfg.model_type}) must be an object")
    outer = cfg.values
    tied = bool(outer.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    merged = {
        **defaults,
        **{k: outer[k] for k in ("dtype", "torch_dtype") if k in outer},
        **{k: v for k, v in text.items() if v is not None},
        "model_type": text_type,
        "tie_word_embeddings": tied,
        "image_token_id": outer.get("image_token_id", IMAGE_TOKEN_ID),
    }
    return HFConfig(merged)


def mrope_config(cfg: HFConfig, section: tuple[int, ...], interleaved: bool) -> RopeConfig:
    """The M-RoPE of a Qwen-VL text config: its RoPE parameters (type "mrope" is the
    default frequencies), with `mrope_section` (`section` where absent) and the layout."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):  # both spellings, the newer winning
        value = cfg.get(key, {})
        if not isinstance(value, dict):
            raise ConfigError(f"config field {key!r} must be an object, got {value!r}")
        params.update(value)
    given = params.pop("mrope_section", section)
    params.pop("mrope_interleaved", None)  # the family decides the layout, as transformers
    if not isinstance(given, list | tuple) or not all(isinstance(n, int) for n in given):
        raise ConfigError(f"config field 'mrope_section' must be a list of integers, got {given!r}")
    for key in ("rope_type", "type"):
        if params.get(key) == "mrope":
            params[key] = "default"
    rope = rope_config_from_hf({**cfg.values, "rope_scaling": None, "rope_parameters": params})
    return dataclasses.replace(rope, mrope_section=tuple(given), mrope_interleaved=interleaved)


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen2.5-VL config.json (its text model) -> ModelConfig."""
    if cfg.model_type != "qwen2_5_vl_text":
        cfg = vl_text_config(cfg, "qwen2_5_vl_text", DEFAULTS)
    hidden, heads = cfg.number("hidden_size"), cfg.number("num_attention_heads")
    head_dim = cfg.number("head_dim", hidden // heads)
    if head_dim != hidden // heads:
        raise ConfigError(
            f"config field 'head_dim' is {head_dim}; Qwen2.5-VL's attention takes "
            f"hidden_size / num_attention_heads = {hidden // heads}"
        )
    return ModelConfig(
        **shared_fields(
            cfg,
            **qwen_windows(cfg),
            rope=mrope_config(cfg, MROPE_SECTION, interleaved=False),
            wiring=llama_wiring(cfg, qkv_bias=True, o_bias=False),
            image_token_id=int(cfg.number("image_token_id", IMAGE_TOKEN_ID)),
        )
    )


def vl_gguf_fields(header: GGUFHeader) -> dict[str, Any]:
    """What a Qwen-VL text GGUF says beyond llama.cpp's shared keys: the M-RoPE sections
    (t, h, w; the file pads them to four with a zero) and the image token's id, found by its
    text in the vocabulary (transformers' default where the file has none)."""
    key = f"{header.arch}.rope.dimension_sections"
    sections = header.get("rope.dimension_sections")
    if not isinstance(sections, list) or not all(isinstance(n, int) for n in sections):
        raise ConfigError(f"GGUF metadata {key} must be a list of integers, got {sections!r}")
    if len(sections) != 4 or sections[3] != 0:
        raise ConfigError(
            f"GGUF metadata {key} is {sections}; Qwen-VL's M-RoPE has three sections "
            "(t, h, w) and a fourth of 0"
        )
    tokens = header.metadata.get("tokenizer.ggml.tokens") or []
    image_token = tokens.index(IMAGE_TOKEN) if IMAGE_TOKEN in tokens else IMAGE_TOKEN_ID
    return {"rope_parameters": {"mrope_section": sections[:3]}, "image_token_id": image_token}


FAMILY = Family(
    name="Qwen2.5-VL (its language model)",
    model_types=("qwen2_5_vl", "qwen2_5_vl_text"),
    read_config=read_config,
    gguf_architectures=("qwen2vl",),
    gguf_fields=vl_gguf_fields,
)
