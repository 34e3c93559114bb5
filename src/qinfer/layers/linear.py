"""Linear projections: the weights of one `y = x @ W^T + b` and the function applying them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Linear:
    """The weight (out_features, in_features) and optional bias (out_features,) of a projection."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """(..., in_features) -> (..., out_features)."""
    return F.linear(x, w.weight, w.bias)
