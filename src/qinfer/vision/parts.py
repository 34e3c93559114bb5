"""The pieces Qwen's vision towers share: the patch embedding, norms, the attention layer
and its 2-D rotary embedding.

2-D RoPE: a head of D dimensions rotates its first half by the patch's row and its second
half by its column, each half as D/4 pairs of the frequencies theta^(-4i/D) (a RoPE over D/2
dimensions), in the rotate-half layout of `qinfer.layers.rope`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import RopeConfig
from qinfer.core.module import Module
from qinfer.core.rope_scaling import rope_frequencies
from qinfer.layers.norm import RMSNorm
from qinfer.layers.rope import RoPE
from qinfer.linear import linear
from qinfer.vision.attention import Runs
from qinfer.vision.grid import Grid, patch_positions
from qinfer.weights.base import Weights
from qinfer.weights.slots import LinearSlot, LinearSource, TensorSlot

#: The vision norms' epsilon (fixed in the architectures, not in the configs).
NORM_EPS = 1e-6
#: The attention's projections, in the order a fused `qkv` tensor stacks their rows.
QKV_PARTS = ("q", "k", "v")


def vision_section(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `vision_config` object of a config.json dict."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError("config field 'vision_config' must be an object")
    return vision


def positive(vision: dict[str, Any], key: str, default: int | None = None) -> int:
    """vision_config's integer `key` (default when absent), which must be positive."""
    value = vision.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config field 'vision_config.{key}' must be a positive integer")
    return value


def layer_indexes(
    vision: dict[str, Any], key: str, default: Sequence[int], depth: int
) -> tuple[int, ...]:
    """vision_config's list of block indexes `key`, each within 0 .. depth - 1."""
    value = vision.get(key, default)
    if not isinstance(value, list | tuple) or not all(isinstance(i, int) for i in value):
        raise ConfigError(f"config field 'vision_config.{key}' must be a list of integers")
    if any(not 0 <= i < depth for i in value):
        raise ConfigError(
            f"config field 'vision_config.{key}' names a block outside 0..{depth - 1}"
        )
    return tuple(value)


def rope_theta(vision: dict[str, Any], hidden_size: int, num_heads: int) -> float:
    """The 2-D RoPE's theta (`rope_parameters.rope_theta`, default 10000), once the heads are
    known to split into a row half and a column half of pairs."""
    if hidden_size % (num_heads * 4):
        raise ConfigError(
            "config field 'vision_config.hidden_size' must divide into num_heads heads of a "
            "multiple of 4 dimensions (2-D RoPE)"
        )
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(
            "config field 'vision_config.rope_parameters.rope_theta' must be positive"
        )
    return float(theta)


class Stored(Module, TensorSlot):
    """One checkpoint tensor a layer uses as it is (a bias, a position table): `.value`."""

    def __init__(self, source: str, shape: tuple[int, ...], initial: float = 0.0) -> None:
        super().__init__()
        self.source, self.shape, self.initial = source, shape, initial
        self.register_buffer("value", torch.empty(shape, device="meta"))

    def fill(self, tensor: torch.Tensor) -> None:
        self.register_buffer("value", tensor)


class PatchEmbed(Module, TensorSlot):
    """(N, C * T * P * P) patches -> (N, hidden): the checkpoint's Conv3d, whose kernel
    (T, P, P) equals its stride, as one matmul against its weight flattened as
    `image.patchify` flattens a patch ((C, T, P, P)); `{prefix}.weight`, `.bias` if any."""

    def __init__(
        self, prefix: str, hidden: int, channels: int, frames: int, patch: int, bias: bool
    ) -> None:
        super().__init__()
        self.source, self.initial = f"{prefix}.weight", 0.0
        self.shape = (hidden, channels, frames, patch, patch)
        self.register_buffer(
            "weight", torch.empty(hidden, channels * frames * patch**2, device="meta")
        )
        self.bias = Stored(f"{prefix}.bias", (hidden,)) if bias else None

    def fill(self, tensor: torch.Tensor) -> None:
        # (hidden, C, T, P, P) -> (hidden, C * T * P * P)
        self.register_buffer("weight", tensor.reshape(self.shape[0], -1))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.value
        return F.linear(patches.to(self.weight.dtype), self.weight, bias)


