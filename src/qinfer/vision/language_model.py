"""A vision-language checkpoint offline: prompts with images -> logits, then decode steps.

    vl = VisionLanguageModel.load("path/to/Qwen2.5-VL")
    out = vl.prefill([ImagePrompt(ids, [image]), ImagePrompt(other_ids)], max_length=64)
    out.logits                                   # (B, L, vocab) fp32, rows left-padded
    logits = vl.decode(out, next_ids)            # next_ids (B, n) -> (B, n, vocab)

Each prompt's images go through the vision tower (`encode`); their merged tokens take the
place of the prompt's image tokens (one per merged patch block, in order), positioned by
M-RoPE (`mrope_positions`). The rows run as one `ForwardBatch` whose `images` carry the
embeddings, their rows and (Qwen3-VL) the DeepStack features, through the reference
attention backend over contiguous caches (and a hybrid model's recurrent states: Qwen3.5's
rows must be of one length); decode steps are the text model's own call at
each row's index + delta. No engine is involved: this is the offline path tests and
scripts take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from qinfer.attention.reference import ReferenceAttention
from qinfer.attention.sdpa import sdpa_for
from qinfer.attention.state_pool import StatePool, StepStates
from qinfer.core.errors import RequestError
from qinfer.core.forward_batch import BatchImages, ForwardBatch
from qinfer.core.model_config import ModelConfig
from qinfer.model.loading import keeps_gguf_blocks, load_model
from qinfer.model.transformer import Transformer
from qinfer.vision.image import (
    ImageSettings,
    ImageSource,
    PatchedImages,
    image_name,
    preprocess_images,
)
from qinfer.vision.load import load_vision
from qinfer.vision.mmproj import check_projector
from qinfer.vision.mrope import mrope_positions
from qinfer.vision.qwen2_5_vl import Qwen2_5_VisionEncoder
from qinfer.vision.qwen3_vl import Qwen3_VisionEncoder, VisionFeatures


@dataclass(frozen=True)
class ImagePrompt:
    """One prompt: token ids holding each image's run of image tokens, and its images (paths,
    encoded bytes or Pillow images), in the order their tokens appear."""

    token_ids: Sequence[int]
    images: Sequence[ImageSource | Image.Image] = ()


@dataclass(frozen=True)
class EncodedImages:
    """A prompt's images through the vision tower.

    grids: each image's (t, h, w) in patches; embeddings: (N, hidden) fp32, one per merged
    token, every image's in turn; deepstack: Qwen3-VL's k DeepStack features, (N, hidden)
    fp32 each (none for Qwen2.5-VL).
    """

    grids: tuple[tuple[int, int, int], ...]
    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


@dataclass
class Prefilled:
    """What a prefill leaves for decoding.

    logits: (B, L, vocab) fp32, each row left-padded to the longest prompt (its padding's
    rows are noise); cache: the text model's caches; positions: (B,) long, where each row's
    next token sits in all three sections (its length + its M-RoPE delta), advanced by
    `VisionLanguageModel.decode`.
    """

    logits: torch.Tensor
    cache: list
    positions: torch.Tensor = field(repr=False)


class VisionLanguageModel:
    """A checkpoint's text model (`Transformer`) with its vision tower and image settings;
    a text-only checkpoint has no tower and refuses images, naming the first."""

    def __init__(
        self,
        model: Transformer,
        encoder: Qwen2_5_VisionEncoder | Qwen3_VisionEncoder | None,
        settings: ImageSettings | None,
    ) -> None:
        self.model, self.encoder, self.settings = model, encoder, settings

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        mmproj: str | Path | None = None,
    ) -> VisionLanguageModel:
        """The model of a Hugging Face folder or GGUF file (`load_model`'s dtype and
        device), with its vision tower and image settings: a vision-language folder's own,
        or those of llama.cpp's projector file `mmproj` for a GGUF text model
        (`qinfer.vision.load.load_vision`)."""
        if mmproj is not None:  # a wrong projector fails before the text model loads
            check_projector(mmproj, path)
        model = load_model(path, dtype=dtype, device=device)
        return cls(model, *load_vision(path, model, mmproj, keeps_gguf_blocks(dtype, None)))

    def encode(self, images: Sequence[ImageSource | Image.Image]) -> EncodedImages:
        """Images -> their patches (the checkpoint's preprocessing) -> the vision tower."""
        if self.encoder is None:
            raise no_vision_tower(self.model.config, images[0])
        return self.encode_patches(preprocess_images(images, self.settings))

    def encode_patches(self, patched: PatchedImages) -> EncodedImages:
        """Preprocessed images (every image's patches, one after the other) -> the vision
        tower's embeddings (one call for all of them)."""
        with torch.inference_mode():
            out = self.encoder(patched.pixel_values, patched.grids)
        if isinstance(out, VisionFeatures):
            return EncodedImages(patched.grids, out.embeddings, out.deepstack)
        return EncodedImages(patched.grids, out)

    def prefill(self, prompts: Sequence[ImagePrompt], max_length: int | None = None) -> Prefilled:
        """Every prompt, left-padded to the longest (L), as one forward: logits (B, L, vocab)
        and caches with room for max_length positions (default L)."""
        if not prompts or any(len(p.token_ids) == 0 for p in prompts):
            raise RequestError("every prompt needs at least one token", "prompt")
        model, device = self.model, self.model.device
        vocab = model.config.vocab_size
        for b, p in enumerate(prompts):
            if not all(0 <= t < vocab for t in p.token_ids):
                raise RequestError(f"prompt {b} has a token id outside 0..{vocab - 1}", "prompt")
        B, L = len(prompts), max(len(p.token_ids) for p in prompts)
        tokens = torch.zeros(B, L, dtype=torch.long)
        positions = torch.full((3, B, L), -1, dtype=torch.long)  # padding: masked out
        next_positions, rows, images = [], [], []
        for b, prompt in enumerate(prompts):
            ids, pad = list(prompt.token_ids), L - len(prompt.token_ids)
            encoded = self.encode(prompt.images) if prompt.images else None
            grids = encoded.grids if encoded else ()
            # a text-only prompt needs no image token id: its positions count up from 0
            token = model.config.image_token_id
            merge = self.encoder.config.spatial_merge_size if self.encoder else 1
            placed, delta = mrope_positions(ids, token, grids, merge)  # (3, len), int
            positions[:, b, pad:] = placed
            tokens[b, pad:] = torch.tensor(ids)
            next_positions.append(len(ids) + delta)
            if encoded is not None:
                rows.append(b * L + pad + torch.nonzero(tokens[b, pad:] == token).flatten())
                images.append(encoded)
        # rows of one length need no padding (nor may a hybrid model's, whose recurrent
        # state would take it in: `make_cache` refuses it)
        padding = [L - len(p.token_ids) for p in prompts]
        cache = model.make_cache(
            B, left_padding=padding if any(padding) else None, max_length=max_length or L
        )
        attention = ReferenceAttention(cache, B, L, "causal", sdpa_for(model.features))
        pool = next((c for c in cache if isinstance(c, StatePool)), None)
        flat = positions.reshape(3, B * L)  # (3, B, L) -> (3, T), row by row
        # without images the three sections agree: the (T,) positions every RoPE takes
        flat = flat if images else flat[0]
        batch = ForwardBatch(
            token_ids=tokens.reshape(B * L).to(device),
            positions=flat.to(device),
            query_starts=list(range(0, B * L + 1, L)),
            logits_indices=torch.arange(B * L, device=device),
            attention=attention,
            images=_batch_images(rows, images, device),
            states=None if pool is None else StepStates(pool, torch.arange(B, device=device)),
        )
        with torch.inference_mode():
            logits = model.compute_logits(model.forward(batch))
        return Prefilled(logits.view(B, L, -1), cache, torch.tensor(next_positions))

    def decode(self, state: Prefilled, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, n) after a prefill's rows (or earlier decodes) -> logits (B, n, vocab)
        fp32: the text model's call at each row's index + delta, the same in all three
        sections (transformers' `rope_deltas`)."""
        logits = self.model(tokens, offsets=state.positions, cache=state.cache)
        state.positions = state.positions + tokens.shape[1]
        return logits


def no_vision_tower(config: ModelConfig, image: ImageSource | Image.Image) -> RequestError:
    """The refusal of `image` (a prompt's first) by a model loaded without a vision tower,
    naming it and why: a text-only model, or a vision-language text model without its tower
    (a GGUF file's is llama.cpp's separate projector file)."""
    if config.image_token_id is None:
        reason = "a text-only model"
    else:
        reason = (
            "loaded without its vision tower: give its checkpoint folder, or with a GGUF "
            "file its projector (--mmproj FILE)"
        )
    return RequestError(
        f"image {image_name(0, image)} was sent to model_type {config.model_type!r}, {reason}",
        "image",
    )


def _batch_images(
    rows: list[torch.Tensor], images: list[EncodedImages], device: torch.device
) -> BatchImages | None:
    """The prompts' images as one `BatchImages`: their rows of the flat batch, and their
    embeddings and DeepStack features in the same order (None: no prompt has an image)."""
    if not images:
        return None
    levels = zip(*(encoded.deepstack for encoded in images), strict=True)
    return BatchImages(
        rows=torch.cat(rows).to(device),
        embeddings=torch.cat([encoded.embeddings for encoded in images]).to(device),
        deepstack=tuple(torch.cat(level).to(device) for level in levels),
    )
