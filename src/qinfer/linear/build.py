"""From stored weights to one Linear: the choice of kind, made once at load time."""

from __future__ import annotations

import torch

from qinfer import kernels
from qinfer.linear.base import Linear
from qinfer.linear.concat import ConcatLinear
from qinfer.linear.dense import DenseLinear
from qinfer.linear.int4 import Int4Groups, Int4Linear
from qinfer.linear.int4_blocks import Int4BlockLinear
from qinfer.linear.int8 import Int8Linear, Int8Rows
from qinfer.linear.int8_blocks import Int8BlockLinear, Int8Blocks

#: A weight as a checkpoint reader hands it over: dense (any float dtype) or quantized.
StoredWeight = torch.Tensor | Int8Rows | Int8Blocks | Int4Groups


def make_linear(
    parts: list[StoredWeight],
    biases: list[torch.Tensor | None],
    dtype: torch.dtype,
    device: torch.device,
) -> Linear:
    """One Linear whose output is the parts' outputs side by side (rows stacked).

    Parts of one kind are stacked into a single weight, so a fused q/k/v or gate/up
    projection is one kernel call; parts of different kinds (or int4 groups, or int8
    blocks, of different sizes) become a ConcatLinear. biases: one per part (all None: no
    bias); dense weights and biases are cast to the compute dtype and moved to the device.
    """
    kinds = {type(p) if not isinstance(p, torch.Tensor) else torch.Tensor for p in parts}
    if len(kinds) > 1 or len({_columns_per_scale(p) for p in parts}) > 1:
        return ConcatLinear(
            [make_linear([p], [b], dtype, device) for p, b in zip(parts, biases, strict=True)]
        )
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b if b is not None else torch.zeros(_rows(p))
                for p, b in zip(parts, biases, strict=True)
            ]
        ).to(device, dtype)
    first = parts[0]
    if isinstance(first, Int4Groups):
        fields = (
            _stacked([getattr(p, f) for p in parts], device) for f in ("q", "scales", "zeros")
        )
        groups = Int4Groups(*fields)
        # qinfer's exact fp32 kernel where it runs (groups of 32 on a CPU that builds it),
        # torch's int4 kernels elsewhere (`qinfer.linear.int4_blocks` says why)
        ours = device.type == "cpu" and groups.group_size == kernels.BLOCK
        if ours and kernels.available() is None:
            return Int4BlockLinear(groups, bias, dtype)
        return Int4Linear(groups, bias, dtype)
    if isinstance(first, Int8Blocks):
        if any(p.super_scales is None for p in parts):  # Q6_K's super-scales only stack alike
            parts = [p.flattened() for p in parts]
        fields = zip(*((p.q, p.scales, p.super_scales) for p in parts), strict=True)
        blocks = Int8Blocks(*(None if f[0] is None else _stacked(list(f), device) for f in fields))
        return Int8BlockLinear(blocks, bias, dtype)
    if isinstance(first, Int8Rows):
        fields = (_stacked([getattr(p, f) for p in parts], device) for f in ("q", "scales"))
        return Int8Linear(Int8Rows(*fields), bias, dtype)
    return DenseLinear(_stacked(parts, device).to(dtype), bias)


def _stacked(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' rows stacked, on device; a lone tensor is not copied (a 150k-row
    embedding would briefly exist twice)."""
    stacked = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return stacked.to(device)


def _columns_per_scale(part: StoredWeight) -> int | None:
    """The input columns one scale covers (int4 groups, int8 blocks); None for the others."""
    if isinstance(part, Int4Groups):
        return part.group_size
    return part.block_size if isinstance(part, Int8Blocks) else None


def _rows(part: StoredWeight) -> int:
    return part.shape[0]
