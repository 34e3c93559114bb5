"""qinfer's compiled CPU kernels, the ops' Python wrappers: int4 and int8 weights times int8
activations, int8 blocks and int4 groups times fp32 activations, a block's residual add +
RMSNorm, decode attention over the paged KV pool, RoPE, and the gated delta rule's
two forms (recurrent for decode, chunked for prompts). What each computes, to the bit,
and why: docs/KERNELS.md.

    packed = pack_int4(groups)     # Int4Groups of 32 (q (N, K) 0..15, scales, zeros (N, K/32))
    y = int4_mm(x, packed)         # x (M, K) fp32 or bf16 -> y (M, N) fp32, ~ x @ W.T
    y = int8_mm(x, q, scales)      # int8 q (N, K), scales per row (N,) or per block
                                   #   of 32 or 16 (N, K/B): ~ x @ (q * s).T
    y = int8_blocks_mm(x, q, d)    # int8 q (N, K), scales d (N, K/B), B = 16 or 32:
                                   #   x @ W.T, W = q * d per block (as dequantized), x as it is
                                   # both: d_super= (N, K/256) fp16 with int8 d (N, K/16),
                                   #   Q6_K's scales as stored: block b's is d_super * d[b],
                                   #   and q its 6-bit values, pack_q6(q) (N, 3K/4) uint8
                                   # int8_blocks_mm(..., ids=) (M, k): row r against the
                                   #   weight's rows ids[r] only -> (M, k), the same bits
    ids = top_k_ids(logits, k)     # (R, N) fp32 -> (R, k) int64, each row's k highest
    y = int4_groups_mm(x, packed)  # the packed int4 weight, x fp32 or bf16 as it is:
                                   #   x @ W.T, W = d q + m, per block d (q . x) + m sum(x)
    y = add_rms_norm(h, x, w, eps, dtype)  # h (T, H) fp32 += x (in place; x None: as it is),
                                   #   y = h / sqrt(mean(h^2) + eps) * w in dtype (fp32, bf16)
    y = heads_rms_norm(h, w1, w2, first, eps, dtype)  # QK-norm: h (T, R, D) heads, read
                                   #   only, each normed as above by w1 (first heads) or w2
    out = paged_decode_attention(q, k, v, keys, values, slots, positions, tables, totals,
                                 key_starts, block_size, window, scale)
                                   # one new token per sequence: k, v stored in the pool,
                                   #   q (G, Hq, D) attends its sequence's keys -> (G, Hq, D)
    y = rope(x, cos, sin)          # x (T, H, D) fp32 rotated (rotate-half), torch's bits
    o = causal_attention(q, k, v, scale)  # a prompt's queries (B, Hq, L, D) fp32 over their
                                   #   histories k, v (B, Hkv, S, D), bottom-right causal
    y = silu_mul(x)                # the FFN's gate and up (T, 2W) fp32 -> silu(gate) * up
    lora_add(y, x, rows, slots, a, column_slots, b_t, parts)  # LoRA: each adapter row's
                                   #   (x A_slot^T) B_slot^T added to y in place, per part
    o = gated_delta_recurrent(q, k, v, g, beta, state)  # the gated delta rule token by
                                   #   token: state (B, H, Dk, Dv) fp32 updated in place
    o = gated_delta_chunked(q, k, v, g, beta, state, C)  # the same, C tokens at a time
    y = causal_conv1d(x, taps, windows, slots)  # the DeltaNet's conv + SiLU over x (S, L, C)
                                   #   from each sequence's window, the windows updated
    o = gated_delta_decode(qkv, b, a, taps, windows, A_log, dt_bias, state, slots, Hk)
                                   # a decode token's whole mixer before its norm: conv,
                                   #   L2 norms, gates and the rule, the pools' rows updated

The library is built on first use (`build`: `available()` says why it cannot be, `buildable()`
whether it can be expected to); the paths each op has on this CPU and the one "auto" takes
are `cpu`'s (`paths`, `auto_path`, `norm_paths`, `norm_auto_path`), and `in_use()` says
whether the layers take the kernels (`QINFER_CPU_KERNELS` off: the pure-torch path). The
weights' scales (and int4 offsets m) are fp16 or fp32, widened exactly in the kernels:
`fp16_if_exact` keeps a GGUF's fp16 scales at the file's size, and a symmetric int4 weight
(Q4_0's) holds no m at all (`pack_int4`). The ops' registration with torch (fake kernels
for `torch.compile`, refusals of other devices' tensors) is `registry`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qinfer.kernels.build import available, build_directory, buildable, on_x86, require
from qinfer.kernels.cpu import SWITCH, auto_path, in_use, norm_auto_path, norm_paths, paths
from qinfer.kernels.registry import BLOCK, CONSTANT_MARK, REFUSED_DEVICES, ops, refusal

#: Tokens per chunk of `gated_delta_chunked`: 16, measured fastest at Qwen3.5-0.8B's shapes
#: (8 the same, 24 and 32 slower: docs/BENCHMARKS.md); torch's form wants 32
#: (`deltanet.CHUNK_SIZE`), its matmuls being cheaper per element the longer the chunk.
GATED_DELTA_CHUNK = 16

#: An int4 weight's columns per tile (`PackedInt4`), and the bytes of one block of a tile.
TILE_COLUMNS = 16
TILE_BYTES = TILE_COLUMNS * BLOCK // 2

__all__ = [
    "ACTIVATION_DTYPES",
    "BLOCK",
    "CONSTANT_MARK",
    "GATED_DELTA_CHUNK",
    "REFUSED_DEVICES",
    "SWITCH",
    "Int4Groups",
    "PackedInt4",
    "add_rms_norm",
    "causal_attention",
    "auto_path",
    "available",
    "build_directory",
    "buildable",
    "causal_conv1d",
    "fp16_if_exact",
    "gated_delta_chunked",
    "gated_delta_decode",
    "gated_delta_recurrent",
    "heads_rms_norm",
    "in_use",
    "int4_groups_mm",
    "int4_mm",
    "int8_blocks_mm",
    "top_k_ids",
    "int8_mm",
    "lora_add",
    "norm_auto_path",
    "norm_paths",
    "on_x86",
    "pack_int4",
    "pack_q6",
    "paged_decode_attention",
    "paths",
    "quantize_q8_1",
    "refusal",
    "rope",
    "silu_mul",
    "symmetric_offsets",
    "unpack_q6",
]

#: The activation dtypes the kernels take (fp16 is not one).
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


class Int4Groups(Protocol):
    """What `pack_int4` reads (`qinfer.linear.int4.Int4Groups` is one; named by shape here,
    so that the kernels import nothing of the layers that use them)."""

    q: torch.Tensor  # (N, K) uint8, 0..15
    scales: torch.Tensor  # (N, K / group) fp32
    zeros: torch.Tensor  # (N, K / group) fp32

    @property
    def group_size(self) -> int: ...


def fp16_if_exact(*scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A weight's fp32 scales (and offsets) as the kernels read them: all in fp16 where every
    one is an fp16 value (GGUF's Q4_0, Q4_1, Q8_0 and Q5_0 hold fp16 scales: a decode step then
    reads the file's bytes, a Q4_0 block 18 of them, not 24), else all as they are (Q4_K's
    scales d * sc are not; Q6_K's go as stored, `d_super`). Either gives the same bits: the
    kernels widen fp16 exactly."""
    narrowed = tuple(s.half() for s in scales)
    exact = all(torch.equal(n.float(), s) for n, s in zip(narrowed, scales, strict=True))
    return narrowed if exact else scales


