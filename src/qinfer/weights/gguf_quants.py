"""Dequantization of llama.cpp's block formats, vectorised in torch.

A quantized GGUF tensor is a run of blocks; each block packs `block_size` weights into
`type_size` bytes (fp16 scales followed by packed integers). Every dequantizer here takes
the blocks as a uint8 tensor (n_blocks, type_size) and returns fp32 (n_blocks, block_size),
computing in the same order as ggml's `dequantize_row_*`, so the result is bit-exact.

Layouts (bytes, in file order; QK_K = 256):
- Q8_0  (32 weights):  d:f16, q:int8[32]                      w = d * q
- Q4_0  (32 weights):  d:f16, q:u4[32]                        w = d * (q - 8)
- Q4_1  (32 weights):  d:f16, m:f16, q:u4[32]                 w = d * q + m
- Q5_0  (32 weights):  d:f16, qh:u32 (fifth bits), q:u4[32]  w = d * (q - 16)
- Q5_1  (32 weights):  d:f16, m:f16, qh:u32, q:u4[32]        w = d * q + m
- Q2_K  (256 weights): scales:(u4 scale, u4 min)[16], q:u2[256], d, dmin:f16
                       16 sub-blocks of 16: w = d * sc[j] * q - dmin * m[j]
- Q3_K  (256 weights): hmask:u1[256], q:u2[256], scales:u6x16 (12 bytes), d:f16
                       16 sub-blocks of 16: w = d * (sc[j] - 32) * (q - 4 * !hbit)
- Q4_K  (256 weights): d, dmin:f16, scales:u6x8 + mins:u6x8 (12 bytes), q:u4[256]
                       8 sub-blocks of 32: w = d * sc[j] * q - dmin * m[j]
- Q5_K  (256 weights): as Q4_K plus qh:u1[256] (32 bytes) holding each q's fifth bit
- Q6_K  (256 weights): ql:u4[256], qh:u2[256], scales:int8[16], d:f16
                       16 sub-blocks of 16: w = d * scale[j] * (q - 32)
Packed 4-bit values: byte i holds value i in its low nibble and value i + width in its
high nibble, where width is 16 (Q4_0/Q4_1) or 32 (the K formats, per 64 values).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qinfer.linear import Int4Groups, Int8Blocks

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) fp32: one little-endian fp16 per row."""
    return raw.contiguous().view(torch.float16).float()


def _unpack(packed: torch.Tensor, width: int, bits: int) -> torch.Tensor:
    """Split bytes into `bits`-bit fields, lowest bits first.

    packed (n, G * width) -> (n, G * 8 // bits, width): each run of `width` bytes yields
    8 // bits runs of `width` values, the first from the lowest bits of every byte.
    """
    n = packed.shape[0]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    fields = packed.reshape(n, -1, 1, width) >> shifts.reshape(1, 1, -1, 1)  # (n, G, 8/bits, width)
    return (fields & ((1 << bits) - 1)).reshape(n, -1, width)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K block: (n, 12) uint8 -> 2 x (n, 8) fp32.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7
    take their low 4 bits from bytes 8-11 and their top 2 bits from the spare bits of 0-7.
    """
    n = packed.shape[0]
    low_scales, low_mins, high = packed.reshape(n, 3, 4).unbind(1)  # 3 x (n, 4)
    scales = torch.cat([low_scales & 63, (high & 15) | ((low_scales >> 2) & 48)], dim=-1)
    mins = torch.cat([low_mins & 63, (high >> 4) | ((low_mins >> 2) & 48)], dim=-1)
    return scales.float(), mins.float()


def int8_blocks_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = d * q: q (n, 32) int8, d (n, 1)."""
    return blocks[:, 2:].contiguous().view(torch.int8), _f16(blocks[:, :2])


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q, d = int8_blocks_q8_0(blocks)
    return q.float() * d


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    q = _unpack(blocks[:, 2:], 16, 4).reshape(n, 32).to(torch.int8) - 8
    return d * q.float()


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _unpack(blocks[:, 4:], 16, 4).reshape(n, 32).float()
    return d * q + m


