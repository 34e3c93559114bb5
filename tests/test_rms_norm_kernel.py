"""qinfer.kernels.add_rms_norm, the compiled residual add + RMSNorm of the CPU path: the
torch computation it replaces (h += x; F.rms_norm with the fp32 weight; one cast) within
fp32 rounding on every path this CPU runs, each row the same alone as in any batch and on
any thread count, Gemma's (1 + w) scale as `RMSNorm` holds it, and `RMSNorm.add`'s torch
path where the op does not run.

Tolerances: the op sums the squares in another order than torch's mean, so the scale r
differs by a few fp32 units (a relative 2^-21 is 16 of them); a bf16 output may then round
the other way, one bf16 unit at most: 7 stored mantissa bits, so a unit is 2^-8 to 2^-7 of
the value (2^-8 failed 32 of 1,200 random draws, up to 0.0074 relative, 2026-12-04). Every
input is drawn from a seeded generator, so the draws do not follow the tests run before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.layers import norm as norm_module
from qinfer.layers.norm import RMSNorm

FP32_RTOL = 2.0**-21
BF16_RTOL = 2.0**-7
# hidden sizes: SmolLM2's and Gemma 3 270M's, a multiple of neither 16 nor 8, and below 8
SIZES = [576, 640, 100, 5]


@pytest.fixture(scope="module")
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def path(request, built) -> str:
    if request.param not in kernels.norm_paths():
        pytest.skip(f"this CPU has no {request.param} path ({', '.join(kernels.norm_paths())})")
    return request.param


def stream(t: int, h: int, seed: int = 0) -> torch.Tensor:
    """(t, h) fp32 rows of very different magnitude, as a residual stream's are."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=generator) * torch.logspace(-3, 3, t)[:, None]


