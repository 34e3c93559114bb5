"""Which dtype the activations use, chosen by a table of what the running CPU is, never by a
timing.

CPUs differ: with AVX512-BF16 (or AMX) a bf16 GEMM runs at several times the fp32 rate;
on AVX2-only CPUs it runs ~8x slower than fp32. torch's int8/int4 weight-only kernels are
fast only with bf16 activations on both (30-100x slower with fp32 ones); qinfer's own
(`Int4BlockLinear`, `Int8BlockLinear`) take fp32 activations at the same speed. So:

- quantized weights compute in fp32 on CPU where all of them are qinfer's exact kinds (a
  GGUF file whose Linears are Q4_0/Q4_1/Q4_K/Q8_0/Q5_0/Q6_K: `weights.gguf.exact_kernels`), in
  bf16 otherwise;
- dense weights keep the checkpoint's dtype, except that a bf16/fp16 checkpoint computes
  in fp32 on a CPU without native bf16 dot products (fp16 becomes bf16 on a CPU with them:
  CPU fp16 matmuls are slow).

Whether bf16 is fast (`bf16_matmul_is_fast`) is read from the CPU's flags and the ISA the
libraries are allowed to use (`cpu_class`), so every process on a machine decides alike.
It used to be a GEMM timed at each load: on an AMX Xeon it answered "slow" in 2 loads of 3,
and the prefill path, and with it the rounding and the first greedy token, followed it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

#: The CPU features that decide which kernels are fast, as /proc/cpuinfo names them.
CPU_FLAGS = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)

#: CPU classes from least to most capable, as far as bf16 GEMMs go: what oneDNN (torch's
#: bf16 GEMM) may use. "avx512_bf16" and "amx" multiply bf16 natively.
CPU_CLASSES = ("default", "avx2", "avx512", "avx512_bf16", "amx")
#: oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA, the emulation knob) -> the class they leave.
_ONEDNN_CAPS = {
    "SSE41": "default",
    "AVX": "default",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512",
    "AVX512_CORE_VNNI": "avx512",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX10_1_512_AMX": "amx",
    "AVX512_CORE_AMX": "amx",
    "AVX10_1_512_AMX_FP16": "amx",
    "AVX512_CORE_AMX_FP16": "amx",
    "AVX10_2_512": "avx512_bf16",
    "AVX10_2_512_AMX_2": "amx",
}


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this machine's CPU has (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    have = set(line.partition(":")[2].split())
    return [flag for flag in CPU_FLAGS if flag in have]


def cpu_class(flags: list[str] | None = None, environ: dict[str, str] | None = None) -> str:
    """This CPU's class (`CPU_CLASSES`) from its flags, capped where the environment caps
    the ISA torch's libraries use: ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) for oneDNN's
    GEMMs, ATEN_CPU_CAPABILITY for torch's own kernels (the int4/int8 ones among them)."""
    flags = cpu_flags() if flags is None else flags
    environ = os.environ if environ is None else environ
    if "amx_bf16" in flags:
        found = "amx"
    elif "avx512_bf16" in flags:
        found = "avx512_bf16"
    elif "avx512f" in flags:
        found = "avx512"
    elif "avx2" in flags:
        found = "avx2"
    else:
        found = "default"
    caps = [found]
    isa = environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA")
    if isa and isa.upper() != "ALL":
        caps.append(_ONEDNN_CAPS.get(isa.upper(), "default"))
    aten = environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if aten in ("default", "avx2"):  # torch's kernels at that width; "avx512" leaves them
        caps.append(aten)
    return min(caps, key=CPU_CLASSES.index)


@functools.cache
def bf16_matmul_is_fast(device: torch.device) -> bool:
    """Whether a bf16 GEMM on `device` runs at least at fp32's rate: on CPU, whether its
    class multiplies bf16 natively (`cpu_class`: AVX512-BF16 or AMX). A table, not a timing.

    The table's figures, by CPU class: docs/BENCHMARKS.md, "bf16 against fp32 GEMMs".
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return cpu_class() in ("avx512_bf16", "amx")


def compute_dtype(
    stored: torch.dtype, device: torch.device, quantized: bool, exact: bool = False
) -> torch.dtype:
    """The activations' dtype for weights stored in `stored` (see the module docstring);
    exact: every quantized weight is a kind qinfer's kernels multiply by fp32 activations."""
    if quantized:
        return torch.float32 if exact and device.type == "cpu" else torch.bfloat16
    if stored in (torch.bfloat16, torch.float16) and device.type == "cpu":
        return torch.bfloat16 if bf16_matmul_is_fast(device) else torch.float32
    return stored
