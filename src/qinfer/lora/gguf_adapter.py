"""A llama.cpp GGUF LoRA adapter, the file `convert_lora_to_gguf.py` writes: metadata
`general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, the base's
`general.architecture`; for each targeted projection `<llama.cpp name>.lora_a` (r, in) and
`.lora_b` (out, r) (`blk.0.attn_q.weight.lora_a`).

The names go back to the checkpoint's through the family's map of base-weight names
(`qinfer.weights.gguf.hf_tensor_name`), the same one a GGUF model loads by. The scale is
llama.cpp's (`build_lora_mm`): alpha / r with r each tensor's own rank, 1 where alpha is 0.
The converter drops PEFT's use_rslora, so an rsLoRA adapter's file scales as llama.cpp
runs it, not as PEFT did. A llama-architecture file stores q/k's B rows permuted for
interleaved RoPE, as its base weights: they are put back with the model's head size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qinfer.core.errors import AdapterError, ConfigError, WeightsError
from qinfer.lora.pairs import scaled_pairs
from qinfer.models import family_of_gguf
from qinfer.weights.gguf import hf_tensor_name, unpermute_rows
from qinfer.weights.gguf_file import read_gguf
from qinfer.weights.gguf_quants import SUPPORTED_TYPES, dequantize

#: What llama.cpp names each half of a pair (its `llama_adapter_lora` reader).
HALVES = {"lora_a": "A", "lora_b": "B"}


def read_gguf_adapter(
    path: Path, head_dim: int | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter in GGUF file `path`: checkpoint projection -> (A (r, in), B (out, r) *
    scale), fp32. head_dim: the model's, to put back the q/k rows of a family whose files
    store them permuted (None: refused for such a file)."""
    try:
        file = read_gguf(path)
        family = family_of_gguf(file.metadata.get("general.architecture"), path)
    except (WeightsError, ConfigError) as error:
        raise AdapterError(str(error)) from None
    meta = file.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(
            f"{path}: general.type {meta.get('general.type')!r} / adapter.type "
            f"{meta.get('adapter.type')!r}: not a LoRA adapter (adapter / lora, as "
            "llama.cpp's convert_lora_to_gguf.py writes)"
        )
    alpha = meta.get("adapter.lora.alpha")
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{path}: adapter.lora.alpha is missing or not a number")
    permuted = family.gguf_qk_permuted
    if permuted and head_dim is None:
        raise AdapterError(f"{path}: its q/k rows are permuted; the model's head size is needed")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for stored in file.tensors:
        base, _, half = stored.name.rpartition(".")
        module = hf_tensor_name(base, family.gguf_layer_names)
        if half not in HALVES or module is None or not module.endswith(".weight"):
            raise AdapterError(
                f"{path}: tensor {stored.name!r} is not a LoRA lora_a / lora_b of a projection"
            )
        if stored.tensor_type not in SUPPORTED_TYPES:
            raise AdapterError(
                f"{path}: tensor {stored.name!r} has type {stored.tensor_type.name}, "
                "which qinfer cannot read"
            )
        tensor = dequantize(file.read(stored), stored.tensor_type)
        pairs.setdefault(module.removesuffix(".weight"), {})[HALVES[half]] = tensor
    modules = scaled_pairs(
        str(path), pairs, ("lora_a", "lora_b"), lambda r: alpha / r if alpha else 1.0
    )
    if permuted:
        for module in [m for m in modules if m.endswith(("q_proj", "k_proj"))]:
            a, b = modules[module]
            modules[module] = (a, unpermute_rows(b, head_dim))
    return modules