def reference(h: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor, out: torch.dtype):
    """What `RMSNorm.add` runs without the op: h + x, F.rms_norm with w, one cast."""
    summed = h if x is None else h + x
    return summed, F.rms_norm(summed, (h.shape[1],), w, 1e-6).to(out)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("x_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_the_op_is_torchs_add_and_norm_within_fp32_rounding(path, size, x_dtype, out):
    h = stream(9, size)
    x = None if x_dtype is None else torch.randn(9, size, generator=torch.Generator()).to(x_dtype)
    w = torch.randn(size, generator=torch.Generator().manual_seed(1)) * 0.2 + 1
    summed, want = reference(h, x, w, out)
    got = kernels.add_rms_norm(h, x, w, 1e-6, out, path)
    assert torch.equal(h, summed)  # the add in place, exactly torch's (bf16 widened exactly)
    assert got.dtype == out and got.shape == h.shape
    rtol = FP32_RTOL if out == torch.float32 else BF16_RTOL
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_alone_is_bit_identical_to_it_in_a_batch(path, threads):
    """1, 8 and 600 rows (600 split between threads): each row's output and sum the same
    bits as the row run alone."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = stream(600, 576)
        x = torch.randn(600, 576).bfloat16()
        w = torch.randn(576)
        batched_h = h.clone()
        batched = kernels.add_rms_norm(batched_h, x, w, 1e-6, torch.bfloat16, path)
        for rows in (slice(0, 1), slice(5, 13), slice(0, 600)):
            part_h = h[rows].clone()
            part = kernels.add_rms_norm(part_h, x[rows], w, 1e-6, torch.bfloat16, path)
            assert torch.equal(part, batched[rows]) and torch.equal(part_h, batched_h[rows])
        for r in (0, 7, 599):
            alone_h = h[r : r + 1].clone()
            alone = kernels.add_rms_norm(alone_h, x[r : r + 1], w, 1e-6, torch.bfloat16, path)
            assert torch.equal(alone, batched[r : r + 1])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_add_runs_the_op_with_the_norms_own_scale(built, offset):
    """`RMSNorm.add` on the CPU: Gemma's norm (offset 1) scales by 1 + w in fp32, as the
    torch path and transformers do; the residual takes the sublayer's output in place."""
    draws = torch.Generator().manual_seed(2)
    w = torch.randn(640, generator=draws) * 0.1
    norm = RMSNorm(640, w, 1e-6, offset=offset)
    norm.out_dtype = torch.bfloat16
    h, x = stream(4, 640), torch.randn(4, 640, generator=draws).bfloat16()
    summed, want = reference(h, x, w + offset, torch.bfloat16)
    got = norm.add(h, x)
    assert torch.equal(h, summed)
    torch.testing.assert_close(got.float(), want.float(), rtol=BF16_RTOL, atol=0)
    assert torch.equal(got, kernels.add_rms_norm(h.clone(), None, w + offset, 1e-6, got.dtype))


def test_rms_norm_add_falls_back_to_torchs_ops_where_the_op_cannot_run(monkeypatch):
    """Without the kernels (`kernels.in_use()` False: no compiler, not x86-64, or switched off) the same call
    runs torch's ops: h += x in place, and F.rms_norm's bits."""
    monkeypatch.setattr(kernels, "in_use", lambda: False)
    w = torch.randn(576)
    norm = RMSNorm(576, w, 1e-6)
    norm.out_dtype = torch.bfloat16
    h, x = stream(3, 576), torch.randn(3, 576).bfloat16()
    summed, want = reference(h, x, w, torch.bfloat16)
    got = norm.add(h, x)
    assert torch.equal(h, summed) and torch.equal(got, want)


def test_the_op_is_used_only_where_it_applies(built):
    """The CPU fp32 residual with an fp32 or bf16 output and sublayer; not an fp16 output,
    a strided residual or a residual that needs gradients (torch's ops there)."""
    h = torch.randn(2, 64)
    assert norm_module._compiled(h, torch.randn(2, 64).bfloat16(), torch.bfloat16)
    assert norm_module._compiled(h, None, torch.float32)
    assert not norm_module._compiled(h, None, torch.float16)
    assert not norm_module._compiled(h.t().contiguous().t(), None, torch.float32)
    assert not norm_module._compiled(h.bfloat16(), None, torch.float32)
    assert not norm_module._compiled(h.requires_grad_(), None, torch.float32)


def test_a_wrong_shape_or_path_is_refused_in_one_line(built):
    with pytest.raises(RuntimeError, match=r"w must be \(64,\) fp32"):
        kernels.add_rms_norm(torch.randn(2, 64), None, torch.randn(32), 1e-6, torch.float32)
    with pytest.raises(RuntimeError, match="path must be auto, scalar, avx2 or avx512"):
        kernels.add_rms_norm(torch.randn(2, 64), None, torch.randn(64), 1e-6, torch.float32, "x")


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_heads_op_norms_each_head_as_the_row_op_does(path, out):
    """QK-norm: the q and k heads inside the fused projection's output (a strided view),
    read only; each head's bits those of `add_rms_norm` on it as a row, by its norm's
    weight (q's for the first heads, k's after)."""
    draws = torch.Generator().manual_seed(3)
    T, Hq, Hkv, D = 5, 6, 2, 128
    fused = torch.randn(T, Hq + 2 * Hkv, D, generator=draws) * 3
    heads = fused[:, : Hq + Hkv]  # (T, Hq + Hkv, D), not contiguous
    before = fused.clone()
    wq, wk = torch.randn(D, generator=draws), torch.randn(D, generator=draws)
    got = kernels.heads_rms_norm(heads, wq, wk, Hq, 1e-6, out, path)
    assert torch.equal(fused, before) and got.shape == heads.shape and got.dtype == out
    for r in range(Hq + Hkv):
        w = wq if r < Hq else wk
        row = kernels.add_rms_norm(heads[:, r].contiguous(), None, w, 1e-6, out, path)
        assert torch.equal(got[:, r], row)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_head_norms_run_the_heads_op_within_fp32_rounding_of_torchs(built, offset):
    """`head_norms` on fp32 heads (Qwen3's, Gemma 3's QK-norm): the op, within fp32
    rounding of the torch path it replaces (F.rms_norm, then the fp32 scale)."""
    draws = torch.Generator().manual_seed(4)
    q_norm = RMSNorm(64, torch.randn(64, generator=draws), 1e-6, offset=offset)
    k_norm = RMSNorm(64, torch.randn(64, generator=draws), 1e-6, offset=offset)
    heads = torch.randn(3, 8 + 2 * 4, 64, generator=draws)[:, :12]
    got = norm_module.head_norms(heads, q_norm, k_norm, 8)
    weight = torch.cat((q_norm.weight32.expand(8, -1), k_norm.weight32.expand(4, -1)))
    want = F.rms_norm(heads, (64,), eps=1e-6) * weight
    torch.testing.assert_close(got, want, rtol=FP32_RTOL, atol=1e-6)
    op = kernels.heads_rms_norm(heads, q_norm.weight32, k_norm.weight32, 8, 1e-6, torch.float32)
    assert torch.equal(got, op)  # the op's bits: it ran


def test_heads_op_refuses_a_wrong_weight_in_one_line(built):
    with pytest.raises(RuntimeError, match=r"w_first and w_rest must be \(64,\) fp32 CPU"):
        kernels.heads_rms_norm(torch.randn(1, 4, 64), torch.randn(64), torch.randn(32), 2,
                               1e-6, torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"h must be \(T, R, D\) fp32"):
        kernels.heads_rms_norm(torch.randn(4, 64), torch.randn(64), torch.randn(64), 2,
                               1e-6, torch.float32)  # fmt: skip
