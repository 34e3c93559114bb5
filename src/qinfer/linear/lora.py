"""A projection with LoRA adapters beside it: y = x W^T + scale * (x A_i^T) B_i^T for the
rows of adapter i, the base alone for every other row.

Several adapters live in one module, each in a slot (`qinfer.lora.adapters` numbers them);
a step's rows come grouped by slot (`qinfer.core.forward_batch.AdapterRows`), and each
group present costs one shrink product (n, in) x (in, r) and one expand product
(n, r) x (r, out): a segmented product as punica's SGMV computes it, one pair of GEMMs per
adapter present, never one per request or per token. The base's kernel runs first on every
row (whatever its kind: dense, int8, int4, GGUF blocks); the adapters stay in the compute
dtype beside it, and rows of no adapter are the base's output untouched, bit for bit.

A fused projection (q/k/v, gate/up) holds each part's adapter in one pair: the parts' A
stacked, (sum r_p, in), and B block-diagonal, (out, sum r_p), part p's B (scale folded in)
at its output rows and its own rank's columns. The zeros add nothing: each part's output
is its own adapter's exactly.
"""

from __future__ import annotations

import torch

from qinfer.core.forward_batch import AdapterRows
from qinfer.linear.base import Linear
from qinfer.linear.dense import linear_in_fixed_chunks


class LoraLinear(Linear):
    """`base` with the adapters of `slots`: slot -> (A (r, in), B (out, r), scale folded
    into B), both in the compute dtype on the base's device.

    fixed_rows: multiply in fixed-size chunks (`qinfer.linear.dense`), as a batch-invariant
    model's dense Linears do: an adapter's rows then come out the same in any batch.
    """

    takes_adapters = True

    def __init__(self, base: Linear, fixed_rows: bool = False) -> None:
        super().__init__()
        self.base = base
        self.out_features, self.in_features = base.out_features, base.in_features
        self.bias = base.bias
        self.fixed_rows = fixed_rows
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Hold adapter `slot`: a (r, in) and b (out, r), scale folded into b."""
        self.slots[slot] = (a, b)

    def remove(self, slot: int) -> None:
        """Drop adapter `slot` (nothing where it holds none)."""
        self.slots.pop(slot, None)

    def forward(self, x: torch.Tensor, adapters: AdapterRows | None = None) -> torch.Tensor:
        """x (T, in) -> (T, out): the base on every row, then each group's adapter added to
        its rows."""
        y = self.base(x)
        if adapters is None:
            return y
        for slot, rows in adapters.groups:
            pair = self.slots.get(slot)
            if pair is None:  # the adapter does not target this projection
                continue
            a, b = pair
            shrunk = self._mm(x.index_select(0, rows), a)  # (n, r)
            y.index_add_(0, rows, self._mm(shrunk, b))  # (n, out) onto the group's rows
        return y

    def _mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (n, k) @ weight (m, k)^T -> (n, m), in fixed chunks where asked."""
        if self.fixed_rows:
            return linear_in_fixed_chunks(x, weight)
        return x @ weight.t()

    def dequantize(self) -> torch.Tensor:
        return self.base.dequantize()

    @property
    def nbytes(self) -> int:
        adapters = sum(a.nbytes + b.nbytes for a, b in self.slots.values())
        return self.base.nbytes + adapters
