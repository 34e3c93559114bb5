"""A projection with LoRA adapters beside it: y = x W^T + (x A_i^T) (scale B_i)^T for the
rows of adapter i, the base alone for every other row.

Several adapters live in one module, each in a slot (`qinfer.lora.adapters` numbers them),
packed side by side. A fused projection (q/k/v, gate/up) has parts, each its own rows of
the output; an adapter holds a pair per part it targets. The packing is part-major: A
(C, in) stacks part 0's A of every slot, then part 1's, ...; `column_slots` (C,) names each
column's slot; part p owns the column range `part_columns[p]` and its B^T (C_p, out_p).

On the CPU, where the kernels run (`qinfer.kernels.in_use`), a step's adapter rows
(`qinfer.core.forward_batch.AdapterRows`) take one op per projection, `kernels.lora_add`:
each row's shrink over its own slot's columns of A, then its expand by each part's B^T
rows of that slot, added to y in place, every sum in a fixed order per row (the same bits
in any batch, at any thread count), a slot's rows together so that each adapter's A and B
are read once a step (docs/KERNELS.md). At decode what LoRA costs is then mostly the
adapters' bytes (docs/BENCHMARKS.md, "LoRA adapters at decode"): hence one B per part (a
block-diagonal B over a fused projection's parts would read its zeros too).

Elsewhere (CUDA, or the kernels off), torch's ops (`add_products`): the rows gathered, one
shrink GEMM (n, in) x (in, C), each row's columns of other slots zeroed, one expand GEMM
per part (n, C_p) x (C_p, out_p), the result added to those rows (no gather or scatter when
every row of the step has an adapter). The zeroed columns add exact zeros, so a row's
output is its own adapter's alone, and the same whatever else its step holds; the shrink
does C / r_i times the one adapter's work, small beside the base's (C << out).

The base's kernel runs first on every row (whatever its kind: dense, int8, int4, GGUF
blocks); rows of no adapter are its output untouched, bit for bit.
"""

from __future__ import annotations

import torch

from qinfer import kernels
from qinfer.core.forward_batch import AdapterRows
from qinfer.linear.base import Linear
from qinfer.linear.dense import linear_in_fixed_chunks

#: One slot's adapter on one projection: per part, (A (r, in), B (out_p, r), scale folded
#: into B), or None for a part it does not target.
Pairs = list[tuple[torch.Tensor, torch.Tensor] | None]


