"""A dense weight in the compute dtype: torch's own GEMM/GEMV, or the same in fixed chunks
of rows where a row's output must not depend on how many rows its call held.

torch's GEMMs choose their blocking by the row count M: row 0 of an fp32 (M, K) x (K, N)
product can differ from its M=1 value at M >= 2 (docs/BENCHMARKS.md, "Row-count
dependence of GEMMs"), and nothing promises that a bf16 GEMM never does. In `FIXED_ROWS` chunks
every call has one shape, (FIXED_ROWS, K) x (K, N), whose rows are computed alike wherever
they sit in the chunk (tested): a batch-invariant model (`Features.batch_invariant`) takes
that path for all its dense Linears, grouped experts included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.linear.base import Linear

#: Rows of every GEMM call on the fixed-chunk path: one shape for any M, padded with zeros.
FIXED_ROWS = 16


def linear_in_fixed_chunks(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T -> (M, N), as FIXED_ROWS-row GEMMs (x padded with zero
    rows to a multiple), so that a row's result depends on that row alone."""
    m = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -m % FIXED_ROWS))  # (M', K), M' a multiple of FIXED_ROWS
    y = padded.new_empty(padded.shape[0], weight.shape[0])  # (M', N)
    for start in range(0, padded.shape[0], FIXED_ROWS):
        torch.mm(padded[start : start + FIXED_ROWS], weight.t(), out=y[start : start + FIXED_ROWS])
    return y[:m]


class DenseLinear(Linear):
    """weight (out, in) and bias (out,) or None, both in the compute dtype.

    fixed_rows: multiply in FIXED_ROWS-row chunks (module docstring), set by
    `qinfer.linear.choose.choose_paths` for a batch-invariant model.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape
        self.fixed_rows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fixed_rows:
            return F.linear(x, self.weight, self.bias)
        y = linear_in_fixed_chunks(x.reshape(-1, self.in_features), self.weight)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def has_rows(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self._bias_nbytes()
