"""What both benchmarks share: timing a call on a device, and loading the transformers
model they compare qinfer against."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from qinfer.errors import QinferError


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds fn takes, waiting for the device to finish."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on a CUDA device (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_transformers_model(path: Path, dtype: torch.dtype, device: torch.device):
    """The same checkpoint as a transformers model, in eval mode on `device` (a GGUF file
    through its gguf_file loader, which dequantizes)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise QinferError("--compare-hf needs transformers: pip install transformers") from None
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()