class LoraLinear(Linear):
    """`base` with the adapters of `slots`: slot -> Pairs, on the base's device in the
    adapters' dtype (`qinfer.lora.adapters.adapter_dtype`): the rows are cast to it and
    the product back to the base's. parts (kept as part_rows): each part's output rows, in
    order (one part for an unfused projection).

    fixed_rows: multiply in fixed-size chunks (`qinfer.linear.dense`), as a batch-invariant
    model's dense Linears do: an adapter's rows then come out the same in any batch.
    """

    takes_adapters = True

    def __init__(self, base: Linear, parts: tuple[int, ...], fixed_rows: bool = False) -> None:
        super().__init__()
        if sum(parts) != base.out_features:
            raise ValueError(f"parts {parts} do not sum to out_features {base.out_features}")
        self.base, self.part_rows = base, parts
        self.out_features, self.in_features = base.out_features, base.in_features
        self.bias = base.bias
        self.fixed_rows = fixed_rows
        self.on_kernel = False  # whether the adapter rows run as `kernels.lora_add` (_pack)
        self.slots: dict[int, Pairs] = {}
        self.part_columns: list[tuple[int, int]] = []
        self.b_t: list[torch.Tensor | None] = []  # per part (C_p, out_p), None where C_p = 0
        for name in ("a", "column_slots"):  # buffers, as every Linear's tensors
            self.register_buffer(name, None)

    def add(self, slot: int, pairs: Pairs) -> None:
        """Hold adapter `slot`: its pair for each part (None where it targets none)."""
        if len(pairs) != len(self.part_rows):
            raise ValueError(f"{len(pairs)} pairs for {len(self.part_rows)} parts")
        self.slots[slot] = pairs
        self._pack()

    def remove(self, slot: int) -> None:
        """Drop adapter `slot` (nothing where it holds none)."""
        if self.slots.pop(slot, None) is not None:
            self._pack()

    def _pack(self) -> None:
        """The slots part-major: a (C, in), column_slots (C,), each part's columns and its
        B^T (C_p, out_p) contiguous (the expand reads it row-major: on the CPU several
        times faster than over (out_p, C_p)); each slot's pairs then views of them."""
        self.part_columns, self.b_t = [], []
        if not self.slots:
            self.a = self.column_slots = None
            return
        ordered = sorted(self.slots.items())
        a_rows, columns, start = [], [], 0
        for p in range(len(self.part_rows)):
            held = [(slot, pairs[p]) for slot, pairs in ordered if pairs[p] is not None]
            a_rows += [a for _, (a, _) in held]
            columns += [torch.full((a.shape[0],), slot, device=a.device) for slot, (a, _) in held]
            end = start + sum(a.shape[0] for _, (a, _) in held)
            self.part_columns.append((start, end))
            self.b_t.append(torch.cat([b.t() for _, (_, b) in held]).contiguous() if held else None)
            start = end
        self.a, self.column_slots = torch.cat(a_rows), torch.cat(columns)
        self.on_kernel = self.a.device.type == "cpu" and kernels.in_use()
        # each slot's pairs as views of the packed tensors: held once
        views: dict[int, Pairs] = {slot: [] for slot, _ in ordered}
        for p, (part_start, _) in enumerate(self.part_columns):
            offset = 0  # columns of the part before this slot's
            for slot, pairs in ordered:
                pair = pairs[p]
                if pair is None:
                    views[slot].append(None)
                    continue
                rank = pair[0].shape[0]
                a = self.a[part_start + offset : part_start + offset + rank]
                views[slot].append((a, self.b_t[p][offset : offset + rank].t()))
                offset += rank
        self.slots = views

    def forward(self, x: torch.Tensor, adapters: AdapterRows | None = None) -> torch.Tensor:
        """x (T, in) -> (T, out): the base on every row, then each adapter row's product
        added to it (on the CPU by the kernels' one op where they run)."""
        y = self.base(x)
        if adapters is None or self.a is None:
            return y
        if self.on_kernel and x.dtype in kernels.ACTIVATION_DTYPES:
            kernels.lora_add(
                y,
                x,
                adapters.rows,
                adapters.slots,
                self.a,
                self.column_slots,
                self.b_t,
                self.part_rows,
            )
            return y
        return self.add_products(y, x, adapters)

    def add_products(self, y: torch.Tensor, x: torch.Tensor, adapters: AdapterRows) -> torch.Tensor:
        """y (T, out) += each adapter row's product, in torch's ops (CUDA, or the CPU
        without the kernels)."""
        every_row = adapters.rows.shape[0] == x.shape[0]  # rows ascending: then 0 .. T-1
        rows = x if every_row else x.index_select(0, adapters.rows)
        shrunk = self._mm(rows.to(self.a.dtype), self.a)  # (n, C)
        # each row keeps its own slot's columns: (n, 1) == (C,) -> (n, C)
        shrunk = shrunk * (adapters.slots[:, None] == self.column_slots)
        deltas = [
            shrunk.new_zeros(shrunk.shape[0], out)
            if b_t is None
            else self._mm(shrunk[:, start:end], b_t.t())
            for out, (start, end), b_t in zip(
                self.part_rows, self.part_columns, self.b_t, strict=True
            )
        ]
        delta = (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=1)).to(y.dtype)
        return y.add_(delta) if every_row else y.index_add_(0, adapters.rows, delta)

    def _mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (n, k) @ weight (m, k)^T -> (n, m), in fixed chunks where asked."""
        if self.fixed_rows:
            return linear_in_fixed_chunks(x, weight)
        return x @ weight.t()

    def dequantize(self) -> torch.Tensor:
        return self.base.dequantize()

    @property
    def nbytes(self) -> int:
        packed = 0 if self.a is None else self.a.nbytes
        return self.base.nbytes + packed + sum(b.nbytes for b in self.b_t if b is not None)
