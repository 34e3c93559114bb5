"""A projection with LoRA adapters beside it: y = x W^T + (x A_i^T) (scale B_i)^T for the
rows of adapter i, the base alone for every other row.

Several adapters live in one module, each in a slot (`qinfer.lora.adapters` numbers them),
packed side by side: A (C, in), every slot's rank rows stacked, and B^T (C, out), each slot
owning its C columns of the rank (`column_slots` (C,)). A step's adapter rows
(`qinfer.core.forward_batch.AdapterRows`) take five ops per projection whatever the mix of
adapters: the rows gathered, one shrink GEMM (n, in) x (in, C), each row's columns of
other slots zeroed, one expand GEMM (n, C) x (C, out), the result added to those rows.
The zeroed columns add exact zeros, so a row's output is its own adapter's alone, and the
same whatever else its step holds; the shrink does C / r_i times the one adapter's work,
small beside the base's (C << out). Kernel launches, not FLOPs, are what LoRA costs at
decode (docs/BENCHMARKS.md, "LoRA adapters at decode"): one GEMM pair per adapter present,
punica's segmented form, costs five ops per adapter instead of five in all.

The base's kernel runs first on every row (whatever its kind: dense, int8, int4, GGUF
blocks); rows of no adapter are its output untouched, bit for bit.

A fused projection (q/k/v, gate/up) holds each part's adapter in its slot's columns: the
parts' A stacked, and B block-diagonal, part p's B at its output rows and its own rank's
columns (`qinfer.lora.adapters`).
"""

from __future__ import annotations

import torch

from qinfer.core.forward_batch import AdapterRows
from qinfer.linear.base import Linear
from qinfer.linear.dense import linear_in_fixed_chunks


class LoraLinear(Linear):
    """`base` with the adapters of `slots`: slot -> (A (r, in), B (out, r), scale folded
    into B), on the base's device in the adapters' dtype (`qinfer.lora.adapters.adapter_dtype`):
    the rows are cast to it and the product back to the base's.

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
        for name in ("a", "b_t", "column_slots"):  # buffers, as every Linear's tensors
            self.register_buffer(name, None)

    def add(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Hold adapter `slot`: a (r, in) and b (out, r), scale folded into b."""
        self.slots[slot] = (a, b)
        self._pack()

    def remove(self, slot: int) -> None:
        """Drop adapter `slot` (nothing where it holds none)."""
        if self.slots.pop(slot, None) is not None:
            self._pack()

    def _pack(self) -> None:
        """The slots side by side: a (C, in), b_t (C, out) contiguous (the expand reads it
        row-major: on the CPU several times faster than over (out, C)), column_slots (C,)."""
        if not self.slots:
            self.a = self.b_t = self.column_slots = None
            return
        pairs = sorted(self.slots.items())
        self.a = torch.cat([a for _, (a, _) in pairs])
        self.b_t = torch.cat([b.t() for _, (_, b) in pairs]).contiguous()
        self.column_slots = torch.cat(
            [torch.full((a.shape[0],), slot, device=a.device) for slot, (a, _) in pairs]
        )
        # each slot's pair as views of the packed tensors: held once
        start = 0
        for slot, (a, _) in pairs:
            end = start + a.shape[0]
            self.slots[slot] = (self.a[start:end], self.b_t[start:end].t())
            start = end

    def forward(self, x: torch.Tensor, adapters: AdapterRows | None = None) -> torch.Tensor:
        """x (T, in) -> (T, out): the base on every row, then each adapter row's product
        added to it."""
        y = self.base(x)
        if adapters is None or self.a is None:
            return y
        rows = x.index_select(0, adapters.rows).to(self.a.dtype)  # (n, in)
        shrunk = self._mm(rows, self.a)  # (n, C)
        # each row keeps its own slot's columns: (n, 1) == (C,) -> (n, C)
        shrunk = shrunk * (adapters.slots[:, None] == self.column_slots)
        delta = self._mm(shrunk, self.b_t.t())  # (n, out)
        return y.index_add_(0, adapters.rows, delta.to(y.dtype))

    def _mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (n, k) @ weight (m, k)^T -> (n, m), in fixed chunks where asked."""
        if self.fixed_rows:
            return linear_in_fixed_chunks(x, weight)
        return x @ weight.t()

    def dequantize(self) -> torch.Tensor:
        return self.base.dequantize()

    @property
    def nbytes(self) -> int:
        packed = 0 if self.a is None else self.a.nbytes + self.b_t.nbytes
        return self.base.nbytes + packed
