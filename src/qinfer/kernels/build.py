"""The kernels' one library, `qinfer_kernels`: the C++ sources beside this file, built with
the system C++ compiler and ninja on first use into
~/.cache/qinfer/extensions/<torch version>-<hash of the sources, headers and flags>, so that
it is rebuilt only when one of them changes, then loaded (its ops are `torch.ops.qinfer.*`).
`available()` says why it cannot be used here (None when it can); a failed build names the
source the compiler stopped on.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from qinfer.kernels import registry

LIBRARY = "qinfer_kernels"
_HERE = Path(__file__).parent
# Every source here is compiled into the library: one per weight format or op
# (docs/KERNELS.md), and library.cpp, which registers them. A new op's source needs no line.
SOURCES = tuple(sorted(_HERE.glob("*.cpp")))
# What the sources include: part of the build's name, and of what an install must hold.
HEADERS = tuple(sorted(_HERE.glob("*.h")))
# -fopenmp: at::parallel_for is inline and runs serially unless compiled with OpenMP; the
# library then links libgomp.so.1, the one torch has already loaded (the same soname), so the
# kernel shares torch's thread pool and torch.set_num_threads.
# -ffp-contract=off: no fused multiply-adds but the written ones, so the fp32 order in the
# source is the order that runs. -fno-trapping-math: no code kept for the fp exception flags
# (which nothing reads), so that a loop with a clamp (`exp_fp32`'s) vectorizes on AVX2 as on
# AVX-512 (GCC kept the AVX2 one scalar); every result is the same, only flags could differ.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]
_LDFLAGS = ["-fopenmp"]


def on_x86() -> bool:
    """Whether this machine is one the kernels are written for (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def build_directory() -> Path:
    """Where these sources are built for this torch (the name changes with either)."""
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    digest = hashlib.sha256(sources + " ".join(_CFLAGS + _LDFLAGS).encode())
    return (
        Path.home()
        / ".cache"
        / "qinfer"
        / "extensions"
        / (f"{torch.__version__}-{digest.hexdigest()[:16]}")
    )


@registry.constant_in_graphs
@functools.cache
def available() -> str | None:
    """None if the kernels are loaded (building them the first time), else the one-line reason
    they cannot be: not x86-64, no compiler or ninja, or the build failed."""
    if not on_x86():
        machine = platform.machine() or "unknown"
        return f"qinfer's CPU kernels are x86-64 only, this machine is {machine}"
    if _HERE / "library.cpp" not in SOURCES:  # an install that left out the package data
        return f"the kernel sources are not installed in {_HERE}"
    directory = build_directory()
    try:
        # built before for these sources, flags and torch (the directory's name says so):
        # load it without cpp_extension, whose ninja check and imports take 0.2 s
        torch.ops.load_library(str(directory / f"{LIBRARY}.so"))
    except OSError:  # not built yet, or an interrupted build left no loadable library
        pass
    else:
        return registry.bind()
    reason = _missing_tool() or compile_library(SOURCES, directory)
    return reason if reason is not None else registry.bind()


def compile_library(sources: Sequence[Path], directory: Path, name: str = LIBRARY) -> str | None:
    """Builds and loads `sources` as the library `name` in `directory`: None, or why it failed
    in one line that names the source the compiler stopped on."""
    from torch.utils import cpp_extension

    try:
        directory.mkdir(parents=True, exist_ok=True)
        # is_python_module=False: a plain shared library whose TORCH_LIBRARY block registers
        # torch.ops.qinfer.*, so no torch/extension.h and pybind11 (that header alone takes
        # 35 s to compile on a 2-core EPYC, the four ATen headers a source needs 7.5 s)
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=str(directory),
            verbose=False,
            is_python_module=False,
        )
    except Exception as error:  # a compiler's or loader's message, many lines: keep the gist
        return _build_failure(error, sources, name)
    return None


def _build_failure(error: Exception, sources: Sequence[Path], name: str) -> str:
    """'building <source> failed (<the first error line>)': ninja's "FAILED: <stem>.o" names
    the object of the source that failed; a link or load error names the library."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    objects = {f"{source.stem}.o": source.name for source in sources}
    failed = next(
        (
            objects[line.split()[-1]]
            for line in lines
            if line.startswith("FAILED:") and line.split()[-1] in objects
        ),
        f"the {name} library",
    )
    gist = next(
        (line for line in lines if ": error" in line or "error:" in line),
        next((line for line in lines if "error" in line.lower()), lines[0] if lines else ""),
    )
    return f"building {failed} failed ({type(error).__name__}: {gist[:200]})"


def buildable() -> bool:
    """Whether `available()` can be expected to load the kernels without building anything
    first being known to fail: x86-64, the sources installed, and the library built already
    or a compiler and ninja at hand. Cheap (no build), for listing the paths a layer has."""
    if not on_x86() or not all(f.is_file() for f in SOURCES + HEADERS):
        return False
    return (build_directory() / f"{LIBRARY}.so").is_file() or _missing_tool() is None


@functools.cache
def _missing_tool() -> str | None:
    """Why the library cannot be built here (no compiler, no ninja), or None."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build the {LIBRARY} library"
    if not cpp_extension.is_ninja_available():
        return f"no ninja to build the {LIBRARY} library"
    return None


def require() -> None:
    """Raises the reason the kernels cannot be used here, if any."""
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
