"""Qwen2.5-VL's vision encoder: image patches -> one embedding per merged token.

    patches (N, C * T * P * P)
      -> patch embed (the Conv3d whose kernel is its stride: one matmul)   (N, hidden)
      -> tokens reordered window by window (`grid.window_order`)
      -> depth x block: x + attn(norm1(x)); x + mlp(norm2(x))
           attention: 2-D RoPE (a head's first half rotates by the patch's row, the second
           by its column), within a window, or within the whole frame in the blocks of
           `fullatt_block_indexes`; RMSNorm, SwiGLU MLP with biases
      -> merger: RMSNorm, each merge^2 neighbouring patches concatenated, Linear, GELU,
         Linear                                                            (N / merge^2, out)
      -> back in patch order

Tensor names are the checkpoint's, under `visual.` (`model.visual.` in some saves). The
residual stream is fp32 whatever the weights' dtype, as in the text model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from qinfer.core.errors import ConfigError
from qinfer.core.module import Module
from qinfer.core.parallel import SINGLE, Parallel
from qinfer.layers.mlp import GATE_ACTIVATIONS, gate_times_up
from qinfer.linear import linear
from qinfer.vision.attention import Runs
from qinfer.vision.grid import Grid, frame_bounds, window_order
from qinfer.vision.parts import (
    PatchEmbed,
    VisionAttention,
    axial_frequencies,
    axial_rotation,
    layer_indexes,
    positive,
    rms_norm,
    rope_theta,
    set_compute_dtype,
    vision_section,
)
from qinfer.weights.slots import LinearSlot, LinearSource, Placed


@dataclass(frozen=True)
class VisionConfig:
    """The `vision_config` of a Qwen2.5-VL config.json (transformers' field names)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionConfig:
        """From a Qwen2.5-VL config.json dict (its `vision_config`); refusals name the field."""
        vision = vision_section(cfg)
        depth, hidden, heads = (positive(vision, k) for k in ("depth", "hidden_size", "num_heads"))
        act = vision.get("hidden_act", cls.hidden_act)
        if act not in GATE_ACTIVATIONS:
            raise ConfigError(
                f"config field 'vision_config.hidden_act' is {act!r}; supported: "
                f"{', '.join(GATE_ACTIVATIONS)}"
            )
        patch = positive(vision, "patch_size", cls.patch_size)
        merge = positive(vision, "spatial_merge_size", cls.spatial_merge_size)
        window = positive(vision, "window_size", cls.window_size)
        if window < patch * merge:
            raise ConfigError(
                "config field 'vision_config.window_size' is smaller than one merged token "
                "(patch_size * spatial_merge_size pixels)"
            )
        return cls(
            depth=depth,
            hidden_size=hidden,
            intermediate_size=positive(vision, "intermediate_size"),
            num_heads=heads,
            out_hidden_size=positive(vision, "out_hidden_size"),
            # old checkpoints spell it in_chans
            in_channels=positive(vision, "in_channels", vision.get("in_chans", cls.in_channels)),
            patch_size=patch,
            temporal_patch_size=positive(vision, "temporal_patch_size", cls.temporal_patch_size),
            spatial_merge_size=merge,
            window_size=window,
            fullatt_block_indexes=layer_indexes(
                vision, "fullatt_block_indexes", cls.fullatt_block_indexes, depth
            ),
            rope_theta=rope_theta(vision, hidden, heads),
            hidden_act=act,
        )


class VisionBlock(Module):
    """A pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)); x (N, hidden) fp32."""

    def __init__(self, prefix: str, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = rms_norm(f"{prefix}.norm1.weight", config.hidden_size)
        self.norm2 = rms_norm(f"{prefix}.norm2.weight", config.hidden_size)
        self.attn = VisionAttention(f"{prefix}.attn", config.hidden_size, config.num_heads)
        H, width, mlp = config.hidden_size, config.intermediate_size, f"{prefix}.mlp"
        # gate and up read as one projection (rows stacked): one matmul
        self.gate_up = LinearSlot(
            LinearSource(
                (f"{mlp}.gate_proj", f"{mlp}.up_proj"), ((width, H), (width, H)), bias=True
            )
        )
        self.down = LinearSlot(LinearSource((f"{mlp}.down_proj",), ((H, width),), bias=True))
        self.activation = GATE_ACTIVATIONS[config.hidden_act]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Runs
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        gated = gate_times_up(linear(self.norm2(x), self.gate_up), self.activation)
        return x + linear(gated, self.down)


class PatchMerger(Module):
    """(N, hidden) -> (N / merge^2, out_hidden): RMSNorm, each merge^2 consecutive patches (a
    merged token's) side by side, Linear, GELU, Linear; the merger's `mlp.0` and `mlp.2`."""

    def __init__(self, prefix: str, config: VisionConfig) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = rms_norm(f"{prefix}.ln_q.weight", config.hidden_size)
        self.fc1 = LinearSlot(
            LinearSource((f"{prefix}.mlp.0",), ((self.width, self.width),), bias=True)
        )
        self.fc2 = LinearSlot(
            LinearSource((f"{prefix}.mlp.2",), ((config.out_hidden_size, self.width),), bias=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.ln_q(x).reshape(-1, self.width)  # (N, hidden) -> (N / M^2, M^2 hidden)
        return linear(F.gelu(linear(merged, self.fc1)), self.fc2)  # exact (erf) GELU


class Qwen2_5_VisionEncoder(Module, Placed):
    """Qwen2.5-VL's vision tower, built empty from its config: `qinfer.weights.load.load`
    fills it from a checkpoint (`qinfer.vision.load_vision_encoder`), `init_random` at random.

    forward(patches (N, C * T * P * P), grids) -> (N / merge^2, out_hidden_size) fp32: one
    embedding per merged token, the images' tokens one after the other in patch order.
    """

    def __init__(self, config: VisionConfig, prefix: str = "visual") -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(
            f"{prefix}.patch_embed.proj",
            config.hidden_size,
            config.in_channels,
            config.temporal_patch_size,
            config.patch_size,
            bias=False,
        )
        self.blocks = torch.nn.ModuleList(
            VisionBlock(f"{prefix}.blocks.{i}", config) for i in range(config.depth)
        )
        self.merger = PatchMerger(f"{prefix}.merger", config)
        self.place(SINGLE, torch.float32, torch.device("cpu"))

    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        """Every rank holds the whole tower (it is small); the norms before a matmul write
        the compute dtype; the RoPE frequencies live on `device`."""
        self.device = device
        set_compute_dtype(self, dtype)
        self.inv_freq = axial_frequencies(self.config.head_dim, self.config.rope_theta, device)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        config, unit = self.config, self.config.spatial_merge_size**2
        grids = [tuple(int(n) for n in grid) for grid in grids]
        order, window_bounds = window_order(
            grids, config.spatial_merge_size, config.window_size, config.patch_size
        )
        order = order.to(self.device)
        windows = Runs(window_bounds, self.device)
        frames = Runs(frame_bounds(grids), self.device)  # the order keeps frames whole

        x = self.patch_embed(patches.to(self.device)).float()  # (N, hidden), the residual
        N = x.shape[0]
        cos, sin = axial_rotation(grids, config.spatial_merge_size, self.inv_freq)  # (N, 1, D/2)

        def by_window(t: torch.Tensor) -> torch.Tensor:
            # (N, ...) -> (N / M^2, M^2, ...) tokens, reordered, -> (N, ...)
            return t.reshape(N // unit, unit, *t.shape[1:])[order].reshape(t.shape)

        x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        full = set(config.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in full else windows)
        merged = self.merger(x).float()  # (N / M^2, out), window order
        restored = torch.empty_like(merged)
        restored[order] = merged  # back in patch order
        return restored
