"""Compiled CPU kernels, built on first use: int4 and int8 weights times int8 activations,
int8 blocks and int4 groups times fp32 activations, a block's residual add + RMSNorm, decode
attention over the paged KV pool, and RoPE.

    packed = pack_int4(groups)     # Int4Groups of 32 (q (N, K) 0..15, scales, zeros (N, K/32))
    y = int4_mm(x, packed)         # x (M, K) fp32 or bf16 -> y (M, N) fp32, ~ x @ W.T
    y = int8_mm(x, q, scales)      # int8 rows q (N, K), fp32 scales (N,): ~ x @ (q * s).T
    y = int8_blocks_mm(x, q, d)    # int8 q (N, K), fp32 scales d (N, K/B), B = 16 or 32:
                                   #   x @ W.T, W = q * d per block, neither operand rounded
    y = int4_groups_mm(x, packed)  # the packed int4 weight, x fp32 or bf16 as it is:
                                   #   x @ W.T, W = d q + m, per block d (q . x) + m sum(x)
    y = add_rms_norm(h, x, w, eps, dtype)  # h (T, H) fp32 += x (in place; x None: as it is),
                                   #   y = h / sqrt(mean(h^2) + eps) * w in dtype (fp32, bf16)
    y = heads_rms_norm(h, w1, w2, first, eps, dtype)  # QK-norm: h (T, R, D) heads, read
                                   #   only, each normed as above by w1 (first heads) or w2
    out = paged_decode_attention(q, k, v, keys, values, slots, positions, tables, totals,
                                 key_starts, block_size, window, scale)
                                   # one new token per sequence: k, v stored in the pool,
                                   #   q (G, Hq, D) attends its sequence's keys -> (G, Hq, D)
    y = rope(x, cos, sin)          # x (T, H, D) fp32 rotated (rotate-half), torch's bits

What it computes, the way llama.cpp multiplies Q4_1 weights by Q8_1 activations:

- the weight, per block b of 32 input columns of output row n: w = d[n, b] * q + m[n, b],
  q in 0..15, d = scale and m = zero - 8 * scale (the same weight as `Int4Groups`'
  (q - 8) * scale + zero, m rounded once to fp32); qs (N, K/2) uint8 holds a block's 32
  nibbles in 16 bytes, element j in the low nibble of byte j, element j + 16 in its high one.
- each row of x, per block of 32: dx = max|x| / 127, qx = round(x * (1 / dx)) in int8 (round
  half to even), and sum(qx) kept per block (Q8_1).
- y[r, n] = sum_b dx[r, b] * (d[n, b] * (q[n, b, :] . qx[r, b, :]) + m[n, b] * sum(qx[r, b]))
  with the dot products in integers (AVX512-VNNI vpdpbusd, or AVX2 vpmaddubsw + vpmaddwd) and
  the rest in fp32, in an order fixed by K alone (`int_dot.cpp`'s header).
- int8 rows (`Int8Linear`'s q (N, K) and per-row scales, read where they are, no copy):
  y[r, n] = scale[n] * sum_b dx[r, b] * (q[n, b, :] . qx[r, b, :]), the signed products as
  llama.cpp's q8_0 dot takes them (|q| times qx with q's sign).

- int8 blocks (`Int8BlockLinear`: GGUF's Q8_0, Q5_0 and Q6_K values, exact as int8 with one
  scale per block of 32, or of 16 for Q6_K): y[r, n] = sum_b d[n, b] * (q[n, b, :] . x[r, b, :])
  in fp32 fused multiply-adds, bf16 activations widened exactly. Nothing is rounded but the
  sums: what a per-row int8 copy of those blocks costs (Gemma 3 270M Q4_K_M's default path:
  KL to fp32 0.0068, 0.0005 with the blocks kept) is not paid.
- int4 groups (`Int4BlockLinear`: Q4_0, Q4_1 and Q4_K values in the layout above, fp32 d and
  m): y[r, n] = sum_b d[n, b] * (q[n, b, :] . x[r, b, :]) + m[n, b] * sum(x[r, b, :]) in fp32
  fused multiply-adds, the nibbles exact, bf16 activations widened exactly, four blocks of
  a column per 64-byte load (`int_dot.cpp`, above the int4 groups' fp32 tiles).

- residual add + RMSNorm (`rms_norm.cpp`: a decoder block's pre-norm on the fp32 residual
  stream): per row, h += x (x fp32, or bf16 widened exactly), the squares of h summed in fp32
  in an order fixed by H and the path, r = 1 / sqrt(sum / H + eps), out = (h * r) * w rounded
  once to the output dtype (round half to even). w is the fp32 scale as `RMSNorm` holds it
  (Gemma's 1 + w added already). Within fp32 rounding of torch's `F.rms_norm`, not its bits
  (torch sums the squares in another order). Rows are split between threads whole, so a row's
  output is the same in any batch and on any thread count; paths "scalar", "avx2", "avx512"
  (`norm_paths()`), picked once per CPU as the dot products' are. Why: torch runs
  `F.rms_norm` on CPU as about nine ops a call, each a dispatch of a few µs on a row of 576
  floats; a decode step calls it twice a layer.

- decode attention (`paged_decode.cpp`, the paged backend's decode steps): per (sequence,
  query head), over the keys its table and window make visible, fp32 scores q k * scale in
  16 lanes and a fixed tree, exp by a polynomial within 2 ulp, the softmax's sum and the
  weighted values in key order, one rounding to q's dtype; the query heads of one KV head
  read its keys and values together (up to 4 a task), tasks split between threads whole, so
  a query's output depends on its own history alone (batch and thread-count invariant). The
  lanes are GCC vector types, cloned per ISA (`target_clones`): every clone computes the
  same bits. Why: torch runs a decode step's
  attention as ~20 ops a layer (the K/V copy, the keys' gather and widening, bmm, mask,
  softmax, the values' embedding_bag), each a dispatch of a few µs at these sizes.
- RoPE (`paged_decode.cpp`): the rotate-half rotation of fp32 heads, each product rounded
  then summed, as torch's eight ops compute it (bit for bit).

`in_use()` says whether the layers take these ops (RMSNorm, RoPE, decode attention):
the kernels load and `QINFER_CPU_KERNELS` is not "off" (the pure-torch path, kept).

Each op runs under the CPU dispatch key and has a fake kernel (`_register_python_kernels`: the
output's shape and dtype from the inputs'), so `torch.compile` traces a graph through it
(bench/compiled_decode.py compiles a whole decode step so); the machine's answers
(`available`, `in_use`, the auto paths) are constants of such a graph.

Why: torch's int4 kernel (`Int4Linear`) converts every weight nibble to bf16 and multiplies in
floating point; integer dot products multiply four int8 pairs per lane per instruction and read
activations of a byte, so at decode (a few rows) the weight read can bound the time and at
prefill the multiply is cheaper. The price is the activations' int8 rounding: each output
moves by at most sum_b dx[r, b] / 2 * sum_j |w[n, b, j]| from x @ W.T (tested), as it does in
llama.cpp. d and m are fp32 here, 0.75 bytes a weight in all against torch's 0.5625 (bf16
scales and zeros): more to read at decode.

Each output row depends only on its own row of x: the same instructions in the same order
whatever M is, whichever rows share a tile and however N is split between threads (qinfer's
batch invariance). The path (`paths()`: "vnni", "avx2", "scalar") is picked once per CPU
(`auto_path`), never per call; `path=` forces one (the tests compare them), and the paths
round differently.

The extension builds with the system C++ compiler and ninja into
~/.cache/qinfer/extensions/<torch version>-<hash of the source and flags>, so it is rebuilt only
when either changes; `available()` says why it cannot be used here (None when it can).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar

import torch

# One library from all the sources: one build, one cache directory.
_SOURCE = Path(__file__).with_name("int_dot.cpp")
_SOURCES = (_SOURCE, *(Path(__file__).with_name(n) for n in ("rms_norm.cpp", "paged_decode.cpp")))
# What the sources include: part of the build's name, and of what an install must hold.
_HEADERS = (Path(__file__).with_name("common.h"),)
_NAME = "qinfer_int_dot"
# -fopenmp: at::parallel_for is inline and runs serially unless compiled with OpenMP; the
# library then links libgomp.so.1, the one torch has already loaded (the same soname), so the
# kernel shares torch's thread pool and torch.set_num_threads.
# -ffp-contract=off: no fused multiply-adds but the written ones, so the fp32 order in the
# source is the order that runs.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]
BLOCK = 32  # input columns per weight / activation block
#: The activation dtypes the kernels take (fp16 is not one).
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
# The op, bound once the library is loaded: torch.ops' attribute lookups and the overload
# resolution cost about 3 µs a call, a tenth of a small decode matmul.
_int4_mm = _int8_mm = _int8_blocks_mm = _int4_groups_mm = _add_rms_norm = _heads_rms_norm = None
_paged_decode_attention = _rope = None


class Int4Groups(Protocol):
    """What `pack_int4` reads (`qinfer.linear.int4.Int4Groups` is one; named by shape here,
    so that the kernels import nothing of the layers that use them)."""

    q: torch.Tensor  # (N, K) uint8, 0..15
    scales: torch.Tensor  # (N, K / group) fp32
    zeros: torch.Tensor  # (N, K / group) fp32

    @property
    def group_size(self) -> int: ...


@dataclass(frozen=True)
class PackedInt4:
    """A weight for `int4_mm`: qs (N, K/2) uint8, d and m (N, K/32) fp32 (w = d q + m)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), as the weight's."""
        return (self.qs.shape[0], 2 * self.qs.shape[1])