def split_qkv(weights: Weights, prefix: str, depth: int, hidden: int) -> None:
    """Name the q, k and v rows of every block's fused `{prefix}.blocks.{i}.attn.qkv` (a
    checkpoint's layout) as the parts `VisionAttention` reads."""
    for i in range(depth):
        attn = f"{prefix}.blocks.{i}.attn"
        weights.split_fused(f"{attn}.qkv", [(f"{attn}.{part}", hidden) for part in QKV_PARTS])


def rms_norm(name: str, dims: int) -> RMSNorm:
    """An empty RMSNorm of `dims` that loads tensor `name`."""
    return RMSNorm(dims, torch.empty(dims, device="meta"), NORM_EPS, source=name)


class LayerNorm(Module):
    """LayerNorm with weight and bias (`{prefix}.weight`, `.bias`), statistics in fp32;
    writes `out_dtype` (None: its input's), as `RMSNorm` does."""

    def __init__(self, prefix: str, dims: int) -> None:
        super().__init__()
        self.dims, self.out_dtype = dims, None
        self.weight = Stored(f"{prefix}.weight", (dims,), initial=1.0)
        self.bias = Stored(f"{prefix}.bias", (dims,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.value.float(), self.bias.value.float()
        normed = F.layer_norm(x.float(), (self.dims,), weight, bias, NORM_EPS)
        return normed.to(self.out_dtype or x.dtype)


def set_compute_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every norm of `module` writes `dtype`, the dtype of the matmuls that follow it."""
    for norm in module.modules():
        if isinstance(norm, RMSNorm | LayerNorm):
            norm.out_dtype = dtype


def axial_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """(D/4,) fp32: the 2-D RoPE's frequencies, a RoPE over half a head's dimensions."""
    return rope_frequencies(head_dim // 2, RopeConfig(theta=theta))[0].to(device)


def axial_rotation(
    grids: Sequence[Grid], merge_size: int, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (N, 1, D/2) fp32 of every patch: the row's angles, then the column's."""
    positions = patch_positions(grids, merge_size).to(inv_freq.device)  # (N, 2)
    angles = positions[..., None].float() * inv_freq  # (N, 2, D/4)
    angles = angles.reshape(len(positions), 1, -1)  # (N, 1, D/2): row half, column half
    return angles.cos(), angles.sin()


class VisionAttention(Module):
    """(N, hidden) -> (N, hidden): q/k/v with bias (`{prefix}.q`, `.k`, `.v`, read as one
    projection; a checkpoint that fuses them, `{prefix}.qkv`, names its parts with
    `split_qkv`), 2-D RoPE on q and k, attention within runs (`Runs`: windows or frames),
    output projection with bias (`{prefix}.proj`)."""

    def __init__(self, prefix: str, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.scale = self.head_dim**-0.5
        names = tuple(f"{prefix}.{part}" for part in QKV_PARTS)
        self.qkv = LinearSlot(LinearSource(names, ((hidden, hidden),) * 3, bias=True))
        self.proj = LinearSlot(LinearSource((f"{prefix}.proj",), ((hidden, hidden),), bias=True))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Runs
    ) -> torch.Tensor:
        """x (N, hidden) in the compute dtype; cos, sin (N, 1, D/2) fp32."""
        N, Hd, D = x.shape[0], self.num_heads, self.head_dim
        heads = linear(x, self.qkv).reshape(N, 3 * Hd, D)  # q's heads, k's, then v's
        # RoPE on q's and k's heads at once, in fp32 (transformers rotates in fp32 too)
        qk = RoPE.apply(heads[:, : 2 * Hd].float(), cos, sin).to(x.dtype)
        out = runs.attend(qk[:, :Hd], qk[:, Hd:], heads[:, 2 * Hd :], self.scale)  # (N, Hd, D)
        return linear(out.reshape(N, Hd * D), self.proj)
