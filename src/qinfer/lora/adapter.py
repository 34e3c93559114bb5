"""One LoRA adapter as read from disk (a PEFT folder, or a llama.cpp GGUF adapter:
`qinfer.lora.gguf_adapter`): for each checkpoint projection it targets
(`model.layers.0.self_attn.q_proj`), A (r, in) and B (out, r) with its scale folded into B.

PEFT's folder (`adapter_config.json` + `adapter_model.safetensors`, what `peft`'s
`save_pretrained` writes): scale lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora;
r is each module's own (A's rows: rank_pattern's ranks too). Refused in one line, naming
the field: DoRA, trained biases, per-module alphas (alpha_pattern), modules_to_save (whole
replaced modules: not an adapter's product), embedding adapters, another peft_type.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from qinfer.core.errors import AdapterError
from qinfer.lora.gguf_adapter import read_gguf_adapter
from qinfer.lora.pairs import scaled_pairs

#: PEFT's tensor names: [base_model.model.]<module>.lora_A|lora_B[.<adapter name>].weight
_PEFT_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$"
)


@dataclass(frozen=True)
class LoraAdapter:
    """path: where it was read; modules: checkpoint projection -> (A (r, in), B (out, r) *
    scale), fp32 on the CPU; rank: the largest r of its modules."""

    path: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.modules.values())


def read_adapter(path: str | Path, head_dim: int | None = None) -> LoraAdapter:
    """The adapter at `path`: a PEFT folder (adapter_config.json beside the weights) or a
    llama.cpp GGUF adapter file (`qinfer.lora.gguf_adapter`; head_dim: the model's, which
    a llama-architecture file needs)."""
    path = Path(path)
    if path.is_file():
        return LoraAdapter(str(path), read_gguf_adapter(path, head_dim))
    if not path.is_dir():
        raise AdapterError(
            f"lora_path {str(path)!r} is neither a folder with adapter_config.json nor a "
            "GGUF adapter file"
        )
    return read_peft(path)


def read_peft(folder: Path) -> LoraAdapter:
    """A PEFT LoRA folder: its config's scaling and its tensors, paired by module."""
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise AdapterError(f"{config_file}: not JSON ({error})") from None
    _check_config(config, config_file)
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{folder}: no adapter_model.safetensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(weights_file).items():
        found = _PEFT_TENSOR.match(name)
        if found is None:
            raise AdapterError(f"{weights_file}: tensor {name!r} is not a LoRA A or B weight")
        pairs.setdefault(found["module"], {})[found["ab"]] = tensor.float()
    modules = scaled_pairs(
        str(weights_file),
        pairs,
        ("lora_A", "lora_B"),
        lambda r: alpha / (math.sqrt(r) if rslora else r),
    )
    return LoraAdapter(str(folder), modules)


def _check_config(config: dict, where: Path) -> None:
    """Refuse what is not a plain LoRA, naming the field."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r} is not LORA")
    for field in ("r", "lora_alpha"):
        if not isinstance(config.get(field), int | float):
            raise AdapterError(f"{where}: {field} is missing or not a number")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "whole replaced modules are not supported",
        "alpha_pattern": "per-module alphas are not supported",
    }
    for field, why in refused.items():
        if config.get(field):
            raise AdapterError(f"{where}: {field}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {config['bias']!r}: trained biases are not supported")