#: What `torch.compiler.assume_constant_result` sets on a function, set here without it:
#: that decorator imports torch._dynamo, 71 MB of resident memory in every process that
#: loads the kernels (tests/test_kernel_tracing.py checks that the two still agree).
CONSTANT_MARK = "_dynamo_marked_constant"

T = TypeVar("T")


def _constant_in_graphs(cached: Callable[[], T]) -> Callable[[], T]:
    """A cached answer about the machine (not about tensors), which `torch.compile` takes
    as a constant of the graph it traces instead of tracing into (the build, the CPU's
    flags). `cache_clear` is the cached function's, as the tests use it."""

    def answer() -> T:
        return cached()

    functools.update_wrapper(answer, cached)
    answer.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    answer.cache_info = cached.cache_info  # type: ignore[attr-defined]
    setattr(answer, CONSTANT_MARK, True)
    return answer


@functools.cache
def build_directory() -> Path:
    """Where this source is built for this torch (the name changes with either)."""
    sources = b"".join(source.read_bytes() for source in _SOURCES + _HEADERS)
    digest = hashlib.sha256(sources + " ".join(_CFLAGS + _LDFLAGS).encode())
    return (
        Path.home()
        / ".cache"
        / "qinfer"
        / "extensions"
        / (f"{torch.__version__}-{digest.hexdigest()[:16]}")
    )


