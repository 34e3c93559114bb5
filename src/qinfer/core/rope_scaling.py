"""The inverse frequencies of each RoPE type, from a RopeConfig.

The RoPE layer computes cos/sin from them (`layers/rope.py`); the GGUF reader uses them to
recognise the llama3 scaling a file stores as per-frequency divisors. Kept apart from the
layer so that reading weights does not depend on the layers.
"""

from __future__ import annotations

import math

import torch

from qinfer.core.model_config import RopeConfig


def rope_frequencies(
    dims: int, rope: RopeConfig, context: int | None = None
) -> tuple[torch.Tensor, float]:
    """inv_freq (dims/2,) in fp32 and the factor that scales cos/sin, for one RoPE type.

    dims: the dimensions that rotate (a head's, or its first part under partial rotary).
    context: the positions the model serves (longrope picks its factors by it; None: the
    original context).

    - default: theta^(-2i/dims)
    - linear: positions interpolated by `factor` (inv_freq / factor)
    - dynamic: NTK-aware; equal to default for positions within max_position_embeddings,
      the only positions this engine serves
    - llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between
    - yarn: per-dimension blend of interpolation and extrapolation, cos/sin scaled by
      the attention factor 0.1 * ln(factor) + 1 (or as configured)
    - longrope (Phi-3): default frequencies each divided by its own factor, `long_factor`
      for a context past `original_max_position_embeddings`, else `short_factor`; cos/sin
      scaled by sqrt(1 + ln(factor) / ln(original context)) (or as configured)
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
    if rope.type == "longrope":
        return _longrope(inv_freq, rope, context)
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


def _longrope(
    inv_freq: torch.Tensor, rope: RopeConfig, context: int | None
) -> tuple[torch.Tensor, float]:
    """LongRoPE's frequencies for a model serving `context` positions.

    transformers switches a sequence from the short to the long factors once it grows past
    the original context (and then recomputes its whole cache); the factors here are fixed
    by the context the model serves instead, as llama.cpp fixes them by its context size,
    so that a cache stays valid as a sequence grows. Sequences past the original context
    get transformers' rotations; shorter ones, on a model whose context is longer, the long
    factors where transformers would take the short ones.
    """
    original = rope.original_max_position_embeddings
    long = context is not None and original is not None and context > original
    factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(
            f"longrope has {len(factors)} factors for {len(inv_freq)} rotary frequencies"
        )
    scale = rope.attention_factor
    if scale is None:
        scale = (
            1.0 if rope.factor <= 1 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
        )
    return inv_freq / factors, float(scale)
