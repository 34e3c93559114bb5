"""Rotary position embeddings (RoPE) in the rotate-half layout of Hugging Face checkpoints.

A head vector x of size D is split into halves (x1, x2) = (x[:D/2], x[D/2:]); position p
rotates each pair (x1[i], x2[i]) by the angle p * inv_freq[i]:

    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)

The RoPE types differ only in `inv_freq` (and yarn and longrope in a scale on cos/sin),
computed by `qinfer.rope_scaling.rope_frequencies` once per (rotary dims, settings, context,
device) and shared by all layers. Under partial rotary (`RopeConfig.partial_rotary_factor`)
only a head's first dimensions rotate, in the same layout; the others pass through. A layer
without RoPE (SmolLM3's NoPE layers) has a `NoRoPE`, which leaves q and k as they are. cos/sin are computed for each step's positions only (the same fp32 products a
table would hold, so the same values): a table of every position up to a long context
would cost tens of MB per setting (Gemma 3: 32k positions x 128 frequencies, two settings).
"""

from __future__ import annotations

import functools

import torch

from qinfer.config import RopeConfig, rope_dims
from qinfer.rope_scaling import rope_frequencies


class RoPE:
    """Applies rotary embeddings to (B, L, H, D) queries or keys at given positions.

    max_position_embeddings is the seed's `seq_len`: nothing is tabulated (positions past
    the context are refused by the model, `Transformer`), but LongRoPE picks its factors by
    it. dims is a head's size; `rope.partial_rotary_factor` says how many of them rotate.
    """

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
        self.rotary_dims = rope_dims(dims, rope)
        self.frequencies = _frequencies(
            self.rotary_dims, rope, max_position_embeddings, torch.device(device)
        )

    def __call__(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, L, H, D); offset: an int, a (B,) tensor of each row's first position, or a
        (B, L) tensor of every token's position."""
        return self.apply(x, *self.rotation(offset, x.shape[1], x.dtype))

    def rotation(
        self, offset: int | torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of `length` positions, each (1 or B, length, 1, R/2) in `dtype`, R the
        rotary dims (D unless partial).

        offset: an int or a (B,) tensor of each row's first position, or a (B, length) tensor
        of every token's own position (the engine packs the tokens of several sequences into
        one row). Queries and keys of one step share the result, and so do the layers: the
        frequencies remember the last rotation.

        Positions below 0 (left padding of batched rows) are clamped to 0: those rows are
        masked out of attention, so any finite rotation will do.
        """
        return self.frequencies.rotation(offset, length, dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, L, H, D) rotated by `rotation`'s cos and sin (B, L, 1, R/2): the first R
        dimensions rotate, the other D - R pass through (partial rotary)."""
        rotary = 2 * cos.shape[-1]
        if rotary < x.shape[-1]:  # (B, L, H, R) rotated, (B, L, H, D - R) as it is
            return torch.cat((RoPE.apply(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)  # (B, L, H, D/2) each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class NoRoPE:
    """The RoPE of a layer without rotary embeddings: q and k pass through unchanged (the
    same calls as `RoPE`, so the attention layer never asks which it has)."""

    def __call__(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        return x

    def rotation(self, offset: int | torch.Tensor, length: int, dtype: torch.dtype) -> tuple:
        return (), ()

    @staticmethod
    def apply(x: torch.Tensor, cos: object, sin: object) -> torch.Tensor:
        return x


class _Frequencies:
    """inv_freq (dims/2,) fp32 and the cos/sin scale of one RoPE setting, shared by every
    layer using it.

    Every layer of a forward asks for the same positions: the last rotation is kept, keyed
    by the offset (an int, or the very tensor object the model passes to all its layers).
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float) -> None:
        self.inv_freq, self.scale = inv_freq, scale
        self._last: tuple[object, int, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def rotation(
        self, offset: int | torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        last = self._last
        if last is not None and _same_offset(last[0], offset) and last[1:3] == (length, dtype):
            return last[3], last[4]
        device = self.inv_freq.device
        if isinstance(offset, int):
            positions = torch.arange(offset, offset + length, device=device)[None]  # (1, L)
        else:
            positions = offset.to(device)
            if positions.dim() == 1:  # each row's first position, then the next length - 1
                positions = positions[:, None] + torch.arange(length, device=device)
            positions = positions.clamp(min=0)  # (B, L)
        angles = positions[:, :, None, None].float() * self.inv_freq  # (B, L, 1, D/2)
        cos = (angles.cos() * self.scale).to(dtype)
        sin = (angles.sin() * self.scale).to(dtype)
        self._last = (offset, length, dtype, cos, sin)
        return cos, sin


def _same_offset(a: int | torch.Tensor, b: int | torch.Tensor) -> bool:
    """The same int, or the same tensor object (held by the memo, so never a recycled one)."""
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b)


@functools.lru_cache(maxsize=16)
def _frequencies(dims: int, rope: RopeConfig, context: int, device: torch.device) -> _Frequencies:
    """The frequencies of one setting, shared by every layer with these settings."""
    inv_freq, scale = rope_frequencies(dims, rope, context)
    return _Frequencies(inv_freq.to(device), scale)
