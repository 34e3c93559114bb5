"""What tests/test_linear_*.py share: random weights and activations, the reference every
kernel path is held to (`F.linear` in fp32 over `dequantize()`, within a tolerance of the
output's scale), and a weight as int8 blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.linear import Int8Blocks


def weight(rows: int = 48, columns: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.05


def activations(rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(7)).to(dtype)


def assert_matches_dequantized(w, x: torch.Tensor, tolerance: float | None = None) -> None:
    """w(x) against F.linear in fp32 over w.dequantize(), the same activations; tolerance:
    of the output's scale (default: 1e-5 for fp32 activations, 1e-2 for bf16)."""
    expected = F.linear(x.float(), w.dequantize(), None if w.bias is None else w.bias.float())
    got = w(x)
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = expected.abs().max().item()
    if tolerance is None:
        tolerance = 1e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=tolerance * scale)


def int8_blocks_of(w: torch.Tensor, block: int) -> Int8Blocks:
    """w as int8 blocks of `block` columns, each block's absmax at 127 (as Q8_0 rounds)."""
    blocks = w.view(len(w), -1, block)
    scales = blocks.abs().amax(-1) / 127  # (N, K / block)
    q = torch.round(blocks / scales[..., None]).to(torch.int8).view_as(w)
    return Int8Blocks(q, scales)
