"""Which dtype the activations use, chosen from what the running device does, measured.

CPUs differ: with AVX512-BF16 (or AMX) a bf16 GEMM runs at several times the fp32 rate;
on AVX2-only CPUs it runs ~8x slower than fp32. The int8/int4 weight-only kernels are fast
only with bf16 activations on both (30-100x slower with fp32 ones). So:

- quantized weights compute in bf16;
- dense weights keep the checkpoint's dtype, except that a bf16/fp16 checkpoint computes
  in fp32 on a CPU whose bf16 GEMM measures slower than its fp32 GEMM (fp16 becomes bf16
  on a CPU where bf16 is fast: CPU fp16 matmuls are slow).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

#: The CPU features that decide which kernels are fast, as /proc/cpuinfo names them.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this machine's CPU has (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    have = set(line.partition(":")[2].split())
    return [flag for flag in CPU_FLAGS if flag in have]


@functools.cache
def bf16_matmul_is_fast(device: torch.device) -> bool:
    """Whether a bf16 GEMM on `device` is at least as fast as an fp32 one (measured once)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False

    # a prefill-like shape, ~1 ms in fp32; the first call of each selects and packs
    operands = {
        dtype: (torch.randn(64, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype))
        for dtype in (torch.bfloat16, torch.float32)
    }
    best = dict.fromkeys(operands, float("inf"))
    for a, b in operands.values():
        torch.matmul(a, b)
    # The fastest of several runs, the two dtypes taking turns: other processes only ever
    # slow a run down, and a busy spell then slows both alike. Measured 4x apart one way
    # (AVX512-BF16) or 8x the other (AVX2); timed back to back (7 runs of one, then 7 of
    # the other) while another process ran GEMMs on both cores, 1 load in 12 took
    # AVX512-BF16's bf16 for slow, and with it the fp32 prefill path (half the speed).
    for rounds in range(1, 16):
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.matmul(a, b)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
        ratio = best[torch.bfloat16] / best[torch.float32]
        if rounds >= 5 and (ratio < 0.5 or ratio > 2):  # the wide margin is showing
            break
    return best[torch.bfloat16] <= best[torch.float32]


def compute_dtype(stored: torch.dtype, device: torch.device, quantized: bool) -> torch.dtype:
    """The activations' dtype for weights stored in `stored` (see the module docstring)."""
    if quantized:
        return torch.bfloat16
    if stored in (torch.bfloat16, torch.float16) and device.type == "cpu":
        return torch.bfloat16 if bf16_matmul_is_fast(device) else torch.float32
    return stored