@dataclass(frozen=True)
class PackedInt4:
    """A weight of n columns (N, K) for `int4_mm`, in column tiles of 16 (the last padded
    with zero columns; docs/KERNELS.md): qs (G, K/32 * 256) uint8, d and m (G, K/32 * 16) both
    fp16 or both fp32, lane l of block b at [g, 16 b + l] (w = d q + m); m None for a
    symmetric weight, m = 0 - 8 d (computed in fp32 by the kernels, the value it would
    hold). `values`, `scales` and `offsets` give the columns in order."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    n: int

    @property
    def nbytes(self) -> int:
        """Bytes a multiply reads of the weight: qs, d and m where held."""
        return self.qs.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), as the weight's."""
        return (self.n, self.qs.shape[1] // TILE_BYTES * BLOCK)

    def values(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """The nibbles q (0..15) of columns `rows` in order, (..., K) uint8."""
        G, blocks = self.qs.shape[0], self.qs.shape[1] // TILE_BYTES
        # byte 4 r + t of column 16 g + l's block b is register r's dword l, byte t
        tiles = self.qs.view(G, blocks, 4, TILE_COLUMNS, 4).permute(0, 3, 1, 2, 4)
        g, lane = self._tile_lanes(rows)
        pairs = tiles[g, lane].flatten(-2)  # (..., K / 32, 16)
        return torch.cat([pairs & 15, pairs >> 4], dim=-1).flatten(-2)

    def scales(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """d of columns `rows` in order, (..., K / 32) in d's dtype."""
        return self._columns(self.d, rows)

    def offsets(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """m of columns `rows` in order, (..., K / 32) fp32, as the kernels read it (0 - 8 d
        where it is not held)."""
        if self.m is None:
            return symmetric_offsets(self.scales(rows))
        return self._columns(self.m, rows).float()

    def _tile_lanes(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        columns = torch.arange(self.n, device=self.qs.device)[rows]
        return columns // TILE_COLUMNS, columns % TILE_COLUMNS

    def _columns(self, held: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
        g, lane = self._tile_lanes(rows)
        return held.view(held.shape[0], -1, TILE_COLUMNS).transpose(1, 2)[g, lane]


def symmetric_offsets(d: torch.Tensor) -> torch.Tensor:
    """A symmetric int4 weight's m = 0 - 8 d in fp32 (d fp16 or fp32): exact, and +0 where d
    is ±0, as `pack_int4` computes zero - 8 scale for a zero of +0 (and the kernels m)."""
    return 0 - 8 * d.float()


def pack_int4(groups: Int4Groups) -> PackedInt4:
    """The kernel's layout of int4 groups of 32 (docs/KERNELS.md), d and m in fp16 where
    that is exact (`fp16_if_exact`). A symmetric weight, every m 0 - 8 d to the bit (zeros
    +0: GGUF's Q4_0; `quantize_int4`'s min/max groups are not), holds no m: a decode step
    reads 18 bytes a block, the file's, not 20, and every output has the same bits."""
    require()
    if groups.group_size != BLOCK:
        raise ValueError(
            f"pack_int4: the kernel takes int4 groups of {BLOCK}, got groups of {groups.group_size}"
        )
    qs, d, m = torch.ops.qinfer.pack_int4(groups.q, groups.scales, groups.zeros)
    n = groups.q.shape[0]
    if torch.equal(m.view(torch.int32), symmetric_offsets(d).view(torch.int32)):
        return PackedInt4(qs, *fp16_if_exact(d), None, n)
    return PackedInt4(qs, *fp16_if_exact(d, m), n)


#: Q6_K's values a chunk of `pack_q6`, and the chunk's bytes.
Q6_CHUNK, Q6_BYTES = 64, 48


def pack_q6(q: torch.Tensor) -> torch.Tensor:
    """int8 values in -32..31, (N, K) for K a multiple of 64 -> the kernels' 6-bit layout,
    uint8 (N, 3K/4), the file's 6 bits a weight (q6.h): each chunk of 64 values u = q + 32,
    in the order R that puts values l, 16 + l, 32 + l, 48 + l in a 32-bit lane, as 32 bytes of
    low nibbles (R's byte i and i + 32) and 16 of high bits (R's i + 16 t at bits 2 t).
    Plain torch: the layer packs at load, and the paths without the kernels unpack."""
    N, K = q.shape
    if q.dtype != torch.int8 or K % Q6_CHUNK:
        raise ValueError(
            f"pack_q6: q must be torch.int8 (N, K), K a multiple of {Q6_CHUNK}, "
            f"got {q.dtype} {tuple(q.shape)}"
        )
    low, high = q.aminmax() if q.numel() else (torch.tensor(0), torch.tensor(0))
    if low < -32 or high > 31:
        raise ValueError(f"pack_q6: Q6_K's values are -32..31, got {int(low)}..{int(high)}")
    out = torch.empty(N, K // Q6_CHUNK * Q6_BYTES, dtype=torch.uint8, device=q.device)
    step = 4096  # rows at a time: a bounded working set (a 248k-row head packs in place)
    for r in range(0, N, step):
        u = (q[r : r + step] + 32).view(torch.uint8).unflatten(-1, (-1, 4, 16))
        reg = u.transpose(-1, -2).flatten(-2)  # (n, K/64, 64): R, byte 4 l + J = u[16 J + l]
        nibbles = (reg[..., :32] & 15) | (reg[..., 32:] << 4)  # (n, K/64, 32)
        high = (reg >> 4).unflatten(-1, (4, 16))
        bits = sum(high[..., t, :] << (2 * t) for t in range(4))  # (n, K/64, 16)
        out[r : r + step] = torch.cat([nibbles, bits], -1).flatten(1)
    return out


def unpack_q6(packed: torch.Tensor) -> torch.Tensor:
    """`pack_q6`'s inverse: uint8 (..., 3K/4) -> int8 (..., K)."""
    if packed.dtype != torch.uint8 or packed.dim() == 0 or packed.shape[-1] % Q6_BYTES:
        raise ValueError(
            f"unpack_q6: packed must be torch.uint8 (..., 3K/4), a multiple of {Q6_BYTES} "
            f"bytes a row, got {packed.dtype} {tuple(packed.shape)}"
        )
    chunks = packed.unflatten(-1, (-1, Q6_BYTES))  # (..., K/64, 48)
    nibbles, bits = chunks[..., :32], chunks[..., 32:]
    low = torch.cat([nibbles & 15, nibbles >> 4], -1)  # (..., K/64, 64) in R's order
    high = torch.cat([(bits >> (2 * t)) & 3 for t in range(4)], -1)
    reg = (low | (high << 4)).unflatten(-1, (16, 4))  # (..., K/64, l, J)
    return (reg.transpose(-1, -2).to(torch.int8) - 32).flatten(-3)


def int4_mm(x: torch.Tensor, packed: PackedInt4, path: str = "auto") -> torch.Tensor:
    """(M, K) fp32 or bf16 times the packed (N, K) weight, transposed -> (M, N) fp32."""
    if ops.int4_mm is None:
        require()
    return ops.int4_mm(
        x, packed.qs, packed.d, packed.m, packed.n, auto_path() if path == "auto" else path
    )


def int8_mm(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    path: str = "auto",
    d_super: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M, K) fp32 or bf16 times int8 q (N, K) with fp16 or fp32 scales, one per row (N,) or
    one per block of B = 32 or 16 input columns (N, K/B), transposed -> (M, N) fp32: scales[n] *
    sum_b dx[r, b] (q[n, b] . qx[r, b]), or sum_b dx[r, b] * scales[n, b] (q[n, b] . qx[r, b])
    per block, the activations rounded per block of 32 as `int4_mm` rounds them (llama.cpp's
    q8_0 dot). Q6_K as the file holds it: int8 sub-scales (N, K/16) and d_super (N, K/256)
    fp16, a block's scale their product (exact in fp32), and q its values as `pack_q6`
    packs them."""
    if ops.int8_mm is None:
        require()
    return ops.int8_mm(x, q, scales, auto_path() if path == "auto" else path, d_super)


def int8_blocks_mm(
    x: torch.Tensor,
    q: torch.Tensor,
    d: torch.Tensor,
    path: str = "auto",
    d_super: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M, K) fp32 or bf16 times int8 q (N, K) with one fp16 or fp32 scale per block of B
    input columns, d (N, K/B) for B = 16 or 32, transposed -> (M, N) fp32: sum_b d[n, b] *
    (q[n, b] . x[r, b]), the activations as they are (bf16 widened exactly). Q6_K as stored:
    d int8 (N, K/16) and d_super (N, K/256) fp16, block b's d_super * d[b], and q
    `pack_q6(q)`. ids (M, k) int64: only those rows of the weight for each row of x, -> (M, k)
    with out[r, j] the bits of the whole product's (r, ids[r, j])."""
    if ops.int8_blocks_mm is None:
        require()
    return ops.int8_blocks_mm(x, q, d, auto_path() if path == "auto" else path, d_super, ids)


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(R, N) fp32 -> (R, k) int64: each row's k highest columns, in ascending order; of equal
    logits the lower column first, NaN below everything (so a row's k depend on that row
    alone). torch.topk's set up to its ties, in one pass a row (at k = 256 over 150-250k
    columns 1.5-2.8x torch.topk's speed; docs/KERNELS.md)."""
    if ops.top_k_ids is None:
        require()
    return ops.top_k_ids(logits, k)


def int4_groups_mm(x: torch.Tensor, packed: PackedInt4, path: str = "auto") -> torch.Tensor:
    """(M, K) fp32 or bf16 times the packed (N, K) weight, transposed -> (M, N) fp32: per
    block of 32, d (q . x) + m sum(x) with the nibbles q exact and the activations as they
    are (bf16 widened exactly), in fp32 fused multiply-adds: x @ W.T of the exact weight W =
    d q + m to fp32 accuracy (docs/KERNELS.md)."""
    if ops.int4_groups_mm is None:
        require()
    return ops.int4_groups_mm(
        x, packed.qs, packed.d, packed.m, packed.n, auto_path() if path == "auto" else path
    )


def quantize_q8_1(x: torch.Tensor, path: str = "auto") -> tuple[torch.Tensor, ...]:
    """The activations as `int4_mm` quantizes them: qx (M, K) int8, dx (M, K/32) fp32 and
    sum(qx) (M, K/32) int32, computed by the path's own code."""
    require()
    return tuple(torch.ops.qinfer.quantize_q8_1(x, auto_path() if path == "auto" else path))


def add_rms_norm(
    h: torch.Tensor,
    x: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    path: str = "auto",
) -> torch.Tensor:
    """h (T, H) fp32 contiguous += x (T, H) fp32 or bf16, in place (x None: h unchanged);
    returns h * (1 / sqrt(mean(h^2) + eps)) * w (w (H,) fp32) in `dtype` (fp32 or bf16)."""
    if ops.add_rms_norm is None:
        require()
    return ops.add_rms_norm(h, x, w, eps, dtype, norm_auto_path() if path == "auto" else path)


def heads_rms_norm(
    h: torch.Tensor,
    w_first: torch.Tensor,
    w_rest: torch.Tensor,
    first: int,
    eps: float,
    dtype: torch.dtype,
    path: str = "auto",
) -> torch.Tensor:
    """QK-norm: h (T, R, D) fp32 heads (last dimension contiguous, any other strides), read
    only -> (T, R, D) in `dtype`, head r normed as `add_rms_norm`'s row with x None, by
    w_first (D,) fp32 for r < first and by w_rest (D,) fp32 after."""
    if ops.heads_rms_norm is None:
        require()
    return ops.heads_rms_norm(
        h, w_first, w_rest, first, eps, dtype, norm_auto_path() if path == "auto" else path
    )


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor | None,
    positions: torch.Tensor,
    tables: torch.Tensor,
    totals: torch.Tensor,
    key_starts: torch.Tensor | None,
    block_size: int,
    window: int | None,
    scale: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: q (G, Hq, D), k and v (G, Hkv, D) fp32 or bf16 -> (G, Hq, D)
    in q's dtype. Stores k, v into one layer's pool keys, values (Hkv, slots, D) fp32 or bf16
    at `slots` (G,) (k, v and slots None: stored already), then attends each query at
    `positions` (G,) to its sequence's keys:
    those of its table (G, W) of blocks of `block_size` slots, from position key_starts[g]
    (None: 0) up to totals[g] (G,), within `window` (None: all). docs/KERNELS.md says
    the arithmetic (fp32, every sum in key order). An int8 pool (kv_quant's "int8") comes
    with its fp16 key_scales and value_scales (Hkv, slots, N), N dividing D: k and v are
    stored as `KVFormat.quantize` stores them (the same bits), and it attends as an fp32
    pool of its dequantized values would, bit for bit."""
    if ops.paged_decode_attention is None:
        require()
    return ops.paged_decode_attention(
        q,
        k,
        v,
        keys,
        values,
        slots,
        positions,
        tables,
        totals,
        key_starts,
        block_size,
        0 if window is None else window,
        scale,
        key_scales,
        value_scales,
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) fp32 rotated by cos, sin (T, R/2) fp32 (rotate-half, the first R of D
    dimensions) -> (T, H, D): `RoPE.apply` in fp32 as one op, bit for bit."""
    if ops.rope is None:
        require()
    return ops.rope(x, cos, sin)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + causal) v for q (B, Hq, L, D) fp32 and grouped k, v (B, Hkv,
    S, D) fp32 or bf16, bottom-right causal (the L queries the last L of the S keys) ->
    (B, Hq, L, D) fp32, laid out (B, L, Hq, D): flash attention in fp32, each query's bits its
    own whatever the others (docs/KERNELS.md)."""
    if ops.causal_attention is None:
        require()
    return ops.causal_attention(q, k, v, scale)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2W) fp32, gate then up (its last dimension contiguous) -> silu(gate) * up (T, W)
    fp32 in one pass: (g / (1 + exp(-g))) * u, exp within 2 ulp (docs/KERNELS.md)."""
    if ops.silu_mul is None:
        require()
    return ops.silu_mul(x)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    column_slots: torch.Tensor,
    b_t: list[torch.Tensor | None],
    parts: list[int],
    path: str = "auto",
) -> None:
    """LoRA's adapter rows of a projection (`qinfer.linear.lora.LoraLinear`'s packing), in
    place: for each rows[i] of y (T, out) fp32 or bf16 and x (T, in) fp32 or bf16, with
    slot slots[i] (rows, slots (n,) int64), and each part p (its out_p: parts[p]), adds
    (x[r] . a[J]) @ b_t[p][J - part start] to y[r, part p's outputs], J the columns of part
    p that column_slots (C,) gives slot s; a (C, in) and b_t[p] (C_p, out_p) (None: C_p = 0)
    fp32 or bf16, widened exactly; fp32 sums in a fixed order per row (docs/KERNELS.md).
    Other rows of y are not touched."""
    if ops.lora_add is None:
        require()
    ops.lora_add(
        y, x, rows, slots, a, column_slots, b_t, parts, norm_auto_path() if path == "auto" else path
    )


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule token by token, `deltanet.recurrent_gated_delta_rule`'s
    arguments: q, k (B, L, H, Dk) L2-normalised (q not yet scaled by Dk^-0.5), v
    (B, L, H, Dv), g, beta (B, L, H), all fp32; state (B, H, Dk, Dv) fp32 contiguous,
    overwritten with the state after the L tokens; or, with slots (B,) int64, a pool
    (P, H, Dk, Dv) whose row slots[b] is sequence b's, updated where it lies. Returns out
    (B, L, H, Dv) fp32, each (sequence, head) alone in its sums (docs/KERNELS.md)."""
    if ops.gated_delta_recurrent is None:
        require()
    return ops.gated_delta_recurrent(q, k, v, g, beta, state, slots)


def causal_conv1d(
    x: torch.Tensor, taps: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`deltanet.causal_conv1d` compiled, all fp32: x (S, L, C) (channels contiguous), taps
    (K, C) (the conv's weight transposed, contiguous), the windows pool (P, K - 1, C) whose
    row slots[s] (slots (S,) int64) is sequence s's window, replaced by its last K - 1
    inputs. Returns SiLU(conv) (S, L, C), each sequence alone in its sums (docs/KERNELS.md)."""
    if ops.causal_conv1d is None:
        require()
    return ops.causal_conv1d(x, taps, windows, slots)


def gated_delta_decode(
    qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    taps: torch.Tensor,
    windows: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    key_heads: int,
) -> torch.Tensor:
    """One decode token of a Gated DeltaNet's mixer per sequence, all fp32: qkv (S, C) the
    conv's channels (q and k of `key_heads` heads of Dk, then v of H heads of Dv), b and a
    (S, H); the causal conv with SiLU from the windows pool (P, K - 1, C) by taps (K, C)
    (the conv's weight transposed, contiguous), q and k L2-normalised, beta = sigmoid(b),
    g = -exp(A_log) softplus(a + dt_bias), then `gated_delta_recurrent` on the pool state
    (P, H, Dk, Dv); rows slots (S,) of both pools are updated where they lie. Returns out
    (S, H, Dv), each sequence alone in its sums (docs/KERNELS.md)."""
    if ops.gated_delta_decode is None:
        require()
    return ops.gated_delta_decode(qkv, b, a, taps, windows, A_log, dt_bias, state, slots, key_heads)


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule `chunk_size` tokens at a time (`deltanet.chunked_gated_delta_rule`'s
    steps), `gated_delta_recurrent`'s arguments (slots too) and result; within fp32 rounding
    of it, each (sequence, head) alone in its sums (docs/KERNELS.md)."""
    if ops.gated_delta_chunked is None:
        require()
    return ops.gated_delta_chunked(q, k, v, g, beta, state, chunk_size, slots)
