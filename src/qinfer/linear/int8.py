"""int8 weights, one scale per output channel: W ~= q * scale[:, None].

On CPU, torch's weight-only kernel (`aten._weight_int8pack_mm`) reads the int8 weight and
multiplies by bf16 activations; it is fast only with bf16 activations (measured 30-100x
slower with fp32 ones: `python bench/linear_kernels.py`). On other devices the weight is widened to
the activations' dtype at each call (correct, not a fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer.linear.base import Linear


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
        self.q = stored.q.contiguous()
        self.scales = stored.scales.to(dtype)
        self.bias = bias
        self.out_features, self.in_features = self.q.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            flat = x.reshape(-1, self.in_features)  # (M, K): the kernel takes 2-D activations
            y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.q.to(x.dtype)) * self.scales
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = F.embedding(ids, self.q).to(self.scales.dtype)  # (..., K)
        return q * F.embedding(ids, self.scales[:, None])  # (..., 1) scale per row

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + self._bias_nbytes()
