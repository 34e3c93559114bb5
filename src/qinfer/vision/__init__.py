"""Images in: decoding and patching images (`image`), the vision towers that turn patches
into embeddings for the language model (`qwen2_5_vl`, `qwen3_vl`; their shared `parts`), and
loading both from a checkpoint (`load`). `grid` says where each patch sits and which patches
attend to which; `mrope` where each token of a prompt with images sits for the language
model's M-RoPE; `language_model` runs prompts with images through a checkpoint offline
(`VisionLanguageModel`)."""

from qinfer.vision.image import ImageSettings, PatchedImages, open_image, preprocess_images
from qinfer.vision.language_model import (
    EncodedImages,
    ImagePrompt,
    Prefilled,
    VisionLanguageModel,
)
from qinfer.vision.load import load_image_settings, load_vision_encoder
from qinfer.vision.mrope import mrope_positions
from qinfer.vision.qwen2_5_vl import Qwen2_5_VisionEncoder, VisionConfig
from qinfer.vision.qwen3_vl import Qwen3_VisionEncoder, Qwen3VisionConfig, VisionFeatures

__all__ = [
    "EncodedImages",
    "ImagePrompt",
    "ImageSettings",
    "PatchedImages",
    "Prefilled",
    "Qwen2_5_VisionEncoder",
    "Qwen3VisionConfig",
    "Qwen3_VisionEncoder",
    "VisionConfig",
    "VisionFeatures",
    "VisionLanguageModel",
    "load_image_settings",
    "load_vision_encoder",
    "mrope_positions",
    "open_image",
    "preprocess_images",
]
