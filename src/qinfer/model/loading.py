"""Loading a checkpoint into a `Transformer`: the compute dtype, the device, what to
quantize, and a load that gives its temporary buffers back to the OS.

    model = load_model("path/to/Qwen3-0.6B")              # a Hugging Face folder
    model = load_model("model.gguf", dtype="float32")      # a GGUF file, dequantized

The model is built from the checkpoint's config (`qinfer.model.transformer.Transformer`), then its
weights are read into it slot by slot (`qinfer.weights.load`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from qinfer.core.errors import QinferError
from qinfer.core.features import Features
from qinfer.core.model_config import ModelConfig
from qinfer.core.parallel import Parallel
from qinfer.linear.compute import compute_dtype
from qinfer.linear.int4 import GROUP_SIZES
from qinfer.model.mtp_head import load_mtp_head
from qinfer.model.transformer import Transformer
from qinfer.weights import QUANTIZE_KINDS, ExactKinds, Quantize, open_checkpoint
from qinfer.weights.load import load, quantizable_weights

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(
    dtype: str | torch.dtype | None,
    config: ModelConfig,
    device: torch.device,
    quantized: bool = False,
    exact: bool = False,
) -> torch.dtype:
    """The compute dtype: as asked, else chosen from the checkpoint's stored dtype, the device
    and whether the weights are quantized, and all of exact kinds (`qinfer.linear.compute.
    compute_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in _DTYPES:
            raise QinferError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    stored = _DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.float32)
    return compute_dtype(stored, device, quantized, exact)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def quantize_choice(quantize: str | None, group_size: int) -> Quantize | None:
    """load_model's `quantize`, checked, as what to quantize dense weights to (None: keep
    them as they are; None and "none" alike: whether a GGUF file's blocks are kept is
    `keeps_gguf_blocks`'s answer)."""
    if quantize is None or quantize == "none":
        return None
    if quantize not in QUANTIZE_KINDS:
        raise QinferError(
            f"unknown quantize {quantize!r}; use one of none, {', '.join(QUANTIZE_KINDS)}"
        )
    if quantize == "int4" and group_size not in GROUP_SIZES:
        raise QinferError(
            f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}"
        )
    return Quantize(quantize, group_size)


def keeps_gguf_blocks(dtype: str | torch.dtype | None, quantize: str | None) -> bool:
    """Whether a GGUF file loaded with `load_model`'s dtype and quantize keeps its quantized
    blocks: unless quantize is "none" or float32 is asked (every tensor dequantized, the
    exact reference)."""
    return quantize != "none" and _DTYPES.get(dtype, dtype) != torch.float32


def _check_device(quantize: Quantize | None, keep_blocks: bool, device: torch.device) -> None:
    if (quantize is not None or keep_blocks) and device.type not in ("cpu", "cuda"):
        if quantize is None:
            raise QinferError(
                f"quantized GGUF weights run on cpu and cuda, not {device.type}: "
                "pass quantize='none' to dequantize them"
            )
        raise QinferError(f"quantize={quantize.kind!r} runs on cpu and cuda, not {device.type}")


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    features: Features | None = None,
    quantize: str | None = None,
    group_size: int = 32,
    parallel: Parallel | None = None,
    kv_cache_dtype: str | None = None,
    batch_invariant: bool | None = None,
    exact: bool | None = None,
    mtp: bool = False,
) -> Transformer:
    """Load a checkpoint: a Hugging Face folder (config.json + safetensors) or a .gguf file.

    dtype: the compute dtype (activations and dense weights); by default chosen from the
        checkpoint, the device and the quantization (see `resolve_dtype`).
    quantize: None (a GGUF file keeps its Q4_0/Q4_1/Q4_K/Q8_0/Q5_0/Q6_K blocks unless dtype
        float32 is asked; other weights stay dense), "none" (everything dense: the reference),
        "int8" (per output channel) or "int4" (groups of `group_size` input columns). A
        GGUF file's blocks are not re-rounded to as many bits or more: "int8" keeps them,
        "int4" keeps its int4 groups and takes its wider blocks to int4.
    parallel: this process's rank in a tensor-parallel group (default: a single process);
        only the rank's part of each projection is read (see `qinfer.core.parallel`). A world
        size that does not split the heads or the FFN evenly is refused before loading.
    kv_cache_dtype: how the model's caches store K/V, "auto", "bf16", "int8" or "fp8"
        (`Features.kv_cache_dtype`; given, it replaces the one of `features`).
    batch_invariant: `Features.batch_invariant` (given, it replaces the one of `features`).
    exact: `Features.exact`, fp32 (or bf16) activations into quantized weights, the reference
        mode (given, it replaces the one of `features`); by default int8 activations.
    mtp: also load the checkpoint's multi-token-prediction head as `model.mtp`
        (`qinfer.model.mtp_head`; one error naming the tensor a checkpoint without one lacks).
    """
    if kv_cache_dtype is not None:  # checked before anything loads
        features = dataclasses.replace(features or Features(), kv_cache_dtype=kv_cache_dtype)
    if batch_invariant is not None:
        features = dataclasses.replace(features or Features(), batch_invariant=batch_invariant)
    if exact is not None:
        features = dataclasses.replace(features or Features(), exact=exact)
    device = torch.device(device) if device is not None else default_device()
    scheme = quantize_choice(quantize, group_size)
    keep_blocks = keeps_gguf_blocks(dtype, quantize)
    _check_device(scheme, keep_blocks and Path(path).suffix == ".gguf", device)

    exact_default = []  # set when the dtype is fp32 because every weight is an exact kind

    def dtype_for(config: ModelConfig, quantized: bool, exact_kinds: ExactKinds) -> torch.dtype:
        # exact kinds asked of the weights the model multiplies as Linears (a file's conv
        # kernels, norms and routers stay float whatever its type)
        exact = quantized and exact_kinds(quantizable_weights(Transformer(config, features)))
        chosen = resolve_dtype(dtype, config, device, quantized, exact)
        if dtype is None and exact and chosen == torch.float32:
            exact_default.append(True)
        if quantized and device.type == "cuda" and chosen != torch.bfloat16:
            raise QinferError(
                f"quantized weights on cuda compute in bfloat16, not {chosen}: "
                "drop dtype or pass quantize='none'"
            )
        return chosen

    with _returning_freed_memory():
        config, weights = open_checkpoint(path, dtype_for, device, scheme, keep_blocks)
        model = load(Transformer(config, features), weights, parallel, scheme)
        if mtp:
            model.mtp = load_mtp_head(config, weights, model.features, scheme, path)
    if exact_default:
        # fp32 activations over a GGUF file's blocks: K/V in bf16, half the bytes (llama.cpp
        # keeps f16 ones); greedy text then leaves the fp32 cache's only at near-ties
        # (SmolLM2, 20 chat prompts: 2 partings at fp32 gaps under 0.011, docs/BENCHMARKS.md)
        model.kv_auto_dtype = torch.bfloat16
    return model


#: glibc's mallopt parameters, and the ceiling its own adaptive mmap threshold grows to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CEILING = -1, -3, 32 << 20


@contextlib.contextmanager
def _returning_freed_memory() -> Iterator[None]:
    """Load with every large buffer (file reads, dequantized copies) given back to the OS
    when freed, then trim what the heap still holds.

    glibc serves buffers above its mmap threshold with their own mappings, returned on
    free; but the threshold grows to the size of each such buffer freed, after which the
    load's many temporary buffers come from the heap and stay resident (about twice the
    memory kept after loading SmolLM2: docs/BENCHMARKS.md, "Memory after loading").

    After the load, both thresholds are set where glibc's adaptive ones end up anyway: mmap
    at its ceiling, and the heap trimmed only once twice that is free at its top. Fixing
    the mmap threshold stops glibc adapting the trim threshold too; left at its 128 KiB
    default, every engine step handed its temporaries (history copies, scores, logits)
    back to the OS and faulted them in again (docs/BENCHMARKS.md, "Memory after
    loading"). A no-op where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CEILING)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_CEILING)
        libc.malloc_trim(0)
