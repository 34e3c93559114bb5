"""A checkpoint's vision side: its vision tower's weights and its image settings.

`load_vision_encoder(folder)` builds the tower of the config's `model_type` empty, then
fills it through the weights seam (`qinfer.weights.load.load`), from the checkpoint's
`visual.*` tensors; the text model's tensors are never read. `load_image_settings(folder)`
reads `preprocessor_config.json`. `load_vision(path, model, mmproj)` finds both for a
loaded text model: a folder's own, or a GGUF text model's projector file
(`qinfer.vision.mmproj`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from qinfer.core.checkpoint import read_json_object
from qinfer.core.errors import ConfigError
from qinfer.model.transformer import Transformer
from qinfer.vision.image import ImageSettings
from qinfer.vision.mmproj import load_projector
from qinfer.vision.parts import split_qkv
from qinfer.vision.qwen2_5_vl import Qwen2_5_VisionEncoder, VisionConfig
from qinfer.vision.qwen3_vl import Qwen3_5VisionConfig, Qwen3_VisionEncoder, Qwen3VisionConfig
from qinfer.weights.load import load
from qinfer.weights.safetensors import SafetensorsWeights

#: model_type -> (its vision config, its encoder).
ENCODERS = {
    "qwen2_5_vl": (VisionConfig, Qwen2_5_VisionEncoder),
    "qwen3_vl": (Qwen3VisionConfig, Qwen3_VisionEncoder),
    "qwen3_5": (Qwen3_5VisionConfig, Qwen3_VisionEncoder),
    "qwen3_5_moe": (Qwen3_5VisionConfig, Qwen3_VisionEncoder),
}

#: Where checkpoints keep the tower (Qwen2.5-VL's original layout, Qwen3-VL's and Qwen3.5's).
PREFIXES = ("visual", "model.visual")

PREPROCESSOR_FILE = "preprocessor_config.json"


def load_vision_encoder(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Qwen2_5_VisionEncoder | Qwen3_VisionEncoder:
    """The vision tower of a Hugging Face checkpoint folder, its weights in `dtype` on
    `device` (see each encoder's `forward` for what it returns). A ConfigError names an unsupported model_type or a bad config field; a
    WeightsError a missing or misshapen tensor."""
    folder = Path(folder)
    cfg = read_json_object(folder / "config.json", ConfigError)
    model_type = cfg.get("model_type")
    if model_type not in ENCODERS:
        raise ConfigError(
            f"{folder / 'config.json'}: model_type {model_type!r} has no vision encoder; "
            f"supported: {', '.join(ENCODERS)}"
        )
    config_class, encoder_class = ENCODERS[model_type]
    config = config_class.from_hf(cfg)  # its refusals before any file is opened
    weights = SafetensorsWeights(folder, dtype, torch.device(device))
    first = "patch_embed.proj.weight"
    found = [p for p in PREFIXES if weights.has(f"{p}.{first}")]
    if not found:  # the encoder's own prefix, under which the missing tensor is named
        return load(encoder_class(config), weights)
    split_qkv(weights, found[0], config.depth, config.hidden_size)
    return load(encoder_class(config, found[0]), weights)


def load_vision(
    path: str | Path,
    model: Transformer,
    mmproj: str | Path | None = None,
    keep_blocks: bool = False,
) -> tuple[Qwen2_5_VisionEncoder | Qwen3_VisionEncoder | None, ImageSettings | None]:
    """The vision tower (in the model's dtype, on its device) and image settings of the
    text model `model` loaded from `path`: those of the projector file `mmproj` when given
    (a GGUF text model's; keep_blocks: keep its quantized blocks, `load_projector`), else
    those of a vision-language checkpoint folder, else (None, None): a text-only model, or
    a GGUF vision-language text model without its projector, which refuses images."""
    if mmproj is not None:
        return load_projector(
            mmproj, path, model.config, model.dtype, model.device, keep_blocks, model.features
        )
    if model.config.image_token_id is None or not Path(path).is_dir() or not has_vision_tower(path):
        return None, None
    return load_vision_encoder(path, model.dtype, model.device), load_image_settings(path)


def has_vision_tower(folder: str | Path) -> bool:
    """Whether the folder's config.json is a vision-language model's (a model_type of
    ENCODERS with a vision_config), not the text model of one saved on its own
    (`qwen2_5_vl_text`, `qwen3_vl_text`), whose config still names an image token, nor a
    Qwen3.5 checkpoint saved without its tower (a `qwen3_5` ForCausalLM's)."""
    cfg = read_json_object(Path(folder) / "config.json", ConfigError)
    return cfg.get("model_type") in ENCODERS and isinstance(cfg.get("vision_config"), dict)


def load_image_settings(folder: str | Path) -> ImageSettings:
    """The image settings of a checkpoint folder's preprocessor_config.json."""
    file = Path(folder) / PREPROCESSOR_FILE
    if not file.is_file():
        raise ConfigError(f"no {PREPROCESSOR_FILE} found in {folder}")
    return ImageSettings.from_hf(read_json_object(file, ConfigError))
