"""Where weights come from: `open_checkpoint(path)` picks the reader for a checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from qinfer.config import ModelConfig
from qinfer.errors import QinferError
from qinfer.weights.base import Weights
from qinfer.weights.safetensors import SafetensorsWeights

__all__ = ["SafetensorsWeights", "Weights", "open_checkpoint"]


def open_checkpoint(
    path: str | Path,
    dtype_for: Callable[[ModelConfig], torch.dtype],
    device: torch.device,
) -> tuple[ModelConfig, Weights]:
    """The config and weights of a Hugging Face folder or a GGUF file.

    dtype_for: picks the load dtype once the config (and its stored dtype) is known.
    """
    path = Path(path)
    if not path.exists():
        raise QinferError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from qinfer.weights.gguf import open_gguf  # the gguf reader is only needed here

        return open_gguf(path, dtype_for, device)
    if not path.is_dir():
        raise QinferError(f"model path {path} is neither a checkpoint folder nor a .gguf file")
    config = ModelConfig.from_file(path)
    return config, SafetensorsWeights(path, dtype_for(config), device)
