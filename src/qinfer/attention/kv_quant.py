"""How K/V are stored between steps: as computed, in another float dtype, or quantized.

`Features.kv_cache_dtype` names the storage, `kv_format` turns the name into a `KVFormat`
for a model's compute dtype:

    auto   the model's compute dtype: K/V stored exactly as computed (the default)
    bf16   bfloat16, whatever the compute dtype
    int8   int8, one fp16 scale per block of 32 elements of a (token, head) vector:
           scale = the block's absmax / 127, round to nearest (llama.cpp's q8_0 blocks)
    fp8    float8_e4m3fn, one fp16 scale per block of 32: scale = absmax / 448

A quantized vector x (D,) of one token and head is stored as data (D,) and D / 32 scales
(one, where 32 does not divide D), and read back as each block's data * its scale. Blocks,
not one scale per vector: a head's outlier channel then coarsens only its own block (Gemma
3's 256-wide heads: KL to the fp32 model 0.0172 with one scale per vector, against
llama.cpp's q8_0 0.0103; docs/BENCHMARKS.md). Every cache (`qinfer.attention.kv_cache`'s
contiguous and rotating ones, the engine's `KVPool`) quantizes the step's K/V when it writes
them and dequantizes only what attention reads. Bytes per token and KV head: D * 2 for
bf16, D + 2 * D / 32 for int8 and fp8 (64-wide heads: 128 against 68, so a pool holds
1.88x bf16's tokens; fp32 scales would give 1.78x).

A scale is rounded to fp16 first and the block divided by the rounded scale, so that the
stored elements are the nearest to x of what the stored scale can give back (llama.cpp
divides by the unrounded one). fp16 keeps 11 bits: within 2^-11 of the fp32 scale, far
inside int8's own rounding of 1/254 of the block's range; a block whose scale is below
fp16's range (absmax under ~4e-6) reads back as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.core.features import check_kv_cache_dtype

_TINY = torch.finfo(torch.float32).tiny  # the divisor of an all-zero block

#: Elements of a vector that share one scale (q8_0's block).
BLOCK = 32


@dataclass(frozen=True)
class KVFormat:
    """One storage of K/V: elements of `dtype`, and with `qmax` (the largest magnitude a
    quantized element takes) one `scale_dtype` scale per block of `block` elements of the
    last dimension."""

    dtype: torch.dtype
    qmax: float | None = None  # None: stored as computed, cast to dtype, no scales
    block: int = BLOCK
    scale_dtype: torch.dtype = torch.float16

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    def scales_per_vector(self, head_dim: int) -> int:
        """N, the scales of one (token, head) vector: D / block, or 1 where block does not
        divide D."""
        return head_dim // self.block if head_dim % self.block == 0 else 1

    def element_bytes(self, head_dim: int) -> int:
        """Bytes one token's vector of one head takes: its elements and its scales."""
        size = head_dim * self.dtype.itemsize
        scales = self.scale_dtype.itemsize * self.scales_per_vector(head_dim)
        return size + (scales if self.quantized else 0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (..., D) -> (data (..., D) in `dtype`, scales (..., N) in `scale_dtype`, or
        None unquantized)."""
        if not self.quantized:
            return x.to(self.dtype), None
        blocks = x.float().unflatten(-1, (self.scales_per_vector(x.shape[-1]), -1))
        scales = (blocks.abs().amax(-1) / self.qmax).to(self.scale_dtype)  # (..., N)
        # the rounded scale may lie a hair under absmax / qmax, and one below fp16's
        # range is 0 (then the block reads back as 0 whatever it holds): clamped
        data = (blocks / scales.float().clamp_min(_TINY)[..., None]).clamp_(-self.qmax, self.qmax)
        if not self.dtype.is_floating_point:
            data = data.round_()
        return data.flatten(-2).to(self.dtype), scales

    def dequantize(
        self, data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """data (..., D) and its scales (..., N) -> (..., D) in `dtype` (the product in
        fp32)."""
        if scales is None:
            return data.to(dtype)
        blocks = data.float().unflatten(-1, (scales.shape[-1], -1))  # (..., N, D / N)
        return (blocks * scales.float()[..., None]).flatten(-2).to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) as a cache in this format gives it back: stored, then read."""
        return self.dequantize(*self.quantize(x), x.dtype)


_FORMATS = {
    "bf16": KVFormat(torch.bfloat16),
    "int8": KVFormat(torch.int8, 127.0),
    "fp8": KVFormat(torch.float8_e4m3fn, 448.0),
}


def kv_format(name: str, compute_dtype: torch.dtype) -> KVFormat:
    """The storage `name` asks for, for a model computing in `compute_dtype`."""
    check_kv_cache_dtype(name)
    return KVFormat(compute_dtype) if name == "auto" else _FORMATS[name]


def raw_bytes(data: torch.Tensor) -> torch.Tensor:
    """A quantized buffer viewed as bytes, for the copies torch has no fp8 kernel of
    (index_copy_ on CPU): the same memory, element for element."""
    return data.view(torch.uint8)
