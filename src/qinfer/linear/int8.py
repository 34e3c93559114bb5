"""int8 weights, one scale per output channel: W ~= q * scale[:, None].

On CPU, torch's weight-only kernel (`aten._weight_int8pack_mm`) reads the int8 weight and
multiplies by bf16 activations; it is fast only with bf16 activations (measured 30-100x
slower with fp32 ones: `python bench/linear_kernels.py`), and only for few rows: it does
not block like a GEMM. From `MANY_ROWS` rows up (a prefill chunk), on a CPU whose bf16
GEMM is fast, widening the weight to bf16 for this call and running the GEMM costs less:
2.5-2.8x less at 512 rows for a 2048 x 640 weight, the same from about 32 rows (measured on
AVX512-BF16). int8 values are exact in bf16, so both ways compute the same products. On
other devices the weight is widened at each call (correct, not a fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer.linear.base import Linear
from qinfer.linear.compute import bf16_matmul_is_fast


@dataclass
class Int8Rows:
    """A weight as int8 rows: q (N, K) int8 in -127..127, scales (N,) fp32."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales[:, None]


#: Rows quantized at a time: a 150k-row embedding then needs no fp32 copy of itself.
CHUNK_ROWS = 4096
#: From this many rows of activations a widened weight and a bf16 GEMM beat the int8 kernel.
MANY_ROWS = 128
#: Weights larger than this (elements) are never widened: a 262k-row head would need a
#: transient 335 MB copy, and the widening alone outweighs the kernel's cost.
MAX_WIDENED = 1 << 25


def quantize_int8(weight: torch.Tensor) -> Int8Rows:
    """Symmetric per-row int8: scale = max|w| / 127, q = round(w / scale)."""
    chunks = [_quantize_rows(rows) for rows in weight.split(CHUNK_ROWS)]
    return Int8Rows(torch.cat([q for q, _ in chunks]), torch.cat([s for _, s in chunks]))


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(Linear):
    """int8 weight (N, K), scales (N,) in the compute dtype, bias (N,) or None."""

    def __init__(self, stored: Int8Rows, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", stored.q.contiguous())
        self.register_buffer("scales", stored.scales.to(dtype))
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = self.q.shape
        # Whether a call with MANY_ROWS rows widens the weight for a bf16 GEMM (module doc).
        self.widen_for_many_rows = (
            self.q.device.type == "cpu"
            and dtype == torch.bfloat16
            and self.q.numel() <= MAX_WIDENED
            and bf16_matmul_is_fast(self.q.device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K): the kernel takes 2-D activations
        if x.device.type == "cpu" and not (self.widen_for_many_rows and len(flat) >= MANY_ROWS):
            y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales)
        else:
            y = F.linear(flat, self.q.to(x.dtype)) * self.scales
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = F.embedding(ids, self.q).to(self.scales.dtype)  # (..., K)
        return q * F.embedding(ids, self.scales[:, None])  # (..., 1) scale per row

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + self._bias_nbytes()
