"""int4 groups of 32 in qinfer's own layout, multiplied by qinfer's compiled kernel in fp32.

The weight is `Int4Linear`'s, W = (q - 8) * scale + zero per group of 32 input columns
(GGUF's Q4_0, Q4_1 and Q4_K exactly), held as `kernels.pack_int4` packs it (columns in tiles
of 16): the nibbles and, per group, d = scale and m = zero - 8 * scale (w = d q + m), in fp16
where that is exact (Q4_0's and Q4_1's: the file's own bytes) and fp32 otherwise (Q4_K's). A
symmetric weight (Q4_0's, zero 0) holds no m: m = 0 - 8 d is computed where it is used
(the kernels, `_offsets`), so it is held in the file's 18 bytes a block, not 20.

Why not torch's int4 kernel (`Int4Linear`, where this one cannot be built): it holds the
scales and zeros in the activations' dtype, so a bf16 model's weights move (SmolLM2 Q4_1's
fp16 d and m re-rounded to bf16 move a weight by up to 1/256 of its group's scale) and its
outputs are rounded to bf16. On SmolLM2 Q4_1, an fp32 model with only those scales rounded
to bf16 leaves the fp32 model's greedy path on 5 of 20 chat prompts (docs/BENCHMARKS.md).
`kernels.int4_groups_mm` computes each block's d (q . x) + m sum(x) from the exact nibbles,
scales and activations (bf16 widened exactly), fp32 out: nothing is rounded but fp32
products and sums, each row alike at any row count.

Paths (`qinfer.linear.paths`): the kernel; the tile paths dequantize rows of the nibbles
into the shared buffer (bf16 tiles round the weight to bf16, the prefill path where bf16
GEMMs are fast); int8_dot is `kernels.int4_mm` on the same packed weight (no second copy).
CPU only: the layer is made where the kernels load (`qinfer.linear.build`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qinfer import kernels
from qinfer.linear.int4 import Int4Groups
from qinfer.linear.logits import fp32_logits
from qinfer.linear.paths import QuantizedLinear, scratch


class Int4BlockLinear(QuantizedLinear):
    """int4 groups of 32 packed by `kernels.pack_int4`, bias (N,) or None, computing in
    `dtype` (the activations' and the output's; the weight is exact, the sums fp32)."""

    group_size = kernels.BLOCK

    def __init__(self, stored: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        packed = kernels.pack_int4(stored)
        self.register_buffer("qs", packed.qs)  # (G, K / 32 * 256) uint8, G = ceil(N / 16)
        self.register_buffer("d", packed.d)  # (G, K / 32 * 16) fp16 or fp32
        self.register_buffer("m", packed.m)  # (G, K / 32 * 16), d's dtype; None: symmetric
        self.register_buffer("bias", bias)
        self.packed = packed  # the same tensors, as the kernels take them (CPU only: never moved)
        self.out_features, self.in_features = packed.shape
        self.compute_dtype = dtype
        self._init_paths()

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def shape_key(self) -> tuple:
        return (self.out_features, self.in_features, self.group_size)

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        # the kernel takes fp32 and bf16 activations; fp16 ones are widened for it
        x = flat if flat.dtype in kernels.ACTIVATION_DTYPES else flat.float()
        y = kernels.int4_groups_mm(x, self.packed)  # fp32
        return (
            y if flat.dtype == torch.float32 else y.to(flat.dtype)
        )  # (a no-op `.to` costs a call)

    def logits(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """As `Linear.logits`: the kernel takes the fp32 input as it is and writes fp32 logits
        of the exact weight, none to recompute (int8_dot's are recomputed at the top)."""
        if self.head_path == "int8_dot":
            return super().logits(x, dtype)
        return fp32_logits(self, x, torch.float32, exact=True)

    def _dot_supported(self) -> bool:
        return True

    def _dot_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(kernels.int4_mm, packed=self.packed)

    def _tiles_supported(self) -> bool:
        return True

    def _dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """d q + m in fp32 (two roundings, within an ulp of `_exact`'s one; then rounded
        once to bf16), into the shared buffer."""
        rows, k, columns = stop - start, self.in_features, slice(start, stop)
        w = scratch(rows * k, torch.float32, self.device).view(rows, -1, self.group_size)
        q = self.packed.values(columns).view(rows, -1, self.group_size)
        # fp32 scales: q * an fp16 d in fp16 would round the product
        torch.mul(q, self.packed.scales(columns)[..., None].float(), out=w)
        w.add_(self.packed.offsets(columns)[..., None])
        if dtype != torch.float32:
            return scratch(rows * k, dtype, self.device).view(rows, k).copy_(w.view(rows, k))
        return w.view(rows, k)

    def groups(self) -> Int4Groups:
        """The weight as `Int4Groups` (zero = m + 8 d, rounded once to fp32)."""
        d = self.packed.scales().float()
        zeros = (self.packed.offsets().double() + 8 * d.double()).float()
        return Int4Groups(self.packed.values(), d, zeros)

    def _exact(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """(..., K) fp32: `rows`' d q + m rounded once, each weight's fp32 value."""
        d, m = self.packed.scales(rows).double(), self.packed.offsets(rows).double()
        q = self.packed.values(rows).unflatten(-1, (-1, self.group_size))
        return (q.double() * d[..., None] + m[..., None]).float().flatten(-2)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., K) fp32, the weights' fp32 values (d q + m rounded once)."""
        return self._exact(ids)

    def has_rows(self) -> bool:
        return True

    def dequantize(self) -> torch.Tensor:
        return self._exact(slice(None))

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self._bias_nbytes()
