"""Bidirectional attention within runs of patches: one image's frame, or one window.

A vision encoder's tokens attend only to the tokens of their own run (no causal mask, no
cache). Runs of equal length are stacked and attended in one fused call each, so that an
image's hundreds of windows (most of one size) cost a few calls, not one each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qinfer.attention.sdpa import torch_sdpa_grouped


class Runs:
    """Consecutive runs of tokens, each attending within itself.

    bounds: [0, end of run 1, end of run 2, ...] in tokens (`grid.frame_bounds`,
    `grid.window_order`); runs of one length are gathered together by an index (R, L).
    """

    def __init__(self, bounds: Sequence[int], device: torch.device) -> None:
        starts: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            starts.setdefault(end - start, []).append(start)
        # one (R, L) index per length L: the tokens of its R runs
        self.groups = [
            (torch.tensor(first, device=device)[:, None] + torch.arange(length, device=device))
            for length, first in starts.items()
        ]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q, k, v: (N, H, D), every run's tokens -> (N, H, D), each token attending over
        its own run's keys (softmax accumulated in fp32 by torch's fused kernels)."""
        out = torch.empty_like(q)
        for index in self.groups:  # (R, L)
            # (R, L, H, D) -> (R, H, L, D): the runs as a batch
            q_runs, k_runs, v_runs = (x[index].transpose(1, 2) for x in (q, k, v))
            attended = torch_sdpa_grouped(q_runs, k_runs, v_runs, scale, None)  # (R, H, L, D)
            out[index] = attended.transpose(1, 2)
        return out
