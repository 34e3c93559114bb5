"""A dense weight in the compute dtype: torch's own GEMM/GEMV."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.linear.base import Linear


class DenseLinear(Linear):
    """weight (out, in) and bias (out,) or None, both in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def has_rows(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self._bias_nbytes()
