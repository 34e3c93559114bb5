"""int4 weights in groups: W = (q - 8) * scale + zero, one (scale, zero) per `group_size`
consecutive input columns of each row (torch's "tinygemm" convention).

This is exactly llama.cpp's Q4_0 (zero 0), Q4_1 (w = d q + m: scale d, zero m + 8d) and
Q4_K (sub-blocks of 32 with their own scale and min) when the group is 32, so GGUF files
keep their bits (`qinfer.weights.gguf_quants.int4_groups`). The kernels multiply in one
fused step, (q - 8) * scale + zero rounded once, the value ggml's dequantization gives.

Kernels: `aten._weight_int4pack_mm_for_cpu` (rows a multiple of 16, groups of 32, 64, 128
or 256; fast only with bf16 activations) and `aten._weight_int4pack_mm` on CUDA (bf16).
Groups of 32 on a CPU where qinfer's kernels build take `Int4BlockLinear` instead (fp32
scales, the exact weight: `qinfer.linear.int4_blocks`).
Weights with a row count that is not a multiple of 16 are padded with zero rows. On CPU the
tile paths (`qinfer.linear.paths`) read the nibbles back out of the kernel's own packed
layout (`_unpack_cpu`), so a weight is held once, packed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qinfer import kernels
from qinfer.core.errors import WeightsError
from qinfer.linear.paths import QuantizedLinear, scratch

#: Group sizes torch's int4 kernels accept.
GROUP_SIZES = (32, 64, 128, 256)
_ROW_MULTIPLE = 16  # the CPU packing takes rows in tiles of 16


@dataclass
class Int4Groups:
    """A weight as int4 groups: q (N, K) uint8 in 0..15, scales and zeros (N, K / group) fp32."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def columns(self, start: int, stop: int) -> Int4Groups:
        """Input columns start:stop, which begin and end on group boundaries."""
        g = self.group_size
        return Int4Groups(
            self.q[:, start:stop],
            self.scales[:, start // g : stop // g],
            self.zeros[:, start // g : stop // g],
        )

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32, rounded once as the kernels' fused multiply-add rounds."""
        g = self.group_size
        scales = self.scales.double().repeat_interleave(g, dim=1)
        zeros = self.zeros.double().repeat_interleave(g, dim=1)
        return ((self.q.double() - 8) * scales + zeros).float()


def int4_kernel_supports(shape: tuple[int, int], group_size: int) -> str | None:
    """Why an (out, in) weight cannot take int4 groups of group_size, or None if it can."""
    if group_size not in GROUP_SIZES:
        return (
            f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}"
        )
    if shape[1] % group_size:
        return f"int4 group size {group_size} does not divide its {shape[1]} input features"
    return None


def quantize_int4(weight: torch.Tensor, group_size: int, name: str = "weight") -> Int4Groups:
    """Asymmetric int4 per group: the group's min maps to q = 0 and its max to q = 15. The
    scale and the min are rounded to fp16 first, as llama.cpp's Q4_1 stores them, and q is
    rounded against those: the kernels hold them in 2 bytes each (`kernels.fp16_if_exact`)
    and multiply the very weight that was stored."""
    reason = int4_kernel_supports(tuple(weight.shape), group_size)
    if reason is not None:
        raise WeightsError(f"cannot quantize {name}: {reason}")
    N, K = weight.shape
    w = weight.float().reshape(N, K // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # (N, groups)
    # the smallest fp16 (subnormal) step, so that a constant group's scale stays nonzero
    scales = _fp16_rounded(((high - low) / 15).clamp(min=2.0**-24))
    low = _fp16_rounded(low)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15)
    # w ~= q * scale + low = (q - 8) * scale + (low + 8 * scale)
    return Int4Groups(q.to(torch.uint8).reshape(N, K), scales, low + 8 * scales)


def _fp16_rounded(t: torch.Tensor) -> torch.Tensor:
    """t (fp32) rounded to fp16's values, where they reach (past fp16's range, as it is)."""
    return torch.where(t.abs() <= torch.finfo(torch.float16).max, t.half().float(), t)


class Int4Linear(QuantizedLinear):
    """A packed int4 weight with its (K / group, N, 2) scales and zeros, bias (N,) or None."""

    _tile_multiple = 64  # whole blocks of the CPU layout (64 or 32 rows)

    def __init__(self, stored: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        q, scales, zeros = stored.q, stored.scales, stored.zeros
        self.out_features, self.in_features = q.shape
        self.group_size = stored.group_size
        padding = -self.out_features % _ROW_MULTIPLE
        if padding:  # zero rows: q = 8, scale = zero = 0
            q = torch.cat([q, q.new_full((padding, q.shape[1]), 8)])
            scales = torch.cat([scales, scales.new_zeros(padding, scales.shape[1])])
            zeros = torch.cat([zeros, zeros.new_zeros(padding, zeros.shape[1])])
        self._padded = bool(padding)
        # (N, groups) x 2 -> (groups, N, 2), the kernels' layout
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype))
        self.register_buffer("packed", _pack(q))
        self.register_buffer("bias", bias)
        self._init_paths()

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def shape_key(self) -> tuple:
        return (self.out_features, self.in_features, self.group_size)

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N) without the bias."""
        # torch's own bindings of the aten ops: `torch.ops.aten.*` adds a Python call to
        # each, 120 calls a SmolLM2 step (docs/BENCHMARKS.md, "Kernel bindings")
        if flat.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group_size, self.scales_and_zeros
            )
        else:
            y = torch._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        return y[:, : self.out_features] if self._padded else y

    def _tiles_supported(self) -> bool:
        return self.device.type == "cpu" and _cpu_block_rows() is not None

    def _dot_supported(self) -> bool:
        """The weight can be read back (the CPU layout) in groups of the kernel's block."""
        return self._tiles_supported() and self.group_size == kernels.BLOCK

    def _dot_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`kernels.int4_mm` on a copy of the weight in its layout (the same q, scales and
        zeros as torch's kernel multiplies, read back)."""
        return functools.partial(kernels.int4_mm, packed=kernels.pack_int4(self.groups()))

    def groups(self) -> Int4Groups:
        """The weight as `Int4Groups` (q read back out of the CPU packed layout, scales and
        zeros in fp32 from the kernel's compute-dtype copies)."""
        n, k = self.out_features, self.in_features
        q = torch.empty(k, len(self.packed))
        _unpack_cpu(self.packed, 0, len(self.packed), _cpu_block_rows(), q)
        sz = self.scales_and_zeros[:, :n].float()  # (groups, N, 2)
        return Int4Groups(
            q.T[:n].to(torch.uint8).contiguous(),
            sz[..., 0].T.contiguous(),
            sz[..., 1].T.contiguous(),
        )

    def _dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """(q - 8) * scale + zero in fp32 (then rounded once to bf16), built transposed:
        (K, rows), the packed layout's own order, read by the GEMM as (rows, K)."""
        block = _cpu_block_rows()
        end = min(-(-stop // block) * block, len(self.packed))  # whole blocks (or the tail)
        k, rows = self.in_features, end - start
        w = scratch(k * rows, torch.float32, self.packed.device).view(k, rows)
        _unpack_cpu(self.packed, start, end, block, w)
        sz = self.scales_and_zeros[:, start:end].float()  # (groups, rows, 2)
        scales, zeros = (sz[..., i].contiguous()[:, None] for i in (0, 1))  # (groups, 1, rows)
        w.view(-1, self.group_size, rows).sub_(8).mul_(scales).add_(zeros)
        if dtype != torch.float32:
            w = scratch(k * rows, dtype, w.device).view(k, rows).copy_(w)
        return w.T[: stop - start]

    def has_rows(self) -> bool:
        return self._tiles_supported()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., K) fp32: rows `ids` read out of the CPU packed layout, (q - 8) * scale +
        zero in fp32 as `_dequantize_rows` computes them."""
        if not self.has_rows():
            return super().rows(ids)
        flat = ids.reshape(-1)
        k = torch.arange(self.in_features, device=flat.device)
        q = _gather_cpu(self.packed, flat, k, _cpu_block_rows()).float()  # (R, K)
        q = q.view(len(flat), -1, self.group_size)  # (R, groups, group)
        # only the rows' own scales and zeros: (groups, N, 2) -> (R, groups, 2)
        sz = self.scales_and_zeros[:, flat].float().transpose(0, 1)
        w = (q - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """Run the kernel on the identity: (K, K) @ W^T gives W^T, as the kernel computes it."""
        dtype, device = self.scales_and_zeros.dtype, self.packed.device
        return self._kernel(torch.eye(self.in_features, dtype=dtype, device=device)).float().T

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes + self._bias_nbytes()


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) uint8 values 0..15 -> the device kernel's packed layout."""
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    # CUDA: two values per byte, even columns in the high nibble; K tiles of 16 * inner_k_tiles.
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (N, K / 2)
    inner_k_tiles = next(t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)


@functools.cache
def _cpu_block_rows() -> int | None:
    """Rows per block of the CPU kernel's packed layout on this CPU (64 with AVX512, 32
    otherwise), found by packing random probes and reading them back with `_unpack_cpu`;
    None if neither reads them back (another torch's layout: the tile paths are then off)."""
    generator = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 16, shape, generator=generator) for shape in ((176, 64), (80, 96))]
    for block in (64, 32):
        if all(_reads_back(q, block, start) for q in probes for start in (0, block)):
            return block
    return None


