"""The inverse frequencies of each RoPE type, from a RopeConfig.

The RoPE layer tabulates cos/sin from them (`layers/rope.py`); the GGUF reader uses them to
recognise the llama3 scaling a file stores as per-frequency divisors. Kept apart from the
layer so that reading weights does not depend on the layers.
"""

from __future__ import annotations

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
