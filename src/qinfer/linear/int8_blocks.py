"""int8 weights with one scale per block of B input columns: W = q * scale, B = 32 or 16.

This holds GGUF's symmetric block types exactly (`qinfer.weights.gguf_quants.int8_blocks`):
Q8_0 (q in -127..127, an fp16 scale per 32), Q5_0 (q in -16..15, per 32) and Q6_K (q in
-32..31, a scale d * sc per 16). Each keeps the file's scales: Q8_0's and Q5_0's fp16, Q6_K's
int8 sub-scales sc (N, K/16) with its fp16 super-scales d (N, K/256), which the kernels
multiply as they read a block (exact in fp32), and Q6_K's values at their 6 bits
(`kernels.pack_q6`), which the kernels unpack as they read them. A Q6_K weight is so the
file's 6.56 bits a weight, not the 10 of int8 values with an fp32 scale per 16: on
Qwen3.5-0.8B's Q6_K head, 110 MB less read per decode step, every output the same bits
(docs/KERNELS.md). Re-rounded to one scale per row (`Int8Linear`), as they were, a block's
values move by up to half a row's step, and on Gemma 3 270M Q4_K_M (whose projections are
mostly Q5_0, its embedding Q8_0) that was most of the default path's drift from fp32: KL
0.0068, against 0.0005 with these blocks read dense (docs/BENCHMARKS.md).

Paths (`qinfer.linear.paths`): the kernel is qinfer's compiled `kernels.int8_blocks_mm`, fp32
activations (bf16 widened exactly) times the weight as `dequantize` holds it (GGUF's exactly),
fp32 out: each product rounded once and the sums, each row alike at any row count (the head's
path too, whose logits are then fp32's).
int8_dot is `kernels.int8_mm` on the same q and block scales, the activations rounded to int8
per block of 32 (llama.cpp's q8_0 / q5_0 / q6_K dots), each row alike at any row count too.
Where the kernels cannot be built (no compiler or ninja) it is torch's int8 kernel on a
copy re-rounded to one scale per row, made at the first call: the speed and the precision
of before, with one warning; embedding rows stay exact. The tile paths widen the blocks
into the shared buffer (exact in fp32; bf16 tiles round the weight to bf16, the prefill
path where bf16 GEMMs are fast). On other devices the kernel widens the whole weight at
each call (correct, not a fast path).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.core.errors import WeightsError
from qinfer.linear.int8 import CHUNK_ROWS, Int8Rows, quantize_int8
from qinfer.linear.logits import fp32_logits
from qinfer.linear.paths import KERNEL, QuantizedLinear, scratch

#: Block sizes the kernel takes.
BLOCK_SIZES = (32, 16)
#: Q6_K's sub-scales per super-scale: 16 blocks of 16, 256 input columns.
SUB_SCALES = 16
SUPER_BLOCK = SUB_SCALES * 16


@dataclass
class Int8Blocks:
    """A weight as int8 blocks: q (N, K) int8, scales (N, K / B) fp32 (B = K / scales'
    columns, one of BLOCK_SIZES), the layer holding them in fp16 where that is exact; or, with
    super_scales (N, K / 256) fp16, Q6_K's as stored: scales the int8 sub-scales (N, K / 16),
    a block's scale super_scales * scales (`block_scales`)."""

    q: torch.Tensor
    scales: torch.Tensor
    super_scales: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def block_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def block_scales(self) -> torch.Tensor:
        """(N, K / B) fp32, each block's scale (exact: an fp16 times an int8)."""
        return _block_scales(self.scales, self.super_scales)

    def flattened(self) -> Int8Blocks:
        """The same weight with one fp32 scale per block (no super-scales)."""
        return self if self.super_scales is None else Int8Blocks(self.q, self.block_scales())

    def columns(self, start: int, stop: int) -> Int8Blocks:
        """Input columns start:stop, which begin and end on block boundaries (off Q6_K's
        super-blocks, the scales flattened)."""
        if self.super_scales is not None and (start % SUPER_BLOCK or stop % SUPER_BLOCK):
            return self.flattened().columns(start, stop)
        b = self.block_size
        supers = self.super_scales
        if supers is not None:
            supers = supers[:, start // SUPER_BLOCK : stop // SUPER_BLOCK]
        return Int8Blocks(self.q[:, start:stop], self.scales[:, start // b : stop // b], supers)

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32, exact (an int8 times an fp32 scale of GGUF's fp16 or fp16 * int8)."""
        return _widened(self.q, self.block_scales(), torch.float32)


def quantize_int8_blocks(weight: torch.Tensor, block: int = 32) -> Int8Blocks:
    """weight (N, K) -> int8 blocks of `block` columns, each its own symmetric scale
    (max|w| / 127, fp32): `quantize_int8` with every block as a row."""
    N, K = weight.shape
    if K % block:
        raise WeightsError(f"a weight of {K} columns does not split into int8 blocks of {block}")
    rows = quantize_int8(weight.reshape(-1, block))
    return Int8Blocks(rows.q.view(N, K), rows.scales.view(N, K // block))


def _block_scales(scales: torch.Tensor, super_scales: torch.Tensor | None) -> torch.Tensor:
    """(..., K / B) fp32: scales as they are, or int8 sub-scales times their fp16 super-scale
    (..., K / 256), exact (11 significant bits times 7)."""
    if super_scales is None:
        return scales.float()
    return scales.float() * super_scales.float().repeat_interleave(SUB_SCALES, -1)


def _values_of(q: torch.Tensor, super_scales: torch.Tensor | None) -> torch.Tensor:
    """A layer's q as int8 values: as it is, or with super-scales Q6_K's packed ones unpacked."""
    return q if super_scales is None else kernels.unpack_q6(q)


def _widened(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out=None) -> torch.Tensor:
    """q (..., K) int8 and fp32 scales (..., K / B) -> (..., K) q * scale in `dtype` (into
    `out`)."""
    blocks = q.unflatten(-1, (scales.shape[-1], -1))  # (..., K / B, B)
    # fp32 scales: q * an fp16 scale in fp16 would round the product
    product = torch.mul(blocks, scales.float()[..., None]).flatten(-2)  # fp32 (..., K)
    if out is None:
        return product.to(dtype)
    return out.view(q.shape).copy_(product)


class Int8BlockLinear(QuantizedLinear):
    """int8 weight (N, K), scales (N, K / B) fp16 where that is exact (Q8_0's and Q5_0's: the
    file's bytes) else fp32, or Q6_K's int8 sub-scales with super_scales (N, K / 256) fp16
    (the file's) and q its 6-bit values packed (N, 3K / 4) uint8; bias (N,) or None,
    computing in `dtype`."""

    def __init__(self, stored: Int8Blocks, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        if stored.block_size not in BLOCK_SIZES or stored.q.shape[1] % stored.block_size:
            raise WeightsError(
                f"int8 blocks of {stored.block_size} columns are not one of "
                f"{', '.join(map(str, BLOCK_SIZES))} (weight {tuple(stored.q.shape)})"
            )
        if stored.q.shape[1] % kernels.BLOCK:  # a split share of blocks of 16, say
            raise WeightsError(
                f"int8 blocks need a multiple of {kernels.BLOCK} input columns, got "
                f"{stored.q.shape[1]} (weight {tuple(stored.q.shape)})"
            )
        supers = stored.super_scales
        if supers is not None and (stored.block_size != 16 or stored.q.shape[1] % SUPER_BLOCK):
            raise WeightsError(
                f"int8 sub-scales need blocks of 16 and a multiple of {SUPER_BLOCK} input "
                f"columns (weight {tuple(stored.q.shape)}, blocks of {stored.block_size})"
            )
        if supers is None:
            self.register_buffer("q", stored.q.contiguous())
            (scales,) = kernels.fp16_if_exact(stored.scales.float().contiguous())
        else:
            try:
                packed = kernels.pack_q6(stored.q)
            except ValueError as e:
                raise WeightsError(f"{e} (weight {tuple(stored.q.shape)})") from None
            self.register_buffer("q", packed)
            scales, supers = stored.scales.contiguous(), supers.contiguous()
        self.register_buffer("scales", scales)
        self.register_buffer("super_scales", supers)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = stored.q.shape
        self.compute_dtype = dtype
        self._row_copy: Int8Rows | None = None  # made only where the kernel cannot run
        self._init_paths()
        if self.device.type == "cpu":  # built (the first time, ~20 s) at load, not in a step
            _kernel_missing()

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def shape_key(self) -> tuple:
        return (self.out_features, self.in_features, self.in_features // self.scales.shape[1])

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.device.type != "cpu":
            return F.linear(flat, _widened(self._values(), self._scales(), flat.dtype))
        if _kernel_missing() is None:
            # the kernel takes fp32 and bf16 activations; fp16 ones are widened for it
            x = flat if flat.dtype in kernels.ACTIVATION_DTYPES else flat.float()
            y = kernels.int8_blocks_mm(x, self.q, self.scales, d_super=self.super_scales)
            return y if flat.dtype == torch.float32 else y.to(flat.dtype)
        if self._row_copy is None:  # no compiled kernel here: torch's on a row copy
            self._row_copy = self._rounded_to_rows()
        rows = self._row_copy
        return torch._weight_int8pack_mm(flat, rows.q, rows.scales.to(flat.dtype))

    def _dot_supported(self) -> bool:
        return self.device.type == "cpu"  # K a multiple of 32: checked at construction

    def _dot_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`kernels.int8_mm` on q and the block scales as they are."""
        return functools.partial(
            kernels.int8_mm, q=self.q, scales=self.scales, d_super=self.super_scales
        )

    def _values(self, rows: slice = slice(None)) -> torch.Tensor:
        """(rows, K) int8, the weight's values (Q6_K's unpacked)."""
        return _values_of(self.q[rows], self.super_scales)

    def _scales(self, rows: slice = slice(None)) -> torch.Tensor:
        """(rows, K / B) fp32, the block scales of `rows`."""
        supers = None if self.super_scales is None else self.super_scales[rows]
        return _block_scales(self.scales[rows], supers)

    def _rounded_to_rows(self) -> Int8Rows:
        """The weight re-rounded to one scale per row, CHUNK_ROWS rows at a time (a 262k-row
        table never exists in fp32 whole)."""
        chunks = [
            quantize_int8(
                _widened(
                    self._values(slice(r, r + CHUNK_ROWS)),
                    self._scales(slice(r, r + CHUNK_ROWS)),
                    torch.float32,
                )
            )
            for r in range(0, self.out_features, CHUNK_ROWS)
        ]
        return Int8Rows(torch.cat([c.q for c in chunks]), torch.cat([c.scales for c in chunks]))

    def logits(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """As `Linear.logits`: the compiled kernel takes the fp32 input as it is and writes
        fp32 logits of the exact weight, none to recompute; without it, the row copy's
        logits in `dtype` with the top ones recomputed from the exact rows; int8_dot's as
        `QuantizedLinear.logits`."""
        if self.head_path == KERNEL and self.device.type == "cpu" and _kernel_missing() is None:
            return fp32_logits(self, x, torch.float32, exact=True)
        return super().logits(x, dtype)

    def _tiles_supported(self) -> bool:
        return True

    def _dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        out = scratch((stop - start) * self.in_features, dtype, self.q.device)
        rows = slice(start, stop)
        return _widened(self._values(rows), self._scales(rows), dtype, out)

    def dequantize(self) -> torch.Tensor:
        return _widened(self._values(), self._scales(), torch.float32)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., K) fp32, exact as `dequantize`."""
        supers = None if self.super_scales is None else F.embedding(ids, self.super_scales)
        scales = _block_scales(F.embedding(ids, self.scales), supers)
        return _widened(_values_of(F.embedding(ids, self.q), supers), scales, torch.float32)

    def has_rows(self) -> bool:
        return True

    def exact_logits(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exact fp32 kernel on x's rows against their rows of W alone, the bits it gives
        them in the whole product (the recompute of an int8_dot head: ~0.5 ms for 32 rows of
        256 where fp64 sums over the gathered rows took ~40); off the CPU or without the
        kernels, `Linear.exact_logits`."""
        if self.device.type != "cpu" or _kernel_missing() is not None:
            return super().exact_logits(x, ids)
        return kernels.int8_blocks_mm(x, self.q, self.scales, d_super=self.super_scales, ids=ids)

    @property
    def nbytes(self) -> int:
        supers = 0 if self.super_scales is None else self.super_scales.nbytes
        return self.q.nbytes + self.scales.nbytes + supers + self._bias_nbytes()


_warned = False


def _kernel_missing() -> str | None:
    """Why the compiled kernel cannot run here (warned once), or None."""
    global _warned
    reason = kernels.available()
    if reason is not None and not _warned:
        _warned = True
        warnings.warn(
            f"int8 block weights multiply as int8 rows (re-rounded, torch's kernel): {reason}",
            stacklevel=3,
        )
    return reason
