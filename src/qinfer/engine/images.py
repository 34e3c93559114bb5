"""A request's images in the engine (Qwen2.5-VL, Qwen3-VL): their tokens, positions, cache
keys and, while its prompt runs, the vision tower's embeddings.

    images = prompt_images(parts, vision)          # at make_request: decode, patch, expand
    encode_images(vision, [seq.images, ...])       # at a step: one tower call for them all
    seq.images.step(start, n)                      # the step's StepImages of that sequence
    seq.images.ran(num_computed)                   # after it: embeddings dropped once used

Each image is a run of t * h * w / merge^2 image tokens in the prompt (`spans`); a chat
prompt's placeholder (one image token per image, `PromptParts.placeholders`) is expanded
to it here, where the image's size is known. The runs' M-RoPE positions are computed once
(`mrope_positions`), a generated token's are its index + delta. The tower runs when a step
first reaches an image's tokens, for every such sequence of the step at once; its
embeddings stay until the prompt's last image token is computed, and a preempted sequence
(recomputed from its first uncached token) encodes again from its patches, kept for it.

The prefix cache keys a block on its token ids and the `digests` (sha256 of the pixel
values and grid) of the images whose tokens it holds: a repeated image finds its blocks, a
different image with the same ids never does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from qinfer.core.errors import RequestError
from qinfer.runtime.step import StepImages
from qinfer.text.prompts import PromptParts
from qinfer.vision.image import PatchedImages, preprocess_images
from qinfer.vision.language_model import EncodedImages, VisionLanguageModel, no_vision_tower
from qinfer.vision.mrope import mrope_positions


@dataclass
class SequenceImages:
    """One sequence's images.

    patched: their patches (the tower's input, kept to encode again after a preemption);
    spans: each image's run of tokens [start, end) in the prompt, in order; digests: each
    image's content key; positions: (3, L) long, the prompt's M-RoPE positions; delta: a
    token at index i >= L sits at i + delta; encoded: the tower's output while the prompt
    still has image tokens to run (None before and after)."""

    patched: PatchedImages
    spans: list[tuple[int, int]]
    digests: list[bytes]
    positions: torch.Tensor
    delta: int
    encoded: EncodedImages | None = None

    @property
    def num_image_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)

    def digests_in(self, start: int, end: int) -> tuple[bytes, ...]:
        """The digests of the images with tokens among positions start .. end - 1."""
        return tuple(
            d for (s, e), d in zip(self.spans, self.digests, strict=True) if s < end and e > start
        )

    def needs_encoding(self, start: int, n: int) -> bool:
        """Whether a step running positions start .. start + n - 1 reaches image tokens
        whose embeddings are not at hand."""
        return self.encoded is None and bool(self.digests_in(start, start + n))

    def step(self, start: int, n: int) -> StepImages:
        """The `StepImages` of a step running positions start .. start + n - 1 (encoded
        first where `needs_encoding`): their positions, and the rows and embeddings of
        the image tokens among them (a chunk of a prompt takes the part of an image in it)."""
        L = self.positions.shape[1]
        end = start + n
        prompt = self.positions[:, start : min(end, L)]  # (3, k) of the prompt's rows
        after = torch.arange(max(start, L), max(end, L)) + self.delta  # generated: index + delta
        positions = torch.cat([prompt, after.expand(3, -1)], dim=1)  # (3, n)
        rows: list[int] = []
        for s, e in self.spans:
            rows += range(max(s, start) - start, min(e, end) - start)
        if not rows:
            return StepImages(positions, rows, torch.empty(0))
        # the image tokens are in embedding order: the step's are one run of embedding
        # rows, from the count of image tokens before it
        first = sum(min(max(start - s, 0), e - s) for s, e in self.spans)
        cut = slice(first, first + len(rows))
        encoded = self.encoded
        deepstack = tuple(feature[cut] for feature in encoded.deepstack)
        return StepImages(positions, rows, encoded.embeddings[cut], deepstack)

    def ran(self, num_computed: int) -> None:
        """Drop the embeddings once every image token's K/V is computed."""
        if num_computed >= self.spans[-1][1]:
            self.encoded = None


def prompt_images(
    parts: PromptParts, vision: VisionLanguageModel
) -> tuple[list[int], SequenceImages]:
    """A prompt's token ids with each image's run of tokens, and its `SequenceImages`:
    the images decoded and patched as the checkpoint says (a RequestError names a bad
    one), a placeholder expanded to its image's run, the runs checked against the grids."""
    config = vision.model.config
    if vision.encoder is None:
        raise no_vision_tower(config, parts.images[0])
    token, merge = config.image_token_id, vision.encoder.config.spatial_merge_size
    patched = preprocess_images(parts.images, vision.settings)
    counts = [t * h * w // merge**2 for t, h, w in patched.grids]
    ids = parts.token_ids
    if parts.placeholders:
        ids = _expanded(ids, token, counts)
    positions, delta = mrope_positions(ids, token, patched.grids, merge)  # checks the runs
    spans, i = [], 0
    for count in counts:  # the runs in order: mrope_positions found each one whole
        i = ids.index(token, i)
        spans.append((i, i + count))
        i += count
    return ids, SequenceImages(patched, spans, _digests(patched), positions, delta)


def _expanded(ids: list[int], token: int, counts: list[int]) -> list[int]:
    """ids with the k-th `token` repeated counts[k] times: each image's one placeholder
    token becomes its run."""
    found = ids.count(token)
    if found != len(counts):
        raise RequestError(
            f"the prompt has {found} image placeholders for {len(counts)} images", "image"
        )
    runs = iter(counts)
    return [t for token_id in ids for t in ([token_id] * (next(runs) if token_id == token else 1))]


def _digests(patched: PatchedImages) -> list[bytes]:
    """Each image's sha256 over its grid and its patches' fp32 bytes."""
    digests, first = [], 0
    for grid in patched.grids:
        count = grid[0] * grid[1] * grid[2]
        pixels = patched.pixel_values[first : first + count].contiguous().numpy()
        digest = hashlib.sha256(repr(tuple(grid)).encode())
        digest.update(pixels.data)
        digests.append(digest.digest())
        first += count
    return digests


def encode_images(vision: VisionLanguageModel, images: list[SequenceImages]) -> None:
    """Run the tower once over every image of these sequences (their patches one after
    the other) and hand each sequence its embeddings (and DeepStack features)."""
    pixel_values = torch.cat([seq.patched.pixel_values for seq in images])
    grids = tuple(grid for seq in images for grid in seq.patched.grids)
    encoded = vision.encode_patches(PatchedImages(pixel_values, grids))
    sizes = [seq.num_image_tokens for seq in images]
    embeddings = encoded.embeddings.split(sizes)
    deepstack = [feature.split(sizes) for feature in encoded.deepstack]  # per level
    for b, seq in enumerate(images):
        features = tuple(level[b] for level in deepstack)
        seq.encoded = EncodedImages(seq.patched.grids, embeddings[b], features)
