"""Qwen3-VL's vision encoder: image patches -> one embedding per merged token, plus the
DeepStack features the language model adds to its first layers' hidden states. Qwen3.5's
tower is the same without DeepStack (`Qwen3_5VisionConfig`).

    patches (N, C * T * P * P)
      -> patch embed (Conv3d with bias, as one matmul)                     (N, hidden)
         + a learned position table (side x side), resampled bilinearly (corners aligned)
           to each image's grid
      -> depth x block: x + attn(norm1(x)); x + mlp(norm2(x))
           LayerNorm; attention with 2-D RoPE over each whole frame; MLP fc1 -> GELU (tanh)
           -> fc2 with biases
           after each block of `deepstack_visual_indexes`: a DeepStack merger of its output
      -> merger: LayerNorm, each merge^2 neighbouring patches concatenated, Linear, GELU,
         Linear                                                            (N / merge^2, out)
      (DeepStack mergers: the patches concatenated first, then LayerNorm over the whole)

Tensor names are the checkpoint's, under `model.visual.` (`visual.` in older saves).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qinfer.core.errors import ConfigError
from qinfer.core.module import Module
from qinfer.core.parallel import SINGLE, Parallel
from qinfer.layers.mlp import GATE_ACTIVATIONS
from qinfer.linear import linear
from qinfer.vision.attention import Runs
from qinfer.vision.grid import Grid, frame_bounds
from qinfer.vision.parts import (
    LayerNorm,
    PatchEmbed,
    Stored,
    VisionAttention,
    axial_frequencies,
    axial_rotation,
    layer_indexes,
    positive,
    rope_theta,
    set_compute_dtype,
    vision_section,
)
from qinfer.weights.slots import LinearSlot, LinearSource, Placed


@dataclass(frozen=True)
class Qwen3VisionConfig:
    """The `vision_config` of a Qwen3-VL config.json (transformers' field names)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_side(self) -> int:
        """The learned position table's side: it holds side x side positions."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3VisionConfig:
        """From a Qwen3-VL config.json dict (its `vision_config`); refusals name the field."""
        vision = vision_section(cfg)
        depth, hidden, heads = (positive(vision, k) for k in ("depth", "hidden_size", "num_heads"))
        positions = positive(vision, "num_position_embeddings")
        if math.isqrt(positions) ** 2 != positions:
            raise ConfigError(
                "config field 'vision_config.num_position_embeddings' must be a square number"
            )
        act = vision.get("hidden_act", cls.hidden_act)
        if act not in GATE_ACTIVATIONS:
            raise ConfigError(
                f"config field 'vision_config.hidden_act' is {act!r}; supported: "
                f"{', '.join(GATE_ACTIVATIONS)}"
            )
        return cls(
            depth=depth,
            hidden_size=hidden,
            intermediate_size=positive(vision, "intermediate_size"),
            num_heads=heads,
            out_hidden_size=positive(vision, "out_hidden_size"),
            num_position_embeddings=positions,
            in_channels=positive(vision, "in_channels", cls.in_channels),
            patch_size=positive(vision, "patch_size", cls.patch_size),
            temporal_patch_size=positive(vision, "temporal_patch_size", cls.temporal_patch_size),
            spatial_merge_size=positive(vision, "spatial_merge_size", cls.spatial_merge_size),
            deepstack_visual_indexes=layer_indexes(
                vision, "deepstack_visual_indexes", cls.deepstack_visual_indexes, depth
            ),
            rope_theta=rope_theta(vision, hidden, heads),
            hidden_act=act,
        )


@dataclass(frozen=True)
class Qwen3_5VisionConfig(Qwen3VisionConfig):
    """The `vision_config` of a Qwen3.5 config.json: Qwen3-VL's tower without DeepStack
    (transformers' `Qwen3_5VisionModel` drops its mergers; a `deepstack_visual_indexes`
    the config may still carry is not read)."""

    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3_5VisionConfig:
        vision = dict(vision_section(cfg))
        vision.pop("deepstack_visual_indexes", None)
        return super().from_hf({**cfg, "vision_config": vision})


@dataclass(frozen=True)
class VisionFeatures:
    """What Qwen3-VL's tower gives the language model, in patch order, fp32.

    embeddings: (N / merge^2, out_hidden_size), one per merged token (its image tokens);
    deepstack: one (N / merge^2, out_hidden_size) per `deepstack_visual_indexes` block, in
        that order: added to the hidden states of the image tokens after the language
        model's first len(deepstack) layers.
    """

    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]


def interpolated_positions(
    table: torch.Tensor, grids: Sequence[Grid], merge_size: int
) -> torch.Tensor:
    """The learned (side * side, hidden) position table resampled to every patch: (N, hidden).

    Bilinear with corners aligned (patch row r of h sits at r * (side - 1) / (h - 1) of the
    table), in patch order (block by block), every frame the same; transformers'
    `get_vision_interpolation_indices_and_weights` taps and weights.
    """
    side = math.isqrt(table.shape[0])
    out = []
    for t, h, w in grids:
        r0, r1, dr = (x.to(table.device) for x in _axis_taps(h, side))  # (h,) each
        c0, c1, dc = (x.to(table.device) for x in _axis_taps(w, side))  # (w,) each
        dr, dc = dr[:, None, None], dc[None, :, None]  # to broadcast over (h, w, hidden)
        corners = (  # (h, w, hidden) each, by its weight
            table[r0[:, None] * side + c0] * ((1 - dr) * (1 - dc)),
            table[r0[:, None] * side + c1] * ((1 - dr) * dc),
            table[r1[:, None] * side + c0] * (dr * (1 - dc)),
            table[r1[:, None] * side + c1] * (dr * dc),
        )
        grid = sum(corners)  # (h, w, hidden)
        M = merge_size
        # (h, w, hidden) -> (h/M, M, w/M, M, hidden) -> (h/M, w/M, M, M, hidden): patch order
        blocks = grid.reshape(h // M, M, w // M, M, -1).transpose(1, 2).reshape(h * w, -1)
        out.append(blocks.repeat(t, 1))
    return torch.cat(out)


def _axis_taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Along one axis of n patches: each patch's two neighbouring table rows (n,) and its
    fraction of the way to the second (n,) fp32, the corners aligned."""
    at = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    low = at.floor()
    return low.long(), (low.long() + 1).clamp(max=side - 1), at - low


class Qwen3VisionBlock(Module):
    """A pre-norm block: x + attn(norm1(x)), then x + fc2(act(fc1(norm2(x)))); x (N, hidden)
    fp32."""

    def __init__(self, prefix: str, config: Qwen3VisionConfig) -> None:
        super().__init__()
        H, width = config.hidden_size, config.intermediate_size
        self.norm1 = LayerNorm(f"{prefix}.norm1", H)
        self.norm2 = LayerNorm(f"{prefix}.norm2", H)
        self.attn = VisionAttention(f"{prefix}.attn", H, config.num_heads)
        self.fc1 = LinearSlot(LinearSource((f"{prefix}.mlp.linear_fc1",), ((width, H),), bias=True))
        self.fc2 = LinearSlot(LinearSource((f"{prefix}.mlp.linear_fc2",), ((H, width),), bias=True))
        self.activation = GATE_ACTIVATIONS[config.hidden_act]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Runs
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + linear(self.activation(linear(self.norm2(x), self.fc1)), self.fc2)


class Qwen3PatchMerger(Module):
    """(N, hidden) -> (N / merge^2, out_hidden): LayerNorm, each merge^2 consecutive patches
    side by side, Linear, GELU, Linear. after_concat: the norm runs over the concatenated
    patches (a DeepStack merger's), not over each patch (the final merger's)."""

    def __init__(self, prefix: str, config: Qwen3VisionConfig, after_concat: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.after_concat = after_concat
        self.norm = LayerNorm(f"{prefix}.norm", self.width if after_concat else config.hidden_size)
        self.fc1 = LinearSlot(
            LinearSource((f"{prefix}.linear_fc1",), ((self.width, self.width),), bias=True)
        )
        self.fc2 = LinearSlot(
            LinearSource(
                (f"{prefix}.linear_fc2",), ((config.out_hidden_size, self.width),), bias=True
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (N, hidden) -> (N / M^2, M^2 hidden): a merged token's patches side by side
        if self.after_concat:
            merged = self.norm(x.reshape(-1, self.width))
        else:
            merged = self.norm(x).reshape(-1, self.width)
        return linear(F.gelu(linear(merged, self.fc1)), self.fc2).float()  # exact (erf) GELU


class Qwen3_VisionEncoder(Module, Placed):
    """Qwen3-VL's vision tower, built empty from its config: `qinfer.weights.load.load`
    fills it (`qinfer.vision.load_vision_encoder`), `init_random` at random.

    forward(patches (N, C * T * P * P), grids) -> `VisionFeatures`: the merged tokens'
    embeddings and the DeepStack features, each (N / merge^2, out_hidden_size) fp32.
    """

    def __init__(self, config: Qwen3VisionConfig, prefix: str = "model.visual") -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(
            f"{prefix}.patch_embed.proj",
            config.hidden_size,
            config.in_channels,
            config.temporal_patch_size,
            config.patch_size,
            bias=True,
        )
        self.pos_embed = Stored(
            f"{prefix}.pos_embed.weight", (config.num_position_embeddings, config.hidden_size)
        )
        self.blocks = torch.nn.ModuleList(
            Qwen3VisionBlock(f"{prefix}.blocks.{i}", config) for i in range(config.depth)
        )
        self.merger = Qwen3PatchMerger(f"{prefix}.merger", config, after_concat=False)
        self.deepstack_mergers = torch.nn.ModuleList(
            Qwen3PatchMerger(f"{prefix}.deepstack_merger_list.{i}", config, after_concat=True)
            for i in range(len(config.deepstack_visual_indexes))
        )
        self.place(SINGLE, torch.float32, torch.device("cpu"))

    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        """Every rank holds the whole tower (it is small); the norms before a matmul write
        the compute dtype; the RoPE frequencies live on `device`."""
        self.device = device
        set_compute_dtype(self, dtype)
        self.inv_freq = axial_frequencies(self.config.head_dim, self.config.rope_theta, device)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> VisionFeatures:
        config = self.config
        grids = [tuple(int(n) for n in grid) for grid in grids]
        frames = Runs(frame_bounds(grids), self.device)  # every block attends over a frame
        x = self.patch_embed(patches.to(self.device)).float()  # (N, hidden), the residual
        x = x + interpolated_positions(
            self.pos_embed.value.float(), grids, config.spatial_merge_size
        )
        cos, sin = axial_rotation(grids, config.spatial_merge_size, self.inv_freq)  # (N, 1, D/2)
        deepstack = []
        stacked = dict(zip(config.deepstack_visual_indexes, self.deepstack_mergers, strict=True))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in stacked:
                deepstack.append(stacked[i](x))
        return VisionFeatures(self.merger(x), tuple(deepstack))
