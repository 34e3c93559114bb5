"""The model families, one file each, and the registry that finds a checkpoint's family.

A family's file (`qinfer.models.<family>`) holds what sets it apart: which config.json keys
and GGUF metadata it reads, its defaults and validation, its tensor names where they differ
and how it wires the shared layers (`qinfer.core.model_config.Wiring`). Adding a family is its file
plus two lines here: its import and its entry in FAMILIES.

`config_from_hf(dict)` / `config_from_file(path)` build a `ModelConfig` through the family
of the config's `model_type`; `family_of_gguf(arch)` finds the family of a GGUF file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qinfer.core.checkpoint import read_json_object
from qinfer.core.errors import ConfigError
from qinfer.core.model_config import ModelConfig
from qinfer.models import (
    gemma3,
    llama,
    mistral,
    phi3,
    qwen2,
    qwen2_5_vl,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
    smollm3,
)
from qinfer.models.base import Family, FusedTensor, GGUFHeader, HFConfig

__all__ = [
    "FAMILIES",
    "Family",
    "FusedTensor",
    "GGUFHeader",
    "config_from_file",
    "config_from_hf",
    "family_of",
    "family_of_gguf",
    "supported_gguf_architectures",
    "supported_model_types",
]

#: Every supported family (the registry).
FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    mistral.FAMILY,
    gemma3.FAMILY,
    smollm3.FAMILY,
    phi3.FAMILY,
    qwen2_5_vl.FAMILY,
    qwen3_vl.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5_moe.FAMILY,
    qwen3_next.FAMILY,
)

_BY_MODEL_TYPE = {t: family for family in FAMILIES for t in family.model_types}
_BY_GGUF_ARCH = {a: family for family in FAMILIES for a in family.gguf_architectures}


def supported_model_types() -> tuple[str, ...]:
    """Every config.json `model_type` some family reads."""
    return tuple(_BY_MODEL_TYPE)


def supported_gguf_architectures() -> tuple[str, ...]:
    """Every GGUF `general.architecture` some family reads."""
    return tuple(_BY_GGUF_ARCH)


def family_of(model_type: Any) -> Family:
    """The family that reads configs of `model_type`; a ConfigError listing the supported
    ones when none does."""
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; "
            f"supported: {', '.join(supported_model_types())}"
        )
    return family


def family_of_gguf(arch: Any, path: Path) -> Family:
    """The family of GGUF architecture `arch` (of file `path`, for the error)."""
    family = _BY_GGUF_ARCH.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise ConfigError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(supported_gguf_architectures())}"
        )
    return family


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face config dict, read by its model_type's family;
    errors name the field at fault."""
    if not isinstance(cfg, dict):
        raise ConfigError("config must be a JSON object")
    return family_of(cfg.get("model_type")).read_config(HFConfig(cfg))


def config_from_file(path: str | Path) -> ModelConfig:
    """Read a `config.json` file (or the folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json found at {path}")
    return config_from_hf(read_json_object(path, ConfigError))
