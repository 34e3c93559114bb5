"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, with the variance taken in fp32.

A block's norms read the fp32 residual stream and write the dtype its matmuls take
(`out_dtype`): the statistics and the scaling in fp32, rounded once on the way out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.module import Module
from qinfer.weights.slots import TensorSlot


class RMSNorm(Module, TensorSlot):
    """Normalizes over the last dimension (`dims`): hidden_size for a block, head_dim for QK-norm.

    offset: Gemma stores each norm's scale as (offset + weight) with offset 1; such a norm
    scales in fp32 and casts afterwards, as transformers' Gemma3RMSNorm does (the others
    cast first, then scale: the order of transformers' Llama/Qwen norms).
    source: the checkpoint tensor that holds the weight, for a norm built empty
    (`rms_norm`) and filled by `qinfer.weights.load`.
    out_dtype: the dtype it writes (None: its input's). The model sets it: the compute dtype
    for the norms before a matmul, fp32 for those whose output joins the residual stream.
    """

    def __init__(
        self,
        dims: int,
        weight: torch.Tensor,
        eps: float = 1e-6,
        offset: float = 0.0,
        source: str | None = None,
    ) -> None:
        super().__init__()
        self.shape, self.eps, self.source = (dims,), eps, source
        self.out_dtype: torch.dtype | None = None
        self.scale_in_fp32 = offset != 0.0
        self.offset = offset
        self.initial = 1.0 - offset  # a fresh model's scale is 1
        self.fill(weight)

    def fill(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.shape:
            raise ValueError(
                f"RMSNorm weight has shape {tuple(tensor.shape)}, expected ({self.shape[0]},)"
            )
        weight = tensor.float() + self.offset if self.scale_in_fp32 else tensor
        self.register_buffer("weight", weight)
        # The scale in fp32 (the same tensor when it is fp32 already), for `forward`'s one call.
        self.register_buffer("weight32", weight.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_in_fp32 or x.dtype == torch.float32:
            # normalize's fp32 branch in one call (the block norms on the fp32 residual, a
            # decode step's 2 per layer): F.rms_norm with the fp32 weight multiplies as
            # `normed * weight` does, bit for bit (measured on CPU, 20 shapes)
            out = self.out_dtype or x.dtype
            return F.rms_norm(x.float(), self.shape, self.weight32, self.eps).to(out)
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (..., dims) normalized, then scaled by `weight` (broadcast to x: this norm's
        own, or `head_norms`' one row per head)."""
        # fp16/bf16 squares overflow or lose precision: compute the statistics in fp32.
        # F.rms_norm without a weight is x * rsqrt(mean(x^2) + eps) in one call.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.out_dtype or x.dtype
        if self.scale_in_fp32 or x.dtype == torch.float32:  # scaled in fp32, rounded once
            return (normed * weight).to(out)
        return weight * normed.to(x.dtype)  # half inputs (QK-norm): transformers' order


def head_norms(x: torch.Tensor, first: RMSNorm, rest: RMSNorm, num_first: int) -> torch.Tensor:
    """x (T, H, D) heads: the first num_first normed by `first`, the others by `rest` (two
    norms of one layer, same eps and kind: QK-norm over q's heads and k's), in one pass;
    the same values as each norm on its own heads."""
    weight = torch.cat(
        (first.weight.expand(num_first, -1), rest.weight.expand(x.shape[1] - num_first, -1))
    )  # (H, D)
    return first.normalize(x, weight)


def rms_norm(name: str, dims: int, config: ModelConfig) -> RMSNorm:
    """An empty RMSNorm (its weight on the meta device) that loads tensor `name` (dims,),
    with the config's eps and offset."""
    weight = torch.empty(dims, device="meta")
    return RMSNorm(dims, weight, config.rms_norm_eps, config.wiring.norm_weight_offset, name)
