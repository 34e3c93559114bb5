"""Where weights come from: `open_checkpoint(path)` picks the reader for a checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import torch

from qinfer.core.errors import QinferError
from qinfer.core.model_config import ModelConfig
from qinfer.models import config_from_file, family_of
from qinfer.weights.base import QUANTIZE_KINDS, Quantize, Weights
from qinfer.weights.safetensors import SafetensorsWeights

__all__ = [
    "QUANTIZE_KINDS",
    "ExactKinds",
    "Quantize",
    "SafetensorsWeights",
    "Weights",
    "open_checkpoint",
]

#: exact_kinds(names) -> whether every weight `names` lists (ours: what the model built
#: from the config multiplies as Linears, `weights.load.quantizable_weights`) is a kind that
#: qinfer's kernels multiply exactly by fp32 activations (`gguf.exact_kernels`).
ExactKinds = Callable[[Collection[str]], bool]
#: dtype_for(config, quantized, exact_kinds) -> the compute dtype, once the config (and its
#: stored dtype) is known, whether the weights will be quantized and how to ask whether the
#: model's Linears are all of exact kinds.
DtypeChoice = Callable[[ModelConfig, bool, ExactKinds], torch.dtype]


def open_checkpoint(
    path: str | Path,
    dtype_for: DtypeChoice,
    device: torch.device,
    quantize: Quantize | None = None,
    keep_gguf_blocks: bool = True,
) -> tuple[ModelConfig, Weights]:
    """The config and weights of a Hugging Face folder or a GGUF file.

    quantize: the weight-only quantization the dense weights will get at load (it decides
    the compute dtype; `weights.load.load` applies it); a GGUF file keeps its own quantized
    blocks unless told otherwise (see `weights.gguf.open_gguf`).
    """
    path = Path(path)
    if not path.exists():
        raise QinferError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from qinfer.weights.gguf import open_gguf  # the gguf reader is only needed here

        config, weights = open_gguf(path, dtype_for, device, quantize, keep_gguf_blocks)
    elif path.is_dir():
        config = config_from_file(path)
        dtype = dtype_for(config, quantize is not None, lambda names: False)
        weights = SafetensorsWeights(path, dtype, device)
    else:
        raise QinferError(f"model path {path} is neither a checkpoint folder nor a .gguf file")
    _name_fused_parts(config, weights)
    return config, weights


def _name_fused_parts(config: ModelConfig, weights: Weights) -> None:
    """Each layer's fused tensors of the family (`Family.fused_tensors`) split into the
    parts the loader reads by name."""
    for fused in family_of(config.model_type).fused_tensors(config):
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            parts = [(f"{prefix}.{name}", rows) for name, rows in fused.parts]
            weights.split_fused(f"{prefix}.{fused.stored}", parts)
