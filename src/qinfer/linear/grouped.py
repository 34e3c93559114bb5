"""Grouped Linears: E projections of one shape, each applied to its own run of rows.

    y = w(x, counts)    # x (N, in) sorted by group, counts (E,) rows per group -> (N, out)

Rows 0 .. counts[0] - 1 go through projection 0, the next counts[1] rows through projection
1, and so on: a mixture-of-experts layer sorts its (token, expert) pairs by expert and
computes every expert on just the tokens routed to it (`layers/moe.py`). Each expert's
weight is loaded as an ordinary `Linear` (`weights.linear`: dense, int8 or int4, and a
tensor-parallel rank's part), then `make_grouped_linear` picks how to run them:

- `StackedDenseLinear`: dense experts stacked into one (E, out, in) tensor and multiplied
  by torch's grouped GEMM (`torch._grouped_mm`), which reads the run lengths on the device:
  no host sync, one kernel for all experts.
- `LoopedLinear`: any other kinds (quantized experts, whose kernels have no grouped form),
  one call per expert that has rows; splitting x needs the run lengths on the host, so this
  kind waits for the device once per call (a no-op on CPU).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from qinfer.core.module import Module
from qinfer.linear.base import Linear
from qinfer.linear.dense import DenseLinear, linear_in_fixed_chunks

#: Row strides `torch._grouped_mm` takes are multiples of 16 bytes.
_GROUPED_MM_ALIGNMENT = 16


class GroupedLinear(Module, ABC):
    """E projections W_e (out_features, in_features), no bias; row runs sorted by group."""

    groups: int
    out_features: int
    in_features: int

    @abstractmethod
    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, in) with counts (E,) long (sum N) -> (N, out): run e through W_e."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weights (E, out, in) in fp32, as the kernels see them."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of weight (and scales) the projections hold."""


class StackedDenseLinear(GroupedLinear):
    """weight (E, out, in) in the compute dtype, run by one grouped GEMM.

    fixed_rows: each run through `linear_in_fixed_chunks` instead (the grouped GEMM blocks
    a run by its length), set by `qinfer.linear.choose.choose_paths` for a batch-invariant model;
    that path reads the run lengths on the host.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.groups, self.out_features, self.in_features = weight.shape
        self.fixed_rows = False

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.fixed_rows:
            runs = x.split(counts.tolist())
            outputs = [
                linear_in_fixed_chunks(run, w) for run, w in zip(runs, self.weight, strict=True)
            ]
            return torch.cat(outputs)  # (N, out)
        ends = counts.cumsum(0).to(torch.int32)  # (E,) where each run ends
        # (N, in) @ (E, in, out) with runs -> (N, out)
        return torch._grouped_mm(x, self.weight.transpose(1, 2), offs=ends)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class LoopedLinear(GroupedLinear):
    """One `Linear` per group, each called on its run of rows (skipped when empty)."""

    def __init__(self, parts: list[Linear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.groups = len(parts)
        self.out_features, self.in_features = parts[0].out_features, parts[0].in_features

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outputs, start = [], 0
        # The host sync: the run lengths decide the shapes. Of many experts few have rows
        # in a decode step, so only those are sliced and called.
        for part, size in zip(self.parts, counts.tolist(), strict=True):
            if size:
                outputs.append(part(x[start : start + size]))
                start += size
        return torch.cat(outputs) if outputs else x.new_empty(0, self.out_features)

    def dequantize(self) -> torch.Tensor:
        return torch.stack([part.dequantize() for part in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def make_grouped_linear(parts: list[Linear]) -> GroupedLinear:
    """The fastest kind that runs these projections (all of one shape)."""
    dense = all(type(part) is DenseLinear and part.bias is None for part in parts)
    if dense and _grouped_mm_supports(parts[0].weight):
        return StackedDenseLinear(torch.stack([part.weight for part in parts]))
    return LoopedLinear(parts)


def _grouped_mm_supports(weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes weights like this (out, in) one: its dtype on its
    device, and rows whose strides keep the 16-byte alignment it requires."""
    if weight.device.type == "cuda":
        usable = weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0)
    else:
        usable = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
    return usable and all(
        size * weight.element_size() % _GROUPED_MM_ALIGNMENT == 0 for size in weight.shape
    )
