"""How K/V are stored between steps: as computed, in another float dtype, or quantized.

`Features.kv_cache_dtype` names the storage, `kv_format` turns the name into a `KVFormat`
for a model's compute dtype:

    auto   the model's compute dtype: K/V stored exactly as computed (the default)
    bf16   bfloat16, whatever the compute dtype
    int8   int8, one fp32 scale per (token, head): scale = absmax / 127, round to nearest
    fp8    float8_e4m3fn, one fp32 scale per (token, head): scale = absmax / 448

A quantized vector x (D,) of one token and head is stored as data (D,) and one scale, and
read back as data * scale. Every cache (`qinfer.attention.kv_cache`'s contiguous and rotating ones,
the engine's `KVPool`) quantizes the step's K/V when it writes them and dequantizes only
what attention reads. Bytes per token and KV head: D * 2 for bf16, D + 4 for int8 and fp8
(64-wide heads: 128 against 68).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.features import check_kv_cache_dtype

_TINY = torch.finfo(torch.float32).tiny  # the divisor of an all-zero vector


@dataclass(frozen=True)
class KVFormat:
    """One storage of K/V: elements of `dtype`, and with `qmax` (the largest magnitude a
    quantized element takes) one fp32 scale per vector of the last dimension."""

    dtype: torch.dtype
    qmax: float | None = None  # None: stored as computed, cast to dtype, no scales

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    def element_bytes(self, head_dim: int) -> int:
        """Bytes one token's vector of one head takes: its elements and its scale."""
        size = head_dim * torch.empty((), dtype=self.dtype).element_size()
        return size + (4 if self.quantized else 0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (..., D) -> (data (..., D) in `dtype`, scales (...) fp32, or None unquantized)."""
        if not self.quantized:
            return x.to(self.dtype), None
        x = x.float()
        scales = x.abs().amax(-1) / self.qmax  # (...)
        data = x / scales.clamp_min(_TINY)[..., None]  # within [-qmax, qmax]
        if not self.dtype.is_floating_point:
            data = data.round_()
        return data.to(self.dtype), scales

    def dequantize(
        self, data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """data (..., D) and its scales (...) -> (..., D) in `dtype` (the product in fp32)."""
        if scales is None:
            return data.to(dtype)
        return (data.float() * scales[..., None]).to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) as a cache in this format gives it back: stored, then read."""
        return self.dequantize(*self.quantize(x), x.dtype)


_FORMATS = {
    "bf16": KVFormat(torch.bfloat16),
    "int8": KVFormat(torch.int8, 127.0),
    "fp8": KVFormat(torch.float8_e4m3fn, 448.0),
}


def kv_format(name: str, compute_dtype: torch.dtype) -> KVFormat:
    """The storage `name` asks for, for a model computing in `compute_dtype`."""
    check_kv_cache_dtype(name)
    return KVFormat(compute_dtype) if name == "auto" else _FORMATS[name]


def raw_bytes(data: torch.Tensor) -> torch.Tensor:
    """A quantized buffer viewed as bytes, for the copies torch has no fp8 kernel of
    (index_copy_ on CPU): the same memory, element for element."""
    return data.view(torch.uint8)