def _fifth_bits(packed: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8, one little-endian uint32 whose bit i belongs to value i -> (n, 32)."""
    n = packed.shape[0]
    return _unpack(packed, 4, 1).transpose(1, 2).reshape(n, 32)  # (n, bit, byte) -> value order


def int8_blocks_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = d * (q - 16): q - 16 (n, 32) int8 in -16..15, d (n, 1)."""
    n = blocks.shape[0]
    low = _unpack(blocks[:, 6:], 16, 4).reshape(n, 32)
    q = (low | (_fifth_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return q, _f16(blocks[:, :2])


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q, d = int8_blocks_q5_0(blocks)
    return d * q.float()


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    low = _unpack(blocks[:, 8:], 16, 4).reshape(n, 32)
    q = (low | (_fifth_bits(blocks[:, 4:8]) << 4)).float()
    return d * q + m


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]  # low nibble: scale, high nibble: min, of 16 sub-blocks of 16
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    q = _unpack(blocks[:, 16:80], 32, 2).reshape(n, 16, 16).float()
    scale = (d * (scales & 15).float())[..., None]  # (n, 16, 1)
    offset = (dmin * (scales >> 4).float())[..., None]
    return (scale * q - offset).reshape(n, QK_K)


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # 16 6-bit scales: low 4 bits from bytes 96-103 (two per byte), top 2 from 104-107.
    low = _unpack(blocks[:, 96:104], 8, 4).reshape(n, 16)
    high = _unpack(blocks[:, 104:108], 4, 2).reshape(n, 16)
    scales = (((low & 15) | ((high & 3) << 4)).to(torch.int8) - 32).float()
    d = _f16(blocks[:, 108:110])
    q_low = _unpack(blocks[:, 32:96], 32, 2).reshape(n, 16, 16)
    # The third bit comes from hmask; a set bit means no -4 offset.
    q_high = (_unpack(blocks[:, :32], 32, 1).reshape(n, 16, 16)) ^ 1
    q = (q_low.to(torch.int8) - (q_high << 2).to(torch.int8)).float()
    return ((d * scales)[..., None] * q).reshape(n, QK_K)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _unpack(blocks[:, 16:], 32, 4).float()  # (n, 8, 32)
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(n, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    high_bit = _unpack(blocks[:, 16:48], 32, 1)  # (n, 8, 32)
    q = (_unpack(blocks[:, 48:], 32, 4) | (high_bit << 4)).float()  # (n, 8, 32)
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(n, QK_K)


def int8_blocks_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sub-block j of 16: w = (d * scale[j]) * (q - 32): q - 32 (n, 256) int8 in -32..31,
    the sub-scales (n, 16) int8 and d (n, 1) fp16 as stored (`Int8Blocks.super_scales`)."""
    n = blocks.shape[0]
    low = _unpack(blocks[:, :128], 64, 4).reshape(n, 8, 32)
    high = _unpack(blocks[:, 128:192], 32, 2)  # (n, 8, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)  # (n, 16)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K)
    return q, scales, blocks[:, 208:210].contiguous().view(torch.float16)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    return Int8Blocks(*int8_blocks_q6_k(blocks)).dequantize()  # (n, 256), exact


def int4_groups_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w = d * (q - 8): scale d, zero 0."""
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    q = _unpack(blocks[:, 2:], 16, 4).reshape(n, 32)
    return q, d, torch.zeros_like(d)


def int4_groups_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w = d * q + m = (q - 8) * d + (m + 8d)."""
    n = blocks.shape[0]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _unpack(blocks[:, 4:], 16, 4).reshape(n, 32)
    return q, d, m + 8 * d


def int4_groups_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sub-block j: w = (d sc_j) q - dmin m_j = (q - 8) * (d sc_j) + (8 d sc_j - dmin m_j)."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _unpack(blocks[:, 16:], 32, 4).reshape(n, QK_K)
    scale = d * scales  # (n, 8)
    return q, scale, 8 * scale - dmin * mins


Q = GGMLQuantizationType
BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: dequantize_q8_0,
    Q.Q4_0: dequantize_q4_0,
    Q.Q4_1: dequantize_q4_1,
    Q.Q5_0: dequantize_q5_0,
    Q.Q5_1: dequantize_q5_1,
    Q.Q2_K: dequantize_q2_k,
    Q.Q3_K: dequantize_q3_k,
    Q.Q4_K: dequantize_q4_k,
    Q.Q5_K: dequantize_q5_k,
    Q.Q6_K: dequantize_q6_k,
}
#: Block types that are int4 groups of 32 exactly: (q, scale, zero) per block.
INT4_GROUPS: dict[GGMLQuantizationType, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    Q.Q4_0: int4_groups_q4_0,
    Q.Q4_1: int4_groups_q4_1,
    Q.Q4_K: int4_groups_q4_k,
}
#: Block types whose values are int8 with one scale per block: (q, scales) per block, Q6_K's
#: (q, sub-scales, super-scale).
INT8_BLOCKS: dict[GGMLQuantizationType, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    Q.Q8_0: int8_blocks_q8_0,
    Q.Q5_0: int8_blocks_q5_0,
    Q.Q6_K: int8_blocks_q6_k,
}
FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED_TYPES = tuple(FLOAT_TYPES) + tuple(BLOCK_DEQUANTIZERS)


def _blocks(data: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A tensor's stored data as a torch tensor on `device` (a read-only map is copied)."""
    if not data.flags.writeable:
        data = data.copy()
    return torch.from_numpy(data).to(device)


def dequantize(
    data: np.ndarray, qtype: GGMLQuantizationType, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A GGUF tensor's stored data, as the `gguf` reader maps it, -> fp32 on `device`.

    data: F32/F16 as their numpy dtype; BF16 and block types as uint8 (..., row_bytes),
    each row holding whole blocks. Returns (..., row_weights) fp32. `qtype` must be one of
    SUPPORTED_TYPES.
    """
    raw = _blocks(data, device)
    if qtype in FLOAT_TYPES:
        # bf16 arrives as bytes (numpy has no bfloat16); view two of them as one value.
        return raw.view(FLOAT_TYPES[qtype]).float()
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    *rows, row_bytes = raw.shape
    blocks = raw.reshape(-1, type_size)  # (n_blocks, type_size)
    weights = BLOCK_DEQUANTIZERS[qtype](blocks)  # (n_blocks, block_size)
    return weights.reshape(*rows, row_bytes // type_size * block_size)


def int4_groups(
    data: np.ndarray, qtype: GGMLQuantizationType, device: torch.device | str = "cpu"
) -> Int4Groups:
    """A 2-D Q4_0 / Q4_1 / Q4_K tensor (rows, row_bytes) as int4 groups of 32, with no
    rounding: `Int4Groups.dequantize()` equals `dequantize(data, qtype)` bit for bit
    wherever the zero (m + 8d, 8 d sc - dmin m) is exact in fp32, which fp16 inputs of
    comparable size always are."""
    return Int4Groups(*_fields(data, qtype, INT4_GROUPS[qtype], device))


def int8_blocks(
    data: np.ndarray, qtype: GGMLQuantizationType, device: torch.device | str = "cpu"
) -> Int8Blocks:
    """A 2-D Q8_0 / Q5_0 / Q6_K tensor (rows, row_bytes) as int8 blocks (of 32, or 16 for
    Q6_K with its scales as stored), with no rounding: `Int8Blocks.dequantize()` equals
    `dequantize(data, qtype)` bit for bit."""
    return Int8Blocks(*_fields(data, qtype, INT8_BLOCKS[qtype], device))


#: Bytes of a tensor's data converted at a time: a conversion's temporaries are several times
#: its input, and for a whole 248,320-row Q6_K table they added ~0.7 GB to a load's peak.
CONVERT_BYTES = 16 << 20


def _fields(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    convert: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    device: torch.device | str,
) -> tuple[torch.Tensor, ...]:
    """convert's fields of a 2-D block tensor (rows, row_bytes), each (rows, -1): rows of
    CONVERT_BYTES at a time (copied from a read-only map that much at a time too), into
    tensors made at the first."""
    rows, row_bytes = data.shape
    _, type_size = GGML_QUANT_SIZES[qtype]
    step = max(1, CONVERT_BYTES // max(1, row_bytes))
    out: list[torch.Tensor] = []
    for start in range(0, max(rows, 1), step):
        raw = _blocks(data[start : start + step], device)
        fields = [f.reshape(raw.shape[0], -1) for f in convert(raw.reshape(-1, type_size))]
        if step >= rows:
            return tuple(fields)
        if not out:
            out = [torch.empty(rows, f.shape[1], dtype=f.dtype, device=f.device) for f in fields]
        for whole, part in zip(out, fields, strict=True):
            whole[start : start + step] = part
    return tuple(out)
