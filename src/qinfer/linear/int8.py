"""int8 weights, one scale per output channel: W ~= q * scale[:, None].

Paths (`qinfer.linear.paths`): the kernel is torch's weight-only `aten._weight_int8pack_mm`
on CPU, fast only with bf16 activations (an order of magnitude slower or worse with fp32
ones: `python bench/linear_kernels.py`) and only for few rows: it does not block like a GEMM. The tile
paths widen the int8 rows into the shared buffer (exact in bf16 and fp32) and run the GEMM;
the per-row scales multiply the output columns. On other devices the kernel path widens
the whole weight at each call (correct, not a fast path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.linear.paths import QuantizedLinear, scratch


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


class Int8Linear(QuantizedLinear):
    """int8 weight (N, K), scales (N,) in the compute dtype, bias (N,) or None."""

    def __init__(self, stored: Int8Rows, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", stored.q.contiguous())
        self.register_buffer("scales", stored.scales.to(dtype))
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = self.q.shape
        self._init_paths()

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.device.type == "cpu":
            return torch._weight_int8pack_mm(flat, self.q, self.scales)  # (see Int4Linear)
        return F.linear(flat, self.q.to(flat.dtype)) * self.scales

    def _tiles_supported(self) -> bool:
        return True

    def _dot_supported(self) -> bool:
        return self.device.type == "cpu" and self.in_features % kernels.BLOCK == 0

    def _dot_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`kernels.int8_mm` on q as it is, with an fp32 copy of the scales (exact)."""
        return functools.partial(kernels.int8_mm, q=self.q, scales=self.scales.float())

    def _dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        out = scratch((stop - start) * self.in_features, dtype, self.q.device)
        return out.view(stop - start, -1).copy_(self.q[start:stop])  # exact in bf16 and fp32

    def _output_scales(self) -> torch.Tensor:
        return self.scales

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., K) fp32, each q * scale exact (8 by 8 significant bits) as `dequantize`."""
        q = F.embedding(ids, self.q).float()  # (..., K)
        return q * F.embedding(ids, self.scales[:, None]).float()  # (..., 1) scale per row

    def has_rows(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + self._bias_nbytes()