def on_x86() -> bool:
    """Whether this machine is one the kernels are written for (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def available() -> str | None:
    """None if the kernels are loaded (building them the first time), else the one-line reason
    they cannot be: not x86-64, no compiler or ninja, or the build failed."""
    if not on_x86():
        machine = platform.machine() or "unknown"
        return f"the int4 dot kernels are x86-64 only, this machine is {machine}"
    missing_source = next((f for f in _SOURCES + _HEADERS if not f.is_file()), None)
    if missing_source is not None:  # an install that left a .cpp out of the package data
        return f"the kernel source {missing_source} is not installed"
    directory = build_directory()
    built = directory / f"{_NAME}.so"
    try:
        # built before for this source, flags and torch (the directory's name says so):
        # load it without cpp_extension, whose ninja check and imports take 0.2 s
        torch.ops.load_library(str(built))
    except OSError:  # not built yet, or an interrupted build left no loadable library
        pass
    else:
        return _bind()
    missing = _missing_tool()
    if missing is not None:
        return missing
    from torch.utils import cpp_extension

    try:
        directory.mkdir(parents=True, exist_ok=True)
        # is_python_module=False: a plain shared library whose TORCH_LIBRARY block registers
        # torch.ops.qinfer.*, so no torch/extension.h and pybind11 (that header alone takes
        # 35 s to compile on a 2-core EPYC, the four ATen headers the source needs 7.5 s)
        cpp_extension.load(
            name=_NAME,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=str(directory),
            verbose=False,
            is_python_module=False,
        )
    except Exception as error:  # a compiler's or loader's message, many lines: keep the gist
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        gist = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
        return f"building {_SOURCE.name} failed ({type(error).__name__}: {gist[:200]})"
    return _bind()


available = _constant_in_graphs(available)


#: Set to "off" (or "0"), the layers' own ops (RMSNorm, RoPE, decode attention) run as
#: torch's where the kernels would: the pure-torch path, to compare or to fall back to.
#: The linear layers' paths have their own switch (`QINFER_LINEAR_PATH`).
SWITCH = "QINFER_CPU_KERNELS"


@functools.cache
def in_use() -> bool:
    """Whether the layers' compiled ops run here: the kernels load (building them the first
    time) and `SWITCH` does not turn them off. Where they cannot load on an x86-64 CPU, the
    reason is said once, as a warning."""
    if os.environ.get(SWITCH, "").strip().lower() in ("off", "0"):
        return False
    reason = available()
    if reason is not None and on_x86():
        warnings.warn(
            f"RMSNorm, RoPE and decode attention run as torch's ops (slower): {reason}",
            stacklevel=4,  # past `_constant_in_graphs`'s frame: the caller's caller
        )
    return reason is None


in_use = _constant_in_graphs(in_use)


def buildable() -> bool:
    """Whether `available()` can be expected to load the kernels without building anything
    first being known to fail: x86-64, the source installed, and the library built already
    or a compiler and ninja at hand. Cheap (no build), for listing the paths a layer has."""
    if not on_x86() or not all(f.is_file() for f in _SOURCES + _HEADERS):
        return False
    return (build_directory() / f"{_NAME}.so").is_file() or _missing_tool() is None


@functools.cache
def _missing_tool() -> str | None:
    """Why the extension cannot be built here (no compiler, no ninja), or None."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build {_SOURCE.name}"
    if not cpp_extension.is_ninja_available():
        return f"no ninja to build {_SOURCE.name}"
    return None