def _reads_back(q: torch.Tensor, block: int, start: int) -> bool:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
    out = torch.empty(q.shape[1], len(q) - start)
    _unpack_cpu(packed, start, len(q), block, out)
    return torch.equal(out.T, q[start:].float())


def _gather_cpu(
    packed: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, block: int
) -> torch.Tensor:
    """q (R, K) 0..15 of rows `ids` (R,) of the CPU packed layout, at columns `k` (K,):
    `_unpack_cpu`'s layout read one nibble at a time."""
    rows, half = packed.shape
    full = rows // block * block  # rows in whole blocks; the tail stores row pairs
    in_block = ids % block
    tail = ids >= full
    # the byte of (row, column 0), and the bytes between two columns of one row
    base = torch.where(tail, full * half + (ids - full) // 2, ids // block * block * half)
    base = base + torch.where(tail, 0, in_block % (block // 2))
    stride = torch.where(tail, (rows - full) // 2, block // 2)
    high = torch.where(tail, (ids - full) % 2 == 1, in_block >= block // 2)
    data = packed.view(-1)[base[:, None] + stride[:, None] * k]  # (R, K)
    return torch.where(high[:, None], data >> 4, data & 15)


def _unpack_cpu(packed: torch.Tensor, start: int, stop: int, block: int, out: torch.Tensor) -> None:
    """Rows start:stop of the CPU packed layout into out (K, stop - start) as 0..15; start
    is a multiple of `block`, stop too or the padded row count.

    The layout (torch's `_convert_weight_to_int4pack_for_cpu`): rows in blocks of `block`,
    each block stored column by column, block / 2 bytes per column, the low nibbles holding
    the block's first half of rows and the high nibbles its second half; a last block of
    fewer rows (16, 32 or 48) stores row pairs (2j low, 2j + 1 high) instead.
    """
    rows, half = packed.shape  # padded rows, K / 2
    k = 2 * half
    data = packed.view(-1)
    full = min(stop, rows // block * block)  # end of the whole blocks in start:stop
    if start < full:
        b = data[start * half : full * half].view(-1, k, block // 2)  # (blocks, K, block/2)
        halves = out[:, : full - start].view(k, -1, 2, block // 2)  # (K, blocks, 2, block/2)
        halves[:, :, 0].copy_((b & 15).transpose(0, 1))
        halves[:, :, 1].copy_((b >> 4).transpose(0, 1))
    if stop > full:
        b = data[full * half : stop * half].view(k, -1)  # (K, tail/2)
        pairs = out[:, full - start :].view(k, -1, 2)  # (K, tail/2, 2)
        pairs[..., 0].copy_(b & 15)
        pairs[..., 1].copy_(b >> 4)
