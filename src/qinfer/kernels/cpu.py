"""What this CPU runs of the kernels: the paths each op can take, the one `path="auto"`
takes (`auto_path`, `norm_auto_path`), and whether the layers take the kernels at all
(`in_use`). The library detects the CPU's instruction sets once, for every source (isa.h,
`torch.ops.qinfer.cpu_isas`); each op's paths are the ISAs of its ladder the CPU runs, and
"auto" is the library's own choice (`torch.ops.qinfer.auto_path`).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from qinfer.kernels import build, registry

#: The dot products' paths (int4_mm, int8_mm, int8_blocks_mm, int4_groups_mm,
#: quantize_q8_1), slowest first. "amx": VNNI's bits, int4_mm's and int8_mm's products of
#: 32 rows or more on AMX-INT8's tiles (where the CPU has them and Linux lets the process use
#: them, or on the kernels' software model of them under QINFER_AMX=emulate; QINFER_AMX=off:
#: no "amx").
DOT_PATHS = ("scalar", "avx2", "vnni", "amx")
#: add_rms_norm's, heads_rms_norm's and lora_add's paths, slowest first.
NORM_PATHS = ("scalar", "avx2", "avx512")

#: Set to "off" (or "0"), the layers' own ops (RMSNorm, RoPE, decode attention, LoRA) run as
#: torch's where the kernels would: the pure-torch path, to compare or to fall back to.
#: The linear layers' paths have their own switch (`QINFER_LINEAR_PATH`).
SWITCH = "QINFER_CPU_KERNELS"


@functools.cache
def _isas() -> frozenset[str]:
    build.require()
    return frozenset(torch.ops.qinfer.cpu_isas().split(","))


def paths() -> tuple[str, ...]:
    """The dot-product paths this CPU can run, slowest first ("scalar", "avx2", "vnni",
    "amx")."""
    return tuple(p for p in DOT_PATHS if p in _isas())


def norm_paths() -> tuple[str, ...]:
    """The paths `add_rms_norm` can take on this CPU, slowest first ("scalar", "avx2",
    "avx512")."""
    return tuple(p for p in NORM_PATHS if p in _isas())


@registry.constant_in_graphs
@functools.cache
def auto_path() -> str:
    """The path `path="auto"` takes: the fastest this CPU runs, capped as torch caps its own
    kernels by ATEN_CPU_CAPABILITY (so an emulated AVX2 machine rounds as a real one; the
    library's answer, isa.h's `best`, which the ops' "auto" takes)."""
    build.require()
    return torch.ops.qinfer.auto_path("dot")


@registry.constant_in_graphs
@functools.cache
def norm_auto_path() -> str:
    """The path `add_rms_norm(path="auto")` takes: the fastest, capped as `auto_path`."""
    build.require()
    return torch.ops.qinfer.auto_path("vector")


@registry.constant_in_graphs
@functools.cache
def in_use() -> bool:
    """Whether the layers' compiled ops run here: the kernels load (building them the first
    time) and `SWITCH` does not turn them off. Where they cannot load on an x86-64 CPU, the
    reason is said once, as a warning."""
    if os.environ.get(SWITCH, "").strip().lower() in ("off", "0"):
        return False
    reason = build.available()
    if reason is not None and build.on_x86():
        warnings.warn(
            f"RMSNorm, RoPE and decode attention run as torch's ops (slower): {reason}",
            stacklevel=4,  # past `constant_in_graphs`'s frame: the caller's caller
        )
    return reason is None
