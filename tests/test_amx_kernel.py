"""int4_mm's "amx" path (AMX-INT8 tiles from 64 rows, VNNI's tiles below): the same bits as
the VNNI path and as each row's one-row call, on Q4_0-, Q4_1- and Q4_K-shaped int4 groups,
so that "auto" stays batch invariant across the switch between them. Skipped, with the
reason, where the CPU has no AMX-INT8 or Linux refuses this process the tiles.
"""

from __future__ import annotations

import pytest
import torch
from threads import torch_threads

from qinfer import kernels
from qinfer.linear import quantize_int4
from qinfer.linear.int4 import Int4Groups

#: Row counts: VNNI's tiles (1..9, 16, 33), the first AMX call (64), a remainder of the tiles'
#: 32-row steps (65) and a prompt (512).
ROW_COUNTS = (*range(1, 10), 16, 33, 64, 65, 512)


@pytest.fixture(scope="module")
def amx() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)
    if "amx" not in kernels.paths():
        pytest.skip(
            "no amx path here: the CPU lacks AMX-INT8, or Linux refused the tiles "
            f"(paths: {', '.join(kernels.paths())})"
        )


def groups(kind: str, n: int, k: int) -> Int4Groups:
    """Random int4 groups of 32 as GGUF's kinds hold them: Q4_1 fp16 scale and min; Q4_0 a
    symmetric fp16 scale (no min: m = -8 d); Q4_K fp32 scales d * sc (no fp16 values)."""
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=generator) * 0.05
    g = quantize_int4(w, 32)
    if kind == "Q4_0":
        return Int4Groups(g.q, g.scales, torch.zeros_like(g.zeros))
    if kind == "Q4_K":
        sc = torch.randint(1, 64, g.scales.shape, generator=generator).float() / 63
        return Int4Groups(g.q, g.scales * sc * (1 + 2.0**-20), g.zeros * sc)
    return g


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize(("n", "k"), [(77, 576), (40, 1024), (19, 32)])
def test_amx_gives_vnnis_and_the_one_row_bits(amx, kind, n, k) -> None:
    packed = kernels.pack_int4(groups(kind, n, k))
    assert (packed.d.dtype == torch.float32) == (kind == "Q4_K")
    assert (packed.m is None) == (kind == "Q4_0")  # m = -8 d made in the tiles' columns
    x = torch.randn(ROW_COUNTS[-1], k, generator=torch.Generator().manual_seed(4))
    x[:, ::37] *= 30  # outlier columns
    alone = torch.cat([kernels.int4_mm(x[i : i + 1], packed, "vnni") for i in range(len(x))])
    for m in ROW_COUNTS:
        tiles = kernels.int4_mm(x[:m], packed, "amx")
        assert torch.equal(tiles, kernels.int4_mm(x[:m], packed, "vnni")), f"M = {m}"
        assert torch.equal(tiles, alone[:m]), f"M = {m}"
    # and close to the float product (the bits are not all zeros or a copy of one row)
    reference = x.double() @ kernels_weight(packed).T
    assert (tiles.double() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_amx_whatever_the_threads(amx) -> None:
    packed = kernels.pack_int4(groups("Q4_1", 100, 256))
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(5))
    with torch_threads(1):
        single = kernels.int4_mm(x, packed, "amx")
    with torch_threads(2):
        assert torch.equal(single, kernels.int4_mm(x, packed, "amx"))
        assert torch.equal(single, kernels.int4_mm(x, packed, "vnni"))


def test_auto_takes_amx(amx) -> None:
    assert kernels.auto_path() == "amx"
    packed = kernels.pack_int4(groups("Q4_0", 33, 64))
    x = torch.randn(70, 64)
    assert torch.equal(kernels.int4_mm(x, packed), kernels.int4_mm(x, packed, "amx"))


def test_other_dot_products_take_vnnis_bits_on_amx(amx) -> None:
    """The int8 products have no tiles of their own: "amx" is VNNI's path there."""
    q = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    scales = torch.rand(24) + 0.5
    x = torch.randn(40, 64)
    assert torch.equal(kernels.int8_mm(x, q, scales, "amx"), kernels.int8_mm(x, q, scales, "vnni"))


def kernels_weight(packed: kernels.PackedInt4) -> torch.Tensor:
    """(N, K) float64: d * q + m from the packed nibbles."""
    qs = packed.qs.view(packed.qs.shape[0], -1, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(qs.shape[0], -1).double()
    d, m = (t.double().repeat_interleave(32, 1) for t in (packed.d, packed.offsets()))
    return d * q + m
