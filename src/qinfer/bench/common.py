"""What both benchmarks share: loading qinfer and describing what it runs on, timing a call
on a device, and loading the transformers model they compare qinfer against."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from qinfer.bench.linear_paths import format_path_table, path_table
from qinfer.core.checkpoint import resolve_model
from qinfer.core.errors import QinferError
from qinfer.linear.compute import bf16_matmul_is_fast, cpu_class, cpu_flags
from qinfer.model.loading import default_device, load_model
from qinfer.model.transformer import Transformer


def bench_device(load_args: dict | None) -> torch.device:
    """The device `load_model`'s keywords ask for, else the best one."""
    device = (load_args or {}).get("device")
    return torch.device(device) if device is not None else default_device()


def load_qinfer(model_spec: str | None, load_args: dict | None) -> tuple[Path, Transformer]:
    """The checkpoint's path and the model, loaded with `load_model`'s keywords."""
    path = resolve_model(model_spec)
    load_args = {**(load_args or {}), "device": bench_device(load_args)}
    return path, load_model(path, **load_args)


def describe_setup(model: Transformer) -> dict:
    """What the figures depend on: device, threads, compute dtype and why, CPU features,
    how many linear layers of each kind the model holds, and the path each quantized
    shape takes per row bucket with what each path costs (`qinfer.bench.linear_paths`)."""
    kinds = Counter(type(w).__name__ for w in model.linears().values())
    setup = {
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "linear_kinds": dict(sorted(kinds.items())),
    }
    if model.device.type == "cpu":
        setup["cpu_flags"] = cpu_flags()
        setup["cpu_class"] = cpu_class()
        setup["bf16_matmul_is_fast"] = bf16_matmul_is_fast(model.device)
        setup["linear_paths"] = path_table(model)
    return setup


def format_setup(report: dict) -> str:
    """One line of `describe_setup`."""
    kinds = ", ".join(f"{n} {kind}" for kind, n in report["linear_kinds"].items())
    line = f"{report['dtype']} on {report['device']}, {report['threads']} threads; linear: {kinds}"
    if "cpu_flags" in report:
        fast = "fast" if report["bf16_matmul_is_fast"] else "slow"
        flags = " ".join(report["cpu_flags"]) or "-"
        line += f"\nCPU flags: {flags}; class {report['cpu_class']} (bf16 GEMM {fast})"
    if report.get("linear_paths"):
        line += "\nquantized linear paths (kind, out x in [x group], bucket (rows timed)):\n"
        line += format_path_table(report["linear_paths"])
    return line


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
