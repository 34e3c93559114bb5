"""Where each patch of a batch of images sits, and which patches attend to which.

A grid (t, h, w) counts an image's patches: t frames (1 for a still image) of h x w
patches, flattened in `image.patchify`'s order: frame by frame, each frame block by block
(merge x merge neighbouring patches consecutive, blocks row-major). These functions compute
from the grids alone (host integers, no tensor is read back):

- `patch_positions`: each patch's (row, column) in its frame, for the 2-D rotary embedding;
- `frame_bounds`: where each frame starts and ends, the runs full attention stays within;
- `window_order`: Qwen2.5-VL's window attention: the merged tokens reordered window by
  window, and where each window starts and ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: One image's (t, h, w): frames, rows and columns of patches.
Grid = tuple[int, int, int]


def patch_positions(grids: Sequence[Grid], merge_size: int) -> torch.Tensor:
    """(N, 2) long: the (row, column) of every patch in its frame, in patch order."""
    positions = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)  # (h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        # (h, w) -> (h/M, M, w/M, M) -> (h/M, w/M, M, M): block by block, as patchify orders
        block = (h // merge_size, merge_size, w // merge_size, merge_size)
        frame = torch.stack(
            [x.reshape(block).transpose(1, 2).flatten() for x in (rows, cols)], dim=-1
        )  # (h * w, 2)
        positions.append(frame.repeat(t, 1))  # every frame the same
    return torch.cat(positions)


def frame_bounds(grids: Sequence[Grid]) -> list[int]:
    """[0, end of frame 1, end of frame 2, ...] in patches: each frame attends within itself."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_order(
    grids: Sequence[Grid], merge_size: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: square windows of `window_size` pixels per side, that is
    window_size / (patch_size * merge_size) merged tokens (the edge windows smaller).

    Returns order ((N / merge^2,) long): the merged tokens (each merge^2 consecutive patches)
    window by window, windows row-major within a frame, tokens row-major within a window,
    images and frames in turn; and the window bounds in patches of that order, [0, end of
    window 1, ...]. The same order and windows as transformers' `get_vision_window_index`.
    """
    side = window_size // merge_size // patch_size  # merged tokens per window side
    unit = merge_size * merge_size  # patches per merged token
    orders, bounds, first = [], [0], 0
    for t, h, w in grids:
        th, tw = h // merge_size, w // merge_size  # merged tokens per column and row
        across, down = -(-tw // side), -(-th // side)  # windows per row and column
        frame, row, col = torch.meshgrid(
            torch.arange(t), torch.arange(th), torch.arange(tw), indexing="ij"
        )  # (t, th, tw) each
        window = (frame * down + row // side) * across + col // side
        within = (row % side) * side + col % side
        # each token's (window, place in it) as one key; the keys are distinct
        orders.append(torch.argsort((window * side * side + within).flatten()) + first)
        sizes = torch.bincount(window.flatten(), minlength=t * down * across)
        for size in sizes.tolist():
            bounds.append(bounds[-1] + size * unit)
        first += t * th * tw
    return torch.cat(orders), bounds
