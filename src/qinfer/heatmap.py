"""One head's attention weights as a PNG heatmap (`qinfer inspect --out attn.png`).

The same picture the inspector page draws (server/static/inspect.js): viridis at five
stops from weight 0 to 1, grey where the causal mask hides a key, the tokens along both
axes (rows: queries, columns: the keys they attend to). Needs Pillow (the `inspect` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from qinfer.errors import QinferError

#: Viridis at five stops, weight 0 -> 1 (inspect.js draws with the same).
STOPS = np.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64
)
MASKED = (226, 229, 234)  # a key after its query: the causal mask hides it
BACKGROUND, TEXT = (255, 255, 255), (28, 34, 48)
PADDING = 8  # pixels right of and below the grid


def cell_size(length: int) -> int:
    """Pixels per cell for `length` tokens: the grid near 560 pixels, cells 4 to 36 wide."""
    return max(4, min(36, 560 // length))


def token_label(text: str) -> str:
    """A token as the pages show it: whitespace made visible (inspect.js's tokenLabel)."""
    return text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·") or "∅"


def colours(weights: np.ndarray) -> np.ndarray:
    """RGB (..., 3) uint8 of weights (...) in [0, 1], interpolated between STOPS."""
    x = np.clip(weights, 0, 1) * (len(STOPS) - 1)
    i = np.minimum(x.astype(int), len(STOPS) - 2)
    t = (x - i)[..., None]
    return np.rint(STOPS[i] + (STOPS[i + 1] - STOPS[i]) * t).astype(np.uint8)


def write_attention_png(
    weights: torch.Tensor, tokens: Sequence[str], path: str | Path, title: str = ""
) -> None:
    """Draw weights (L, L) (row i: query i over keys 0..L-1) with `tokens` (L texts) on
    the axes into the PNG `path`."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise QinferError(
            "writing a PNG needs Pillow: pip install 'qinfer[inspect]' (or pip install pillow)"
        ) from None
    L = weights.shape[0]
    labels = [token_label(text)[:16] for text in tokens]
    cell = cell_size(L)
    font = ImageFont.load_default(size=12)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    margin = 12 + max(int(measure.textlength(label, font=font)) for label in labels)
    top = margin + (24 if title else 0)
    size = (margin + L * cell + PADDING, top + L * cell + PADDING)

    grid = colours(weights.float().numpy())  # (L, L, 3)
    grid[np.triu_indices(L, k=1)] = MASKED
    cells = np.repeat(np.repeat(grid, cell, axis=0), cell, axis=1)  # (L * cell, L * cell, 3)
    image = Image.new("RGB", size, BACKGROUND)
    image.paste(Image.fromarray(cells), (margin, top))
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((8, 6), title, fill=TEXT, font=font)
    if cell >= 9:  # room for a label per row and column
        for i, label in enumerate(labels):
            middle = int((i + 0.5) * cell)
            draw.text((margin - 6, top + middle), label, fill=TEXT, font=font, anchor="rm")
            column = Image.new("RGBA", (margin, cell), (0, 0, 0, 0))
            ImageDraw.Draw(column).text(
                (6, cell // 2), label, fill=TEXT + (255,), font=font, anchor="lm"
            )
            rotated = column.rotate(90, expand=True)  # reads bottom to top, as on the page
            image.paste(rotated, (margin + i * cell, top - margin), rotated)
    try:
        image.save(path, format="PNG")
    except OSError as error:
        raise QinferError(f"cannot write {path}: {error}") from None
