"""Projections of different kinds side by side, for fused loads whose parts cannot share one
kernel (a GGUF file may store q and k in Q4_K and v in Q6_K)."""

from __future__ import annotations

import torch
from torch import nn

from qinfer.linear.base import Linear


class ConcatLinear(Linear):
    """y = cat([part(x) for part in parts], -1); each part carries its own bias."""

    def __init__(self, parts: list[Linear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = None
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)
