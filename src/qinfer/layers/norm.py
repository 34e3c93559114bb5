"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, with the variance taken in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.weights.base import Weights


class RMSNorm:
    """Normalizes over the last dimension (`dims`): hidden_size for a block, head_dim for QK-norm.

    offset: Gemma stores each norm's scale as (offset + weight) with offset 1; such a norm
    scales in fp32 and casts afterwards, as transformers' Gemma3RMSNorm does (the others
    cast first, then scale: the order of transformers' Llama/Qwen norms).
    """

    def __init__(
        self, dims: int, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0
    ) -> None:
        if tuple(weight.shape) != (dims,):
            raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, expected ({dims},)")
        self.scale_in_fp32 = offset != 0.0
        self.weight = weight.float() + offset if self.scale_in_fp32 else weight
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # fp16/bf16 squares overflow or lose precision: compute the statistics in fp32.
        # F.rms_norm without a weight is x * rsqrt(mean(x^2) + eps) in one call.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.scale_in_fp32:
            return (normed * self.weight).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def load_rms_norm(weights: Weights, name: str, dims: int, config: ModelConfig) -> RMSNorm:
    """The RMSNorm whose weight is tensor `name` (dims,), with the config's eps and offset."""
    return RMSNorm(
        dims, weights.tensor(name, (dims,)), config.rms_norm_eps, config.wiring.norm_weight_offset
    )
