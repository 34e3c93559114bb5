"""Rotary position embeddings (RoPE) in the rotate-half layout of Hugging Face checkpoints.

A head vector x of size D is split into halves (x1, x2) = (x[:D/2], x[D/2:]); position p
rotates each pair (x1[i], x2[i]) by the angle p * inv_freq[i]:

    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)

The RoPE types differ only in `inv_freq` (and yarn and longrope in a scale on cos/sin),
computed by `qinfer.core.rope_scaling.rope_frequencies` once per (rotary dims, settings, context,
device) and shared by all layers. Under partial rotary (`RopeConfig.partial_rotary_factor`)
only a head's first dimensions rotate, in the same layout; the others pass through. A layer
without RoPE (SmolLM3's NoPE layers) has a `NoRoPE`, which leaves q and k as they are.
cos/sin are computed for each step's positions only (the same fp32 products a table would
hold, so the same values): a table of every position up to a long context would cost tens
of MB per setting (Gemma 3: 32k positions x 128 frequencies, two settings).

M-RoPE (`MRoPE`: Qwen2.5-VL, Qwen3-VL) gives a token three positions (temporal, height,
width: `qinfer.vision.mrope`) and each frequency follows one of them, by
`RopeConfig.mrope_section`: frequency i of the rotary half turns by
positions[axis[i]] * inv_freq[i] (`mrope_axes`). A text token's three positions are equal,
so it rotates as under `RoPE`. `layer_rope` picks a layer's kind from its settings.
"""

from __future__ import annotations

import functools

import torch

from qinfer import kernels
from qinfer.core.forward_batch import row_positions
from qinfer.core.model_config import RopeConfig, rope_dims
from qinfer.core.rope_scaling import rope_frequencies


