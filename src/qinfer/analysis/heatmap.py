"""One head's attention weights as a PNG heatmap (`qinfer inspect --out attn.png`).

The same picture the inspector page draws (server/static/inspect.js): viridis at five
stops from weight 0 to 1, grey where the causal mask hides a key, the tokens along both
axes (rows: queries, columns: the keys they attend to). Around it: a title (the model,
layer and head), and a colour bar from 0 to 1 on the right. Drawn with Pillow, a
dependency of qinfer.

    title
    <column labels, rotated>
    row labels | grid (L x L cells) | colour bar 0..1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qinfer.core.errors import QinferError

if TYPE_CHECKING:
    import torch
    from PIL import ImageFont

#: Viridis at five stops, weight 0 -> 1 (inspect.js draws with the same).
STOPS = np.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64
)
MASKED = (226, 229, 234)  # a key after its query: the causal mask hides it
BACKGROUND, TEXT = (255, 255, 255), (28, 34, 48)
PADDING = 10  # pixels around the picture's parts
FONT_SIZE, TITLE_SIZE = 13, 16
LABEL_CHARS = 16  # a token label is cut to this many characters
BAR_WIDTH = 16  # the colour bar's width; its height is the grid's
MIN_LABEL_SPACING = 14  # pixels between two labels: closer, only every n-th is drawn


def cell_size(length: int) -> int:
    """Pixels per cell for `length` tokens: the grid near 640 pixels, cells 4 to 48 wide."""
    return max(4, min(48, 640 // length))


def label_step(cell: int) -> int:
    """Label every n-th token so that labels are at least MIN_LABEL_SPACING apart."""
    return -(-MIN_LABEL_SPACING // cell)


def token_label(text: str) -> str:
    """A token as the pages show it: whitespace made visible (inspect.js's tokenLabel)."""
    return text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·") or "∅"


def colours(weights: np.ndarray) -> np.ndarray:
    """RGB (..., 3) uint8 of weights (...) in [0, 1], interpolated between STOPS."""
    x = np.clip(weights, 0, 1) * (len(STOPS) - 1)
    i = np.minimum(x.astype(int), len(STOPS) - 2)
    t = (x - i)[..., None]
    return np.rint(STOPS[i] + (STOPS[i + 1] - STOPS[i]) * t).astype(np.uint8)


@dataclass(frozen=True)
class Layout:
    """Where the parts go, in pixels: the grid's top-left corner (left, top), its cell
    size, the colour bar's left edge, and the whole picture's size (width, height)."""

    left: int
    top: int
    cell: int
    bar_left: int
    width: int
    height: int


def layout(length: int, labels: Sequence[str], title: str) -> Layout:
    """The Layout of a `length`-token heatmap with these (already cut) labels and title."""
    font, title_font = _fonts()
    measure = _measure()
    label_width = max(int(measure.textlength(label, font=font)) for label in labels)
    cell = cell_size(length)
    margin = PADDING + label_width + 6  # room for the row labels, or the rotated columns
    title_height = TITLE_SIZE + PADDING if title else 0
    left, top = margin, PADDING + title_height + label_width + 6
    grid = length * cell
    bar_left = left + grid + 2 * PADDING
    tick_width = int(measure.textlength("1.0", font=font)) + 6
    width = max(bar_left + BAR_WIDTH + tick_width + PADDING, _title_width(title, title_font))
    return Layout(left, top, cell, bar_left, width, top + grid + PADDING)


def check_png_writable(path: str | Path) -> None:
    """Refuse, before any work, an --out the heatmap could not be written to."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise QinferError(
            "writing a PNG needs Pillow, a dependency of qinfer: pip install pillow"
        ) from None
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        raise QinferError(f"--out {path}: the folder {folder} does not exist")


def write_attention_png(
    weights: torch.Tensor, tokens: Sequence[str], path: str | Path, title: str = ""
) -> None:
    """Draw weights (L, L) (row i: query i over keys 0..L-1) with `tokens` (L texts) on
    the axes, a colour bar and `title` into the PNG `path`."""
    check_png_writable(path)
    from PIL import Image, ImageDraw

    L = weights.shape[0]
    labels = [token_label(text)[:LABEL_CHARS] for text in tokens]
    at = layout(L, labels, title)
    font, title_font = _fonts()

    grid = colours(weights.float().numpy())  # (L, L, 3)
    grid[np.triu_indices(L, k=1)] = MASKED
    cells = np.repeat(np.repeat(grid, at.cell, axis=0), at.cell, axis=1)  # (L*cell, L*cell, 3)
    image = Image.new("RGB", (at.width, at.height), BACKGROUND)
    image.paste(Image.fromarray(cells), (at.left, at.top))
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((PADDING, PADDING), title, fill=TEXT, font=title_font)
    step = label_step(at.cell)
    for i in range(0, L, step):
        middle = int((i + 0.5) * at.cell)
        draw.text((at.left - 6, at.top + middle), labels[i], fill=TEXT, font=font, anchor="rm")
        column = Image.new("RGBA", (at.left, FONT_SIZE + 4), (0, 0, 0, 0))
        ImageDraw.Draw(column).text(
            (6, (FONT_SIZE + 4) // 2), labels[i], fill=(*TEXT, 255), font=font, anchor="lm"
        )
        rotated = column.rotate(90, expand=True)  # reads bottom to top, as on the page
        x = at.left + middle - rotated.width // 2
        image.paste(rotated, (x, at.top - at.left), rotated)
    _draw_colour_bar(image, at, font)
    try:
        image.save(path, format="PNG")
    except OSError as error:
        raise QinferError(f"cannot write {path}: {error}") from None


def _draw_colour_bar(image, at: Layout, font: ImageFont.FreeTypeFont) -> None:
    """A vertical bar beside the grid: weight 1 at its top, 0 at its bottom, ticks 0, 0.5, 1."""
    from PIL import Image, ImageDraw

    height = at.height - at.top - PADDING  # the grid's height
    weights = np.linspace(1.0, 0.0, height)[:, None].repeat(BAR_WIDTH, axis=1)  # (H, W)
    image.paste(Image.fromarray(colours(weights)), (at.bar_left, at.top))
    draw = ImageDraw.Draw(image)
    for value in (0.0, 0.5, 1.0):
        y = at.top + round((1 - value) * (height - 1))
        draw.line([(at.bar_left + BAR_WIDTH, y), (at.bar_left + BAR_WIDTH + 3, y)], fill=TEXT)
        anchor = "lt" if value == 1.0 else "lb" if value == 0.0 else "lm"
        draw.text(
            (at.bar_left + BAR_WIDTH + 6, y), f"{value:g}", fill=TEXT, font=font, anchor=anchor
        )


def _fonts() -> tuple[ImageFont.FreeTypeFont, ImageFont.FreeTypeFont]:
    from PIL import ImageFont

    return ImageFont.load_default(size=FONT_SIZE), ImageFont.load_default(size=TITLE_SIZE)


def _measure():
    from PIL import Image, ImageDraw

    return ImageDraw.Draw(Image.new("RGB", (1, 1)))


def _title_width(title: str, font: ImageFont.FreeTypeFont) -> int:
    return 2 * PADDING + int(_measure().textlength(title, font=font)) if title else 0
