"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, with the variance taken in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm:
    """Normalizes over the last dimension (`dims`): hidden_size for a block, head_dim for QK-norm."""

    def __init__(self, dims: int, weight: torch.Tensor, eps: float = 1e-6) -> None:
        if tuple(weight.shape) != (dims,):
            raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, expected ({dims},)")
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # fp16/bf16 squares overflow or lose precision: compute the statistics in fp32,
        # then cast back before the weight multiply (the order transformers uses).
        # F.rms_norm without a weight is x * rsqrt(mean(x^2) + eps) in one call.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
