"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, with the variance taken in fp32.

A block's norms read the fp32 residual stream and write the dtype its matmuls take
(`out_dtype`): the statistics and the scaling in fp32, rounded once on the way out.
`RMSNorm.add` also adds a sublayer's output into that stream first, in place. On the CPU
both run as one compiled op a call (`qinfer.kernels.add_rms_norm`), where torch's F.rms_norm
takes about nine; elsewhere, and where the kernels cannot be built, as torch's ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.core.model_config import ModelConfig
from qinfer.core.module import Module
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
            # decode step's 2 per layer); x.float() is x itself when fp32, read only
            return self.add(x.float(), None, self.out_dtype or x.dtype)
        return self.normalize(x, self.weight)

    def add(
        self, h: torch.Tensor, x: torch.Tensor | None, out: torch.dtype | None = None
    ) -> torch.Tensor:
        """h += x in place (h (..., dims) the fp32 residual stream, x a sublayer's output of
        its shape, fp32 or bf16; None: h is only read), then h normed and scaled by the fp32
        weight, in `out` (default: `out_dtype`, else fp32).

        The compiled op on the CPU (`qinfer.kernels.add_rms_norm`: within fp32 rounding of
        F.rms_norm, each row alike in any batch), torch's ops elsewhere: F.rms_norm with
        the fp32 weight, which multiplies as `normalize`'s `normed * weight` does, bit for
        bit (measured on CPU, 20 shapes)."""
        out = out or self.out_dtype or torch.float32
        if _compiled(h, x, out):
            rows = h.view(-1, h.shape[-1])  # (T, dims)
            x = None if x is None else x.reshape(rows.shape)
            return kernels.add_rms_norm(rows, x, self.weight32, self.eps, out).view(h.shape)
        if x is not None:
            h += x
        return F.rms_norm(h.float(), self.shape, self.weight32, self.eps).to(out)

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


#: What the compiled op writes and adds (the residual stream is fp32).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _compiled(
    h: torch.Tensor, x: torch.Tensor | None, out: torch.dtype, heads: bool = False
) -> bool:
    """Whether `RMSNorm.add` (heads: `head_norms`) runs as the compiled op: a contiguous fp32
    residual on the CPU (heads: (T, H, D) heads whose last dimension alone need be
    contiguous), a sublayer output of its shape in fp32 or bf16, an fp32 or bf16 output, no
    autograd, and the kernels built here. Decided by tensor metadata alone (no host sync)."""
    if h.device.type != "cpu" or h.dtype != torch.float32 or out not in _KERNEL_DTYPES:
        return False
    contiguous = h.dim() == 3 and h.stride(2) == 1 if heads else h.is_contiguous()
    if h.requires_grad or not contiguous or h.dim() == 0:
        return False
    if x is not None and (x.dtype not in _KERNEL_DTYPES or x.shape != h.shape):
        return False
    return kernels.in_use()


def head_norms(x: torch.Tensor, first: RMSNorm, rest: RMSNorm, num_first: int) -> torch.Tensor:
    """x (T, H, D) heads: the first num_first normed by `first`, the others by `rest` (two
    norms of one layer, same eps and kind: QK-norm over q's heads and k's), in one pass;
    the same values as each norm on its own heads. fp32 heads on the CPU: one compiled op
    (`kernels.heads_rms_norm`, where torch takes about a dozen), scaled in fp32 as
    `normalize` scales them, rounded once to the norm's out_dtype."""
    out = first.out_dtype or x.dtype
    if _compiled(x, None, out, heads=True):  # fp32 heads on the CPU
        return kernels.heads_rms_norm(x, first.weight32, rest.weight32, num_first, first.eps, out)
    weight = torch.cat(
        (first.weight.expand(num_first, -1), rest.weight.expand(x.shape[1] - num_first, -1))
    )  # (H, D)
    return first.normalize(x, weight)


def rms_norm(name: str, dims: int, config: ModelConfig) -> RMSNorm:
    """An empty RMSNorm (its weight on the meta device) that loads tensor `name` (dims,),
    with the config's eps and offset."""
    weight = torch.empty(dims, device="meta")
    return RMSNorm(dims, weight, config.rms_norm_eps, config.wiring.norm_weight_offset, name)
