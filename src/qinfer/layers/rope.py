"""Rotary position embeddings (RoPE) in the rotate-half layout of Hugging Face checkpoints.

A head vector x of size D is split into halves (x1, x2) = (x[:D/2], x[D/2:]); position p
rotates each pair (x1[i], x2[i]) by the angle p * inv_freq[i]:

    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)

The RoPE types differ only in `inv_freq` (and yarn in a scale on cos/sin), computed by
`rope_frequencies`. cos/sin are tabulated once per (head_dim, settings, device) for every
position up to max_position_embeddings and shared by all layers.
"""

from __future__ import annotations

import functools
import math

import torch

from qinfer.config import RopeConfig


def rope_frequencies(dims: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """inv_freq (dims/2,) in fp32 and the factor that scales cos/sin, for one RoPE type.

    - default: theta^(-2i/dims)
    - linear: positions interpolated by `factor` (inv_freq / factor)
    - dynamic: NTK-aware; equal to default for positions within max_position_embeddings,
      the only positions this engine serves
    - llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between
    - yarn: per-dimension blend of interpolation and extrapolation, cos/sin scaled by
      the attention factor 0.1 * ln(factor) + 1 (or as configured)
    """
    exponent = torch.arange(0, dims, 2, dtype=torch.int64).float() / dims  # (dims/2,)
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.type == "yarn":
        return _yarn(dims, rope)
    raise ValueError(f"unsupported rope type {rope.type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated, short ones kept as they are.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dims: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(rope.factor, rope.mscale) / mscale(
                rope.factor, rope.mscale_all_dim
            )
        else:
            attention_factor = mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength makes `rotations` turns over the original context.
        original = rope.original_max_position_embeddings
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dims, 2).float() / dims)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * ramp + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RoPE:
    """Applies rotary embeddings to (B, L, H, D) queries or keys at given positions."""

    def __init__(
        self,
        dims: int,
        max_position_embeddings: int,
        rope: RopeConfig | float = 10000.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(rope, (int, float)):  # the seed's RoPE(dims, seq_len, base)
            rope = RopeConfig(theta=float(rope))
        self.dims = dims
        self.max_positions = max_position_embeddings
        self.cos, self.sin = _tables(dims, max_position_embeddings, rope, torch.device(device))

    def __call__(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, L, H, D); offset: an int, or a (B,) tensor of each row's first position."""
        return self.apply(x, *self.rotation(offset, x.shape[1], x.dtype))

    def rotation(
        self, offset: int | torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of `length` positions from `offset` (an int, or a (B,) tensor of each
        row's first position), each (1 or B, length, 1, D/2) in `dtype`. Queries and keys
        of one step share them.

        Positions below 0 (left padding of batched rows) are clamped to 0: those rows are
        masked out of attention, so any finite rotation will do.
        """
        if isinstance(offset, int):
            cos = self.cos[offset : offset + length][None, :, None]  # (1, L, 1, D/2)
            sin = self.sin[offset : offset + length][None, :, None]
        else:
            positions = offset.to(self.cos.device)[:, None] + torch.arange(
                length, device=self.cos.device
            )
            positions = positions.clamp(min=0)  # (B, L)
            cos = self.cos[positions][:, :, None]  # (B, L, 1, D/2)
            sin = self.sin[positions][:, :, None]
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, L, H, D) rotated by `rotation`'s cos and sin."""
        x1, x2 = x.chunk(2, dim=-1)  # (B, L, H, D/2) each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@functools.lru_cache(maxsize=16)
def _tables(
    dims: int, length: int, rope: RopeConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (length, dims/2) in fp32, shared by every layer with these settings."""
    inv_freq, scale = rope_frequencies(dims, rope)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (length, dims/2)
    return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)
