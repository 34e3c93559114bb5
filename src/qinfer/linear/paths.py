"""Ways to multiply by a quantized weight, and the rule that picks one per call by row count.

A quantized Linear (int8 rows, int8 blocks, int4 groups) can run a call in several ways
("paths"):

- `kernel`: the kind's weight-only kernel (torch's `_weight_int8pack_mm` and
  `_weight_int4pack_mm_for_cpu`, qinfer's `int8_blocks_mm` for int8 blocks; see each kind)
  with the activations in the compute dtype: reads the compact weight once, so it wins at
  decode (1-8 rows), but it does not block like a GEMM and loses at prefill shapes.
- `fp32_tiles`: dequantize the weight a tile of output rows at a time into one reused fp32
  buffer and run torch's fp32 GEMM on each tile (activations widened to fp32, the result
  rounded back): the fast prefill path on CPUs whose bf16 GEMM is slow (AVX2 only).
- `bf16_tiles`: the same into a bf16 buffer with a bf16 GEMM: the fast prefill path where
  bf16 GEMMs are fast (AVX512-BF16, AMX).
- `int8_dot` (x86 CPUs with a C++ compiler; int8 rows, int8 blocks, and int4 groups of 32:
  a kind's own path): the compiled kernels of `qinfer.kernels`, activations rounded to int8 per block of
  32 and multiplied in integer dot products, as llama.cpp multiplies Q4 and Q8 weights: the
  rule's choice for both buckets unless the model is `exact`. At its first call it
  builds the kernels if need be and takes the kernel's view of the weight: int8 rows and
  blocks as they are (and fp32 scales), int4 groups as a second, repacked copy.

Which path a layer takes is set per row bucket (`DECODE_MAX_ROWS` rows or fewer: the decode
choice; more: the prefill choice) by `qinfer.linear.choose`'s rule; a call costs one
comparison and one attribute read to pick. The buffers are shared by every layer of a
thread (about `TILE_BYTES` each, one fp32 and one bf16), made at a tile path's first call,
so the tile paths never hold a dequantized copy of a whole weight and cost no memory where
no layer takes them.
"""

from __future__ import annotations

import functools
import threading
from abc import abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.core.errors import WeightsError
from qinfer.linear.base import Linear
from qinfer.linear.logits import EXACT_TOP_INT8, fp32_logits

#: Calls with at most this many rows (of the flattened activations) take the decode choice.
DECODE_MAX_ROWS = 16
#: Bytes of one dequantized tile: small enough to stay in the cache next to the GEMM's.
TILE_BYTES = 4 << 20
KERNEL, FP32_TILES, BF16_TILES, INT8_DOT = "kernel", "fp32_tiles", "bf16_tiles", "int8_dot"
#: Every path name.
PATHS = (KERNEL, FP32_TILES, BF16_TILES, INT8_DOT)
#: Paths only some kinds have: forced, they apply to the layers that have them.
KIND_PATHS = (INT8_DOT,)
#: Paths that compute a row alike at any row count: the head's (`same_at_any_rows`).
ROW_INVARIANT = (KERNEL, INT8_DOT)
BUCKETS = ("decode", "prefill")