def _bind() -> None:
    global _int4_mm, _int8_mm, _int8_blocks_mm, _int4_groups_mm, _add_rms_norm, _heads_rms_norm
    global _paged_decode_attention, _rope
    _register_python_kernels()
    _int4_mm = torch.ops.qinfer.int4_mm.default
    _int8_mm = torch.ops.qinfer.int8_mm.default
    _int8_blocks_mm = torch.ops.qinfer.int8_blocks_mm.default
    _int4_groups_mm = torch.ops.qinfer.int4_groups_mm.default
    _add_rms_norm = torch.ops.qinfer.add_rms_norm.default
    _heads_rms_norm = torch.ops.qinfer.heads_rms_norm.default
    _paged_decode_attention = torch.ops.qinfer.paged_decode_attention.default
    _rope = torch.ops.qinfer.rope.default


#: The devices whose tensors the ops refuse in one line (the dispatcher's own message for a
#: device with no kernel is some 40 lines).
REFUSED_DEVICES = ("cuda", "mps", "xpu")


def _register_python_kernels() -> None:
    """What each op returns, by shape and dtype alone (torch's "fake" kernels): what
    `torch.compile` and `torch.export` trace a graph of qinfer's ops with. The C++ side
    registers the ops' CPU kernels under the CPU dispatch key, so that these may stand for
    them on fake and meta tensors. A tensor on another device (`REFUSED_DEVICES`) is refused
    in one line that names the op (`refusal`)."""
    fake = torch.library.register_fake

    def rows_by_columns(x: torch.Tensor, columns: torch.Tensor, *_: object) -> torch.Tensor:
        return x.new_empty((x.shape[0], columns.shape[0]), dtype=torch.float32)  # (M, N)

    def quantized(x: torch.Tensor, path: str = "auto") -> tuple[torch.Tensor, ...]:
        M, K = x.shape
        blocks = (M, K // BLOCK)
        return (
            x.new_empty((M, K), dtype=torch.int8),
            x.new_empty(blocks, dtype=torch.float32),
            x.new_empty(blocks, dtype=torch.int32),
        )

    def add_normed(h, x, w, eps, dtype: torch.dtype, path="auto") -> torch.Tensor:  # noqa: ANN001
        return h.new_empty(h.shape, dtype=dtype)

    def heads_normed(h, w1, w2, first, eps, dtype: torch.dtype, path="auto") -> torch.Tensor:  # noqa: ANN001
        return h.new_empty(h.shape, dtype=dtype)

    def like(x: torch.Tensor, *_: object) -> torch.Tensor:  # attention's q, RoPE's x
        return x.new_empty(x.shape)

    for name, kernel in (
        ("int4_mm", rows_by_columns),
        ("int8_mm", rows_by_columns),
        ("int8_blocks_mm", rows_by_columns),
        ("int4_groups_mm", rows_by_columns),
        ("quantize_q8_1", quantized),
        ("add_rms_norm", add_normed),
        ("heads_rms_norm", heads_normed),
        ("paged_decode_attention", like),
        ("rope", like),
    ):
        fake(f"qinfer::{name}")(kernel)
        torch.library.impl(f"qinfer::{name}", REFUSED_DEVICES, refusal(name))


def refusal(name: str) -> Callable[..., NoReturn]:
    """The kernel op `name` runs on tensors off the CPU: a one-line error naming the op and
    the devices of its tensor arguments."""

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        devices = sorted(
            {str(a.device) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        )
        raise RuntimeError(
            f"qinfer::{name} runs on CPU tensors only, got tensors on {', '.join(devices)}"
        )

    return refuse


def _require() -> None:
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)


def paths() -> tuple[str, ...]:
    """The dot-product paths this CPU can run, slowest first ("scalar", "avx2", "vnni")."""
    _require()
    return tuple(torch.ops.qinfer.int4_paths().split(","))


#: ATEN_CPU_CAPABILITY (torch's cap on its own CPU kernels, which emulates a smaller CPU) ->
#: the fastest path it allows.
_CAPS = {"default": "scalar", "avx2": "avx2"}


@functools.cache
def auto_path() -> str:
    """The path `path="auto"` takes: the fastest this CPU runs, capped as torch caps its own
    kernels by ATEN_CPU_CAPABILITY (so an emulated AVX2 machine rounds as a real one)."""
    return _capped(paths())


auto_path = _constant_in_graphs(auto_path)


def norm_paths() -> tuple[str, ...]:
    """The paths `add_rms_norm` can take on this CPU, slowest first ("scalar", "avx2",
    "avx512")."""
    _require()
    return tuple(torch.ops.qinfer.norm_paths().split(","))


@functools.cache
def norm_auto_path() -> str:
    """The path `add_rms_norm(path="auto")` takes: the fastest, capped as `auto_path`."""
    return _capped(norm_paths())


norm_auto_path = _constant_in_graphs(norm_auto_path)


def _capped(here: tuple[str, ...]) -> str:
    cap = _CAPS.get(os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower())
    return cap if cap in here else here[-1]


def pack_int4(groups: Int4Groups) -> PackedInt4:
    """The kernel's layout of int4 groups of 32 (module docstring)."""
    _require()
    if groups.group_size != BLOCK:
        raise ValueError(
            f"pack_int4: the kernel takes int4 groups of {BLOCK}, got groups of {groups.group_size}"
        )
    qs, d, m = torch.ops.qinfer.pack_int4(groups.q, groups.scales, groups.zeros)
    return PackedInt4(qs, d, m)


def int4_mm(x: torch.Tensor, packed: PackedInt4, path: str = "auto") -> torch.Tensor:
    """(M, K) fp32 or bf16 times the packed (N, K) weight, transposed -> (M, N) fp32."""
    if _int4_mm is None:
        _require()
    return _int4_mm(x, packed.qs, packed.d, packed.m, auto_path() if path == "auto" else path)


def int8_mm(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, path: str = "auto"
) -> torch.Tensor:
    """(M, K) fp32 or bf16 times int8 rows q (N, K) with one fp32 scale per row (N,),
    transposed -> (M, N) fp32: scales[n] * sum_b dx[r, b] (q[n, b] . qx[r, b]), the
    activations rounded per block of 32 as `int4_mm` rounds them (llama.cpp's q8_0 dot)."""
    if _int8_mm is None:
        _require()
    return _int8_mm(x, q, scales, auto_path() if path == "auto" else path)


def int8_blocks_mm(
    x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, path: str = "auto"
) -> torch.Tensor:
    """(M, K) fp32 or bf16 times int8 q (N, K) with one fp32 scale per block of B input
    columns, d (N, K/B) for B = 16 or 32, transposed -> (M, N) fp32: sum_b d[n, b] *
    (q[n, b] . x[r, b]), the activations as they are (bf16 widened exactly)."""
    if _int8_blocks_mm is None:
        _require()
    return _int8_blocks_mm(x, q, d, auto_path() if path == "auto" else path)


def int4_groups_mm(x: torch.Tensor, packed: PackedInt4, path: str = "auto") -> torch.Tensor:
    """(M, K) fp32 or bf16 times the packed (N, K) weight, transposed -> (M, N) fp32: per
    block of 32, d (q . x) + m sum(x) with the nibbles q exact and the activations as they
    are (bf16 widened exactly), in fp32 fused multiply-adds: x @ W.T of the exact weight W =
    d q + m to fp32 accuracy (`int_dot.cpp`, above the int4 groups' tiles)."""
    if _int4_groups_mm is None:
        _require()
    return _int4_groups_mm(
        x, packed.qs, packed.d, packed.m, auto_path() if path == "auto" else path
    )


def quantize_q8_1(x: torch.Tensor, path: str = "auto") -> tuple[torch.Tensor, ...]:
    """The activations as `int4_mm` quantizes them: qx (M, K) int8, dx (M, K/32) fp32 and
    sum(qx) (M, K/32) int32, computed by the path's own code."""
    _require()
    return tuple(torch.ops.qinfer.quantize_q8_1(x, auto_path() if path == "auto" else path))


def add_rms_norm(
    h: torch.Tensor,
    x: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    path: str = "auto",
) -> torch.Tensor:
    """h (T, H) fp32 contiguous += x (T, H) fp32 or bf16, in place (x None: h unchanged);
    returns h * (1 / sqrt(mean(h^2) + eps)) * w (w (H,) fp32) in `dtype` (fp32 or bf16)."""
    if _add_rms_norm is None:
        _require()
    return _add_rms_norm(h, x, w, eps, dtype, norm_auto_path() if path == "auto" else path)


def heads_rms_norm(
    h: torch.Tensor,
    w_first: torch.Tensor,
    w_rest: torch.Tensor,
    first: int,
    eps: float,
    dtype: torch.dtype,
    path: str = "auto",
) -> torch.Tensor:
    """QK-norm: h (T, R, D) fp32 heads (last dimension contiguous, any other strides), read
    only -> (T, R, D) in `dtype`, head r normed as `add_rms_norm`'s row with x None, by
    w_first (D,) fp32 for r < first and by w_rest (D,) fp32 after."""
    if _heads_rms_norm is None:
        _require()
    return _heads_rms_norm(
        h, w_first, w_rest, first, eps, dtype, norm_auto_path() if path == "auto" else path
    )


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor | None,
    positions: torch.Tensor,
    tables: torch.Tensor,
    totals: torch.Tensor,
    key_starts: torch.Tensor | None,
    block_size: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence: q (G, Hq, D), k and v (G, Hkv, D) fp32 or bf16 -> (G, Hq, D)
    in q's dtype. Stores k, v into one layer's pool keys, values (Hkv, slots, D) fp32 or bf16
    at `slots` (G,) (k, v and slots None: stored already), then attends each query at
    `positions` (G,) to its sequence's keys:
    those of its table (G, W) of blocks of `block_size` slots, from position key_starts[g]
    (None: 0) up to totals[g] (G,), within `window` (None: all). `paged_decode.cpp` says
    the arithmetic (fp32, every sum in key order)."""
    if _paged_decode_attention is None:
        _require()
    return _paged_decode_attention(
        q,
        k,
        v,
        keys,
        values,
        slots,
        positions,
        tables,
        totals,
        key_starts,
        block_size,
        0 if window is None else window,
        scale,
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) fp32 rotated by cos, sin (T, R/2) fp32 (rotate-half, the first R of D
    dimensions) -> (T, H, D): `RoPE.apply` in fp32 as one op, bit for bit."""
    if _rope is None:
        _require()
    return _rope(x, cos, sin)