class RoPE:
    """Applies rotary embeddings to queries or keys at given positions.

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
        """x: (B, L, H, D); offset as `row_positions` takes it (the seed's call)."""
        B, L = x.shape[:2]
        positions = row_positions(offset, B, L, self.frequencies.inv_freq.device)
        return self.apply(x, *self.rotation(positions, x.dtype))

    def rotation(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` (any shape P: (T,) for a flat batch), each (*P, 1, R/2)
        in `dtype`, R the rotary dims (D unless partial), to broadcast over the heads of
        (*P, H, D) queries and keys. A forward computes them once per setting for all its
        layers (`Rotations`).

        Positions below 0 (left padding of batched rows) are clamped to 0: those rows are
        masked out of attention, so any finite rotation will do.
        """
        return self.frequencies.rotation(positions, dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (*P, H, D) rotated by `rotation`'s cos and sin (*P, 1, R/2): the first R
        dimensions rotate, the other D - R pass through (partial rotary). A model's flat
        fp32 heads (T, H, D) on the CPU rotate in one compiled op (`kernels.rope`, the same
        bits) where torch takes eight."""
        if _compiled(x, cos):
            flat = len(x), cos.shape[-1]
            return kernels.rope(x, cos.reshape(flat).contiguous(), sin.reshape(flat).contiguous())
        rotary = 2 * cos.shape[-1]
        if rotary < x.shape[-1]:  # (*P, H, R) rotated, (*P, H, D - R) as it is
            return torch.cat((RoPE.apply(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)  # (*P, H, D/2) each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _compiled(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `RoPE.apply` runs as the compiled op: flat fp32 heads (T, H, D, its last
    dimension contiguous) on the CPU, one
    rotation a token ((T, 1, R/2) fp32), no autograd, and the kernels in use here."""
    if x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad:
        return False
    if x.stride(-1) != 1:
        return False
    if cos.dim() != 3 or cos.shape[:2] != (len(x), 1) or cos.dtype != torch.float32:
        return False
    return kernels.in_use()


class MRoPE(RoPE):
    """Multimodal RoPE: each of the R/2 frequencies turns by one of a token's three
    positions (temporal, height, width), as `rope.mrope_section` assigns them
    (`mrope_axes`). The same calls as `RoPE`; `rotation` takes positions (3, *P), or (T,)
    for tokens whose three positions are equal (text, and every token after a prompt)."""

    def __call__(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """x: (B, L, H, D); offset as `row_positions` takes it, or (3, B, L) positions."""
        B, L = x.shape[:2]
        device = self.frequencies.inv_freq.device
        if isinstance(offset, torch.Tensor) and offset.dim() == 3:
            positions = offset.to(device)
        else:  # text rows: one position in every section, (B, L) -> (3, B, L)
            positions = row_positions(offset, B, L, device).expand(3, B, L)
        return self.apply(x, *self.rotation(positions, x.dtype))


def mrope_axes(half: int, section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """(half,) long: which of the three positions (0 temporal, 1 height, 2 width) each of
    the rotary half's frequencies follows.

    Runs (Qwen2.5-VL, transformers' `Qwen2_5_VLRotaryEmbedding`): the first section[0]
    frequencies follow t, the next section[1] h, the last section[2] w. Interleaved
    (Qwen3-VL, `Qwen3VLTextRotaryEmbedding`): frequency i follows h when i % 3 == 1 and
    i < 3 * section[1], w when i % 3 == 2 and i < 3 * section[2], else t.
    """
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    i = torch.arange(half)
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        axes[(i % 3 == axis) & (i < 3 * section[axis])] = axis
    return axes


def layer_rope(
    dims: int, max_position_embeddings: int, rope: RopeConfig | None, device: torch.device
) -> RoPE | MRoPE | NoRoPE:
    """The RoPE of a layer with these settings: none (`NoRoPE`), M-RoPE where the
    settings have sections (`MRoPE`), else `RoPE`."""
    if rope is None:
        return NoRoPE()
    kind = MRoPE if rope.mrope_section else RoPE
    return kind(dims, max_position_embeddings, rope, device)


class NoRoPE:
    """The RoPE of a layer without rotary embeddings: q and k pass through unchanged (the
    same calls as `RoPE`, so the attention layer never asks which it has)."""

    def __call__(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        return x

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        return (), ()

    @staticmethod
    def apply(x: torch.Tensor, cos: object, sin: object) -> torch.Tensor:
        return x


class _Frequencies:
    """inv_freq (dims/2,) fp32 and the cos/sin scale of one RoPE setting, shared by every
    layer using it; under M-RoPE, `axes` (dims/2,): the position each frequency follows."""

    def __init__(
        self, inv_freq: torch.Tensor, scale: float, axes: torch.Tensor | None = None
    ) -> None:
        self.inv_freq, self.scale, self.axes = inv_freq, scale, axes

    def rotation(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        clamped = positions.to(self.inv_freq.device).clamp(min=0)
        if self.axes is not None and clamped.dim() > 1:  # M-RoPE's (3, *P) positions
            # each frequency at its section's position: (3, *P) -> (D/2, *P) -> (*P, 1, D/2)
            clamped = clamped[self.axes].movedim(0, -1)[..., None, :]
            angles = clamped.float() * self.inv_freq
        else:
            angles = clamped[..., None, None].float() * self.inv_freq  # (*P, 1, D/2)
        cos = (angles.cos() * self.scale).to(dtype)
        sin = (angles.sin() * self.scale).to(dtype)
        return cos, sin


@functools.lru_cache(maxsize=16)
def _frequencies(dims: int, rope: RopeConfig, context: int, device: torch.device) -> _Frequencies:
    """The frequencies of one setting, shared by every layer with these settings."""
    inv_freq, scale = rope_frequencies(dims, rope, context)
    axes = None
    if rope.mrope_section:
        axes = mrope_axes(dims // 2, rope.mrope_section, rope.mrope_interleaved).to(device)
    return _Frequencies(inv_freq.to(device), scale, axes)
