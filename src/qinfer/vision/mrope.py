"""M-RoPE positions: where each token of a prompt with images sits, in three sections.

Qwen2.5-VL's and Qwen3-VL's language models rotate each head in three sections (temporal,
height, width), each by its own position. A text token has one position in all three,
counting up by one as in a text-only model. An image's tokens (one per merged patch block,
its grid (t, h, w) / merge) share the position p where the image starts on the temporal
axis and take p + row and p + column on the other two; the text after the image continues
at p + max(h, w) / merge, so an image "costs" the positions of its longer side, not of its
token count. After the prompt every token is at its index + `delta` in all three sections.

This is transformers' `get_rope_index` for still images (videos space their frames out in
time and are not handled here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qinfer.core.errors import RequestError
from qinfer.vision.grid import Grid


def mrope_positions(
    token_ids: Sequence[int], image_token_id: int, grids: Sequence[Grid], merge_size: int
) -> tuple[torch.Tensor, int]:
    """The (3, L) long positions (temporal, height, width) of a prompt of L tokens, and its
    delta: a token generated at index i >= L sits at i + delta in all three sections.

    Each image is a run of t * h * w / merge_size^2 `image_token_id` tokens, in the order of
    `grids`; a RequestError says where the tokens and the grids disagree.
    """
    sections: list[torch.Tensor] = []  # (3, n) runs, in token order
    position = 0  # where the next run starts
    images = iter(enumerate(grids))
    i, L = 0, len(token_ids)
    while i < L:
        if token_ids[i] != image_token_id:  # a run of text: one position per token
            end = i
            while end < L and token_ids[end] != image_token_id:
                end += 1
            sections.append((torch.arange(end - i) + position).expand(3, -1))
            position += end - i
            i = end
            continue
        image, grid = next(images, (None, None))
        if grid is None:
            raise RequestError("the prompt has more images' tokens than images", "image")
        t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
        count = t * h * w
        if token_ids[i : i + count].count(image_token_id) != count:
            raise RequestError(
                f"image {image}'s grid {tuple(grid)} needs {count} image tokens in a "
                "row; the prompt has fewer",
                "image",
            )
        # (t, h, w) grids of frame, row and column -> (3, t * h * w), row-major
        frame, row, col = torch.meshgrid(
            torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
        )
        sections.append(torch.stack([frame, row, col]).reshape(3, -1) + position)
        position += max(h, w)
        i += count
    if next(images, None) is not None:  # a grid left over
        raise RequestError("more images than the prompt has images' tokens for", "image")
    if not sections:
        raise RequestError("the prompt is empty", "prompt")
    positions = torch.cat(sections, dim=1)
    return positions, int(positions.max()) + 1 - L