_TILE_DTYPES = {FP32_TILES: torch.float32, BF16_TILES: torch.bfloat16}
_scratch = threading.local()  # per thread: {(dtype, device): 1-D tensor}


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer of at least `numel` elements, shared by every layer of this thread.

    Made outside inference mode, so it can be written in place under and outside it.
    """
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get((dtype, device))
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):
            buffer = torch.empty(numel, dtype=dtype, device=device)
        buffers[(dtype, device)] = buffer
    return buffer[:numel]


class QuantizedLinear(Linear):
    """A Linear whose weight can be multiplied by along several paths (module docstring).

    A kind provides the kernel call (`_kernel`), how to dequantize a range of output rows
    into a buffer (`_dequantize_rows`), the per-output-channel scales applied after the
    GEMM (`_output_scales`, or None) and the row multiple its tiles must keep
    (`_tile_multiple`). Every layer starts on the kernel path for both buckets.
    """

    _tile_multiple = 1

    def _init_paths(self) -> None:
        self._decode: Callable[[torch.Tensor], torch.Tensor] = self._kernel
        self._prefill: Callable[[torch.Tensor], torch.Tensor] = self._kernel
        self.chosen = {bucket: KERNEL for bucket in BUCKETS}
        # int8_dot's kernel bound to its view of the weight, made at its first call
        self._bound_dot: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._any_rows: Callable[[torch.Tensor], torch.Tensor] = self._kernel
        self.head_path = KERNEL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # (T, K): a model's flat tokens, as the kernels take them
            y = (self._decode if len(x) <= DECODE_MAX_ROWS else self._prefill)(x)
        else:  # (*P, K) -> (M, K) -> (*P, N)
            flat = x.reshape(-1, self.in_features)
            run = self._decode if flat.shape[0] <= DECODE_MAX_ROWS else self._prefill
            y = run(flat).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def same_at_any_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The head path (`use_head_path`) whatever the row count: torch's int4/int8 kernels
        and qinfer's int8_dot compute each row alike at any count (tested), the GEMMs of the
        tile paths do not."""
        flat = x.reshape(-1, self.in_features)
        y = self._any_rows(flat).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def use_head_path(self, path: str) -> None:
        """Take `path` (one of ROW_INVARIANT) in `same_at_any_rows` and so as the lm_head."""
        if path not in ROW_INVARIANT or path not in self.paths():
            raise WeightsError(
                f"{type(self).__name__} {tuple(self.shape_key())} has no head path {path!r} "
                f"here (it has: {', '.join(p for p in self.paths() if p in ROW_INVARIANT)})"
            )
        self._any_rows, self.head_path = self._path(path), path

    def logits(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """As `Linear.logits`; int8_dot takes the fp32 input as it is and writes fp32, its
        top EXACT_TOP_INT8 of each row recomputed."""
        if self.head_path == INT8_DOT:
            return fp32_logits(self, x, torch.float32, exact=False, top=EXACT_TOP_INT8)
        return fp32_logits(self, x, dtype)

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations, scales, bias)."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the weight lives."""

    def paths(self) -> tuple[str, ...]:
        """The paths this layer can take on its device (the kernel always; bf16 tiles only
        for bf16 activations: they would round an fp32 model's weights and activations;
        int8_dot where the kind can hand the compiled kernels its weight, the activations
        are fp32 or bf16 and the kernels can be built here)."""
        takes = self.dtype in kernels.ACTIVATION_DTYPES and self._dot_supported()
        dot = (INT8_DOT,) if takes and kernels.buildable() else ()
        if not self._tiles_supported():
            return (KERNEL, *dot)
        tiles = (FP32_TILES, BF16_TILES) if self.dtype == torch.bfloat16 else (FP32_TILES,)
        return (KERNEL, *tiles, *dot)

    def use_paths(self, decode: str, prefill: str) -> None:
        """Take `decode` for calls of up to DECODE_MAX_ROWS rows and `prefill` above."""
        for path in (decode, prefill):
            if path not in self.paths():
                raise WeightsError(
                    f"{type(self).__name__} {tuple(self.shape_key())} has no path {path!r} "
                    f"here (it has: {', '.join(self.paths())})"
                )
        self._decode, self._prefill = self._path(decode), self._path(prefill)
        self.chosen = {"decode": decode, "prefill": prefill}

    def run_path(self, path: str, flat: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) along `path`, without the bias (what `qinfer bench` times)."""
        return self._path(path)(flat)

    def shape_key(self) -> tuple:
        """What decides which path is fastest: (out, in) and what else the kind adds."""
        return (self.out_features, self.in_features)

    def _path(self, path: str) -> Callable[[torch.Tensor], torch.Tensor]:
        if path == KERNEL:
            return self._kernel
        if path == INT8_DOT:
            return self._int8_dot
        return functools.partial(self._tiles, dtype=_TILE_DTYPES[path])

    def _int8_dot(self, flat: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) through the compiled int8-activation kernel (`qinfer.kernels`),
        bound to the weight at the first call (the build, if any, then: one line if it fails)."""
        if self._bound_dot is None:
            reason = kernels.available()
            if reason is not None:
                raise WeightsError(
                    f"{type(self).__name__} {tuple(self.shape_key())} has no int8_dot path: {reason}"
                )
            self._bound_dot = self._dot_kernel()
        return self._bound_dot(flat).to(flat.dtype)

    def _dot_supported(self) -> bool:
        """Whether `_dot_kernel` can bind this layer's weight (none by default)."""
        return False

    def _dot_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """(M, K) -> (M, N) fp32: a `qinfer.kernels` op bound to this layer's weight."""
        raise WeightsError(f"{type(self).__name__} has no int8_dot path")

    def _tiles(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(M, K) -> (M, N): dequantize `tile` output rows at a time into a shared buffer of
        `dtype` and multiply by each (the GEMM in `dtype`, the result in flat's dtype)."""
        n, k = self.out_features, self.in_features
        step = self._tile_multiple
        tile = max(step, TILE_BYTES // (k * 4) // step * step)  # rows of one tile
        x = flat.to(dtype)
        scales = self._output_scales()
        if n <= tile:
            y = F.linear(x, self._dequantize_rows(0, n, dtype))
        else:
            y = x.new_empty(len(x), n)  # (M, N)
            for start in range(0, n, tile):
                stop = min(start + tile, n)
                y[:, start:stop] = F.linear(x, self._dequantize_rows(start, stop, dtype))
        if scales is not None:
            y = y * scales.to(dtype)
        return y.to(flat.dtype)

    @abstractmethod
    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) through torch's weight-only kernel, without the bias."""

    @abstractmethod
    def _tiles_supported(self) -> bool:
        """Whether `_dequantize_rows` works for this layer's storage and device."""

    @abstractmethod
    def _dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Weight rows start:stop as (stop - start, K) in `dtype` (fp32 or bf16), held in a
        `scratch` buffer (valid until the next call); start is a multiple of
        `_tile_multiple`."""

    def _output_scales(self) -> torch.Tensor | None:
        """(N,) scales the GEMM's output columns take, or None (already in the weight)."""
        return None
