"""Images in: a file's bytes -> the flat patch tensor and grid a Qwen-VL vision encoder reads.

The steps are those of transformers' Qwen2-VL image processor (the PIL one,
`Qwen2VLImageProcessorPil`, which Qwen2.5-VL and Qwen3-VL share), so that the same image
gives the same bytes:

1. decode with Pillow; RGB, any transparency composited onto white;
2. `smart_resize`: both sides a multiple of patch_size * merge_size, the pixel count within
   [min_pixels, max_pixels], the aspect ratio kept as closely as that allows (bicubic);
3. rescale to [0, 1] (in fp64, then fp32), normalise with the per-channel mean and std;
4. `patchify`: (C, H, W) -> (gh * gw, C * T * P * P) patches, ordered so that each
   merge_size x merge_size block of neighbouring patches is consecutive (the merger joins
   them into one token), every patch repeated T (temporal_patch_size) times: a still image
   is a clip of T identical frames.

The header is read before any pixel is decoded, so an image over the pixel limit is
refused without allocating it. Every refusal is one `RequestError` naming the image.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from qinfer.core.errors import ConfigError, RequestError

#: The most pixels an image may have before it is decoded: Pillow's own warning threshold
#: (about 89.5 million pixels, 256 MiB as RGB). Over twice that Pillow refuses on its own.
MAX_IMAGE_PIXELS = 1024 * 1024 * 1024 // 4 // 3

#: The formats `open_image` decodes: what browsers, cameras and the APIs' clients send.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
#: transformers' `smart_resize` refuses images more elongated than this.
MAX_ASPECT_RATIO = 200

#: OpenAI CLIP's per-channel statistics: the processor's defaults (Qwen2-VL, Qwen2.5-VL).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

#: Image sources: a file path, or the encoded bytes of a file (PNG, JPEG, ...).
ImageSource = str | Path | bytes

#: Processor flags whose only supported value is True (the steps above all run).
_ALWAYS_ON = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


@dataclass(frozen=True)
class ImageSettings:
    """A checkpoint's `preprocessor_config.json`, as far as images go.

    min_pixels / max_pixels: the pixel budget of a resized image; patch_size: a patch's side
    in pixels; merge_size: patches per side of one merged token; temporal_patch_size: frames
    per patch (an image is repeated that often); mean / std: per channel, after rescaling;
    resample: Pillow's filter number (3: bicubic).
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ImageSettings:
        """Settings from a preprocessor_config.json dict. The pixel budget is `size`'s
        shortest_edge / longest_edge (transformers 5, Qwen3-VL), overridden by min_pixels /
        max_pixels where present (Qwen2.5-VL), as the transformers processor reads them."""
        for flag in _ALWAYS_ON:
            if cfg.get(flag, True) is not True:
                raise ConfigError(f"preprocessor config field {flag!r} must be true")
        size = cfg.get("size") or {}
        if not isinstance(size, dict):
            raise ConfigError("preprocessor config field 'size' must be an object")
        defaults = cls()
        values = {
            "min_pixels": cfg.get("min_pixels", size.get("shortest_edge", defaults.min_pixels)),
            "max_pixels": cfg.get("max_pixels", size.get("longest_edge", defaults.max_pixels)),
            **{
                field: cfg.get(field, getattr(defaults, field))
                for field in ("patch_size", "merge_size", "temporal_patch_size", "resample")
            },
        }
        for field, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"preprocessor config field {field!r} must be a positive integer")
        if values["min_pixels"] > values["max_pixels"]:
            raise ConfigError("preprocessor config field 'min_pixels' is above 'max_pixels'")
        stats = {}
        for field, key in (("mean", "image_mean"), ("std", "image_std")):
            value = cfg.get(key, getattr(defaults, field))
            if not (
                isinstance(value, list | tuple)
                and len(value) == 3
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
            ):
                raise ConfigError(f"preprocessor config field {key!r} must be 3 numbers")
            stats[field] = tuple(float(v) for v in value)
        if any(s == 0 for s in stats["std"]):
            raise ConfigError("preprocessor config field 'image_std' must not hold a zero")
        rescale = cfg.get("rescale_factor", defaults.rescale_factor)
        if not isinstance(rescale, int | float) or isinstance(rescale, bool) or rescale <= 0:
            raise ConfigError(
                "preprocessor config field 'rescale_factor' must be a positive number"
            )
        return cls(**values, **stats, rescale_factor=float(rescale))

    @property
    def factor(self) -> int:
        """The pixels per side of one merged token: both resized sides are multiples of it."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class PatchedImages:
    """Images as a vision encoder reads them.

    pixel_values: (N, C * T * P * P) fp32, the patches of every image one after the other,
        N = sum of t * h * w over the grids;
    grids: one (t, h, w) per image, in patches (`image_grid_thw`); an image brings
        t * h * w / merge_size^2 tokens to the language model.
    """

    pixel_values: torch.Tensor
    grids: tuple[tuple[int, int, int], ...]


def open_image(
    source: ImageSource, name: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS
) -> Image.Image:
    """The decoded image of a file path or encoded bytes, as RGB; name: what errors call it
    (default: the path, or "image bytes").

    Refused (RequestError, one line): a file that is not an image, one that is truncated
    or corrupt, one over `max_pixels` (found from its header, before any pixel is decoded).
    """
    name = name or (str(source) if isinstance(source, str | Path) else "image bytes")
    try:
        file = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")
    except OSError as e:
        raise RequestError(f"image {name} cannot be read: {e.strerror or e}", "image") from None
    with file:
        try:
            # reads the header only; the formats images are sent in (Pillow's rarer plugins,
            # DDS or EPS, fail in ways of their own, or call out to Ghostscript)
            image = Image.open(file, formats=IMAGE_FORMATS)
        except UnidentifiedImageError:
            raise RequestError(
                f"image {name} is not an image file Pillow can read", "image"
            ) from None
        except Image.DecompressionBombError as e:  # over twice Pillow's own limit
            raise RequestError(f"image {name} is over the pixel limit: {e}", "image") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise RequestError(f"image {name} has a corrupt header: {e}", "image") from None
        width, height = image.size
        if width * height > max_pixels:
            raise RequestError(
                f"image {name} is {width} x {height} = {width * height:,} pixels, over the "
                f"limit of {max_pixels:,}",
                "image",
            )
        try:
            image.load()  # decodes every pixel: a truncated file fails here
        except (OSError, SyntaxError, ValueError, NotImplementedError) as e:
            raise RequestError(f"image {name} is truncated or corrupt: {e}", "image") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, an image with transparency (an alpha band or a transparent palette colour)
    composited onto white first, as transformers' `convert_to_rgb` does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def smart_resize(height: int, width: int, settings: ImageSettings, name: str) -> tuple[int, int]:
    """(height, width) resized: both multiples of `settings.factor`, height * width within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows. The same
    arithmetic as transformers' `smart_resize`; name: the image, for the error."""
    if min(height, width) < 1:
        raise RequestError(f"image {name} is {width} x {height}: it has no pixels", "image")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RequestError(
            f"image {name} is {width} x {height}: more elongated than {MAX_ASPECT_RATIO}:1",
            "image",
        )
    factor = settings.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > settings.max_pixels:  # shrink to fit, rounding down
        beta = math.sqrt((height * width) / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < settings.min_pixels:  # grow to fill, rounding up
        beta = math.sqrt(settings.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalized_pixels(image: Image.Image, settings: ImageSettings, name: str) -> np.ndarray:
    """An RGB image resized (`smart_resize`), rescaled and normalised: (3, H, W) fp32."""
    height, width = smart_resize(image.height, image.width, settings, name)
    resized = image.resize((width, height), resample=settings.resample)  # Pillow: (w, h)
    pixels = np.asarray(resized).transpose(2, 0, 1)  # (H, W, 3) uint8 -> (3, H, W)
    # transformers' order and precisions: rescale in fp64 then round to fp32, normalise in fp32
    scaled = (pixels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    mean = np.asarray(settings.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(settings.std, dtype=np.float32)[:, None, None]
    return (scaled - mean) / std


def patchify(pixels: torch.Tensor, settings: ImageSettings) -> tuple[torch.Tensor, int, int]:
    """(C, H, W) -> patches (gh * gw, C * T * P * P) and the grid (gh, gw) in patches.

    Patches are ordered block by block: each merge_size x merge_size block of neighbouring
    patches is consecutive (row-major within the block, blocks row-major), the order the
    encoder's merger expects. A patch's values are (C, T, P, P) flattened: each channel's
    P x P pixels repeated for the T frames of the still "clip".
    """
    P, M, T = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    C, H, W = pixels.shape
    gh, gw = H // P, W // P
    # (C, H, W) -> (C, gh/M, M, P, gw/M, M, P): split each side into blocks, patches, pixels
    blocks = pixels.reshape(C, gh // M, M, P, gw // M, M, P)
    # -> (gh/M, gw/M, M, M, C, P, P): block row, block column, patch in the block, its pixels
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)
    # -> (gh/M, gw/M, M, M, C, T, P, P): the frame axis, the same pixels T times
    frames = blocks.unsqueeze(5).expand(*blocks.shape[:5], T, P, P)
    return frames.reshape(gh * gw, C * T * P * P), gh, gw


def image_name(index: int, source: ImageSource | Image.Image) -> str:
    """What errors call image `index` of a request: its number, and its path if a file."""
    return f"{index} ({source})" if isinstance(source, str | Path) else str(index)


def preprocess_images(
    sources: Sequence[ImageSource | Image.Image],
    settings: ImageSettings,
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> PatchedImages:
    """Images (paths, encoded bytes, or Pillow images) -> `PatchedImages`: the patches of
    every image one after the other, (N, C * T * P * P) fp32, and each one's (1, h, w).
    max_pixels: the most pixels a file may hold before decoding (`open_image`)."""
    patches, grids = [], []
    for i, source in enumerate(sources):
        name = image_name(i, source)
        image = (
            to_rgb(source)
            if isinstance(source, Image.Image)
            else open_image(source, name, max_pixels)
        )
        pixels = torch.from_numpy(normalized_pixels(image, settings, name))
        flat, gh, gw = patchify(pixels, settings)
        patches.append(flat)
        grids.append((1, gh, gw))
    if not patches:
        raise RequestError("no images given", "image")
    return PatchedImages(torch.cat(patches), tuple(grids))
