"""qinfer.kernels.silu_mul, the gated FFN's silu(gate) * up in one pass: torch's result to
fp32 rounding, the same bits whatever the rows beside, what the MLP takes it for, and the
one-line refusal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.layers.mlp import gate_times_up


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize(("T", "W"), [(1, 1536), (5, 96), (700, 40)])
def test_silu_mul_is_silu_of_the_gate_times_up(T, W):
    x = torch.randn(T, 3 * W)[:, W:] * 6  # rows 3W apart: a wider buffer's columns
    got = kernels.silu_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (T, W) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30)
    # a row's bits are its own: alone as among the others
    assert torch.equal(kernels.silu_mul(x[T // 2 : T // 2 + 1]), got[T // 2 : T // 2 + 1])


def test_the_mlp_takes_it_for_silu_on_fp32_rows_only(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "silu_mul", lambda x: calls.append(x) or x[:, : x.shape[1] // 2])
    x = torch.randn(3, 8)
    gate_times_up(x, F.silu)
    gate_times_up(x.bfloat16(), F.silu)  # torch's ops
    gate_times_up(x, F.gelu)
    gate_times_up(x[None], F.silu)  # not (T, 2W)
    assert len(calls) == 1


def test_bad_inputs_are_refused_in_one_line():
    with pytest.raises(RuntimeError, match="silu_mul: x must be"):
        kernels.silu_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="silu_mul: x must be"):
        kernels.silu_mul(torch.randn(3, 8).bfloat16())
