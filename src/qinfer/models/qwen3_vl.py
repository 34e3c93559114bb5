"""Qwen3-VL's language model (`model_type: qwen3_vl`): a Qwen3 (QK-norm; `attention_bias`
on q/k/v and o) with interleaved M-RoPE, whose image tokens' rows hold the vision tower's
embeddings and, after its first layers, its DeepStack features (`qinfer.vision`).

The text model's fields are `text_config`'s, as Qwen2.5-VL's (`models/qwen2_5_vl.py`). Its
M-RoPE frequencies alternate between the three positions (t, h, w, t, h, w, ...; the rest
t), whatever `mrope_interleaved` says, as transformers' `Qwen3VLTextRotaryEmbedding`. No
sliding windows. Tensor names: `model.language_model.*`.

GGUF: llama.cpp's `qwen3vl` architecture, read as Qwen2.5-VL's (`vl_gguf_fields`). Its
`qwen3vl.n_deepstack_layers` is how many DeepStack features the projector file gives
(llama.cpp appends them to each image embedding's width and adds slice il + 1 after text
layer il; qinfer's tower hands them over apart, added after the same layers), checked
against the projector when both load (`qinfer.vision.mmproj`).
"""

from __future__ import annotations

from typing import Any

from qinfer.core.model_config import ModelConfig
from qinfer.models.base import Family, HFConfig, shared_fields
from qinfer.models.llama import llama_wiring
from qinfer.models.qwen2_5_vl import (
    IMAGE_TOKEN_ID,
    mrope_config,
    vl_gguf_fields,
    vl_text_config,
)

#: What transformers assumes where a Qwen3-VL text config leaves fields out.
DEFAULTS: dict[str, Any] = {"rope_theta": 500_000.0, "max_position_embeddings": 128000}
MROPE_SECTION = (24, 20, 20)


def read_config(cfg: HFConfig) -> ModelConfig:
    """A Qwen3-VL config.json (its text model) -> ModelConfig."""
    if cfg.model_type != "qwen3_vl_text":
        cfg = vl_text_config(cfg, "qwen3_vl_text", DEFAULTS)
    return ModelConfig(
        **shared_fields(
            cfg,
            rope=mrope_config(cfg, MROPE_SECTION, interleaved=True),
            wiring=llama_wiring(cfg, qk_norm=True),
            image_token_id=int(cfg.number("image_token_id", IMAGE_TOKEN_ID)),
        )
    )


FAMILY = Family(
    name="Qwen3-VL (its language model)",
    model_types=("qwen3_vl", "qwen3_vl_text"),
    read_config=read_config,
    gguf_architectures=("qwen3vl",),
    gguf_fields=vl_gguf_fields,
)
