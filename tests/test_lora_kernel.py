"""The kernels' LoRA op (`kernels.lora_add`, as `LoraLinear` runs it on the CPU): the same
numbers as the layer's torch path for fused and unfused projections, rows without an
adapter untouched, a row's bits the same in any batch at any thread count, bf16 operands
widened exactly. What it computes: docs/KERNELS.md."""

from __future__ import annotations

import pytest
import torch
from threads import torch_threads

from qinfer import kernels
from qinfer.core.forward_batch import AdapterRows
from qinfer.linear.dense import DenseLinear
from qinfer.linear.lora import LoraLinear

#: fp32 outputs of order 1 against the torch path's (GEMMs summing in another order)
DELTA = 1e-5
#: fused (q/k/v-like, odd sizes for the vector tails) and unfused
PARTS = [(70, 33, 33), (48,)]
IN = 83  # 5 AVX-512 chunks and a tail of 3


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


def projection(parts: tuple[int, ...], k: int = IN, dtype=torch.float32) -> LoraLinear:
    """A dense projection with 4 adapters of ranks 4, 8, 16, 8; slot 3 leaves part 1 out
    (slot 2 the only part of an unfused one), slot 1 targets part 0 alone."""
    gen = torch.Generator().manual_seed(sum(parts) + k)
    base = DenseLinear(torch.randn(sum(parts), k, generator=gen) / k**0.5)
    layer = LoraLinear(base, parts)
    for slot, rank in enumerate((4, 8, 16, 8)):
        pairs = [
            (
                (torch.randn(rank, k, generator=gen) / k**0.5).to(dtype),
                (torch.randn(out, rank, generator=gen) / rank**0.5).to(dtype),
            )
            if (slot, p) not in ((3, 1), (1, 1), (1, 2))
            else None
            for p, out in enumerate(parts)
        ]
        layer.add(slot, pairs)
    assert layer.on_kernel
    return layer


def add(layer: LoraLinear, y: torch.Tensor, x: torch.Tensor, rows, slots, path="auto"):
    """y with the op's products added (a copy: y is left as it is)."""
    out = y.clone()
    a, b_t = layer.a, layer.b_t
    rows, slots = torch.tensor(rows), torch.tensor(slots)
    kernels.lora_add(out, x, rows, slots, a, layer.column_slots, b_t, layer.part_rows, path)
    return out


@pytest.mark.parametrize("path", kernels.norm_paths() if kernels.buildable() else [])
@pytest.mark.parametrize("parts", PARTS)
def test_equals_the_torch_path(parts, path):
    """Every row with an adapter, or some rows: within DELTA of `add_products`; the rows
    without one keep the base's bits."""
    layer = projection(parts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, IN, generator=gen)
    y = layer.base(x)
    for rows, slots in (
        (list(range(9)), [0, 1, 2, 3, 0, 1, 2, 3, 2]),
        ([1, 4, 5, 8], [2, 0, 2, 3]),
        ([3], [5]),  # a slot the projection does not hold adds nothing
    ):
        got = add(layer, y, x, rows, slots, path)
        adapters = AdapterRows(torch.tensor(rows), torch.tensor(slots))
        expected = layer.add_products(y.clone(), x, adapters)
        torch.testing.assert_close(got, expected, rtol=0, atol=DELTA)
        others = [r for r in range(9) if r not in rows]
        assert torch.equal(got[others], y[others])
    adapters = AdapterRows(torch.tensor([0, 2]), torch.tensor([1, 2]))
    assert torch.equal(layer(x, adapters)[[0, 2]], add(layer, y, x, [0, 2], [1, 2])[[0, 2]])


@pytest.mark.parametrize("parts", [(512, 256, 256), (300,)])
def test_a_row_alone_equals_it_in_any_batch(parts):
    """A row through slot 2 alone, and at every place of batches of 1..9 rows with other
    slots (some rows of no adapter), at 1 and 2 threads: the same bits (in 1024: the work
    splits between threads)."""
    k = 1024
    layer = projection(parts, k)
    gen = torch.Generator().manual_seed(2)
    x_row, y_row = torch.randn(1, k, generator=gen), torch.randn(1, sum(parts), generator=gen)
    with torch_threads(1):
        alone = add(layer, y_row, x_row, [0], [2])
    for threads in (1, 2):
        for n in range(1, 10):
            x = torch.randn(n, k, generator=gen)
            y = torch.randn(n, sum(parts), generator=gen)
            for place in range(n):
                x[place], y[place] = x_row[0], y_row[0]
                rows = [r for r in range(n) if r == place or r % 3 != 1]
                slots = [2 if r == place else r % 4 for r in rows]
                with torch_threads(threads):
                    got = add(layer, y, x, rows, slots)
                assert torch.equal(got[place], alone[0]), (threads, n, place)


def test_bf16_operands_widen_exactly():
    """bf16 adapters, bf16 x: the bits of their fp32 widening; a bf16 y: the fp32 y's sum
    rounded once."""
    parts = PARTS[0]
    layer = projection(parts, dtype=torch.bfloat16)
    widened = projection(parts)  # the same seeds: replace its weights by the bf16 ones
    widened.a, widened.b_t = layer.a.float(), [b.float() for b in layer.b_t]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, IN, generator=gen).bfloat16()
    y = torch.randn(6, sum(parts), generator=gen).bfloat16().float()  # exact in bf16
    rows, slots = [0, 2, 3, 5], [0, 3, 2, 2]
    expected = add(widened, y, x.float(), rows, slots)
    assert torch.equal(add(layer, y, x, rows, slots), expected)
    assert torch.equal(add(layer, y.bfloat16(), x, rows, slots), expected.bfloat16())


def test_bad_inputs_refused_in_one_line():
    layer = projection(PARTS[1])
    x, y = torch.randn(2, IN), torch.randn(2, 48)
    cases = [
        ((y, x.double()), "x must be"),
        ((y, x, [5], [0]), "rows[0] = 5 is out of y's 2 rows"),
        ((y.t(), x), "y must be"),
    ]
    for args, message in cases:
        y_, x_, *rest = args
        rows, slots = (torch.tensor(r) for r in rest) if rest else (torch.tensor([0]),) * 2
        with pytest.raises(RuntimeError, match=message.replace("[", r"\[")) as refused:
            kernels.lora_add(y_, x_, rows, slots, layer.a, layer.column_slots, layer.b_t, [48])
        assert "\n" not in str(refused.value).strip()
