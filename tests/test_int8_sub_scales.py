"""Q6_K's scales as the file holds them (`Int8Blocks.super_scales`): int8 sub-scales per 16
columns and an fp16 super-scale per 256, multiplied in the kernels as they read a block.

The reference is the same weight with one fp32 scale d * sc per block (`flattened()`), the
form every Q6_K weight had before: each path's output must be the same bits (the product is
exact in fp32), and the layer smaller.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_files import synthetic_tensor
from linear_layers import activations

from qinfer import kernels
from qinfer.core.errors import WeightsError
from qinfer.linear import Int8BlockLinear, Int8Blocks, make_linear
from qinfer.weights.gguf_deltanet import gathered
from qinfer.weights.gguf_quants import int8_blocks

Q6_K = gguf.GGMLQuantizationType.Q6_K
#: row counts: a decode step, every row tile's tail (4), past DECODE_MAX_ROWS, prefills
ROWS = (*range(1, 10), 16, 33, 512)


def q6_k(rows: int = 37, columns: int = 768) -> Int8Blocks:
    """A Q6_K tensor's blocks (random bytes, fp16 d), rows not a multiple of the tiles'."""
    return int8_blocks(synthetic_tensor(Q6_K, rows, columns), Q6_K)


def test_q6_k_keeps_the_files_scales():
    data = synthetic_tensor(Q6_K, 37, 768)
    blocks = int8_blocks(data, Q6_K)
    assert blocks.scales.dtype == torch.int8 and blocks.scales.shape == (37, 768 // 16)
    assert blocks.super_scales.dtype == torch.float16
    assert blocks.super_scales.shape == (37, 768 // 256)
    reference = torch.from_numpy(gguf.quants.dequantize(data, Q6_K))
    assert torch.equal(blocks.dequantize(), reference)
    assert torch.equal(blocks.flattened().dequantize(), reference)
    # 6 + 8/16 + 16/256 bits a weight, the file's 210 bytes per 256 (`data`), against 8 +
    # 32/16 as int8 values with an fp32 scale per block
    held = Int8BlockLinear(blocks, None, torch.float32)
    wide = Int8BlockLinear(blocks.flattened(), None, torch.float32)
    assert held.nbytes == data.nbytes == 37 * 768 // 256 * 210
    assert held.q.dtype == torch.uint8 and torch.equal(kernels.unpack_q6(held.q), blocks.q)
    assert wide.nbytes == 37 * 768 * (1 + 4 / 16)
    assert held.scales.dtype == torch.int8 and wide.scales.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("columns", [256, 768])
def test_every_path_gives_the_bits_of_fp32_scales(int8_dot_built, dtype, columns):
    """The layer's paths (the fp32 kernel, int8_dot, the tiles), at every row count."""
    blocks = q6_k(columns=columns)
    held = Int8BlockLinear(blocks, None, dtype)
    wide = Int8BlockLinear(blocks.flattened(), None, dtype)
    assert held.paths() == wide.paths() and "int8_dot" in held.paths()
    x = activations(max(ROWS), columns, dtype)
    for path in held.paths():
        for m in ROWS:
            got = held.run_path(path, x[:m])
            assert torch.equal(got, wide.run_path(path, x[:m])), (path, m)
    assert torch.equal(held.logits(x[:3], dtype), wide.logits(x[:3], dtype))


@pytest.mark.parametrize("op", [kernels.int8_blocks_mm, kernels.int8_mm], ids=lambda f: f.__name__)
def test_each_isa_gives_the_bits_of_fp32_scales(int8_dot_built, op):
    blocks = q6_k()
    wide = blocks.flattened().scales
    x = activations(max(ROWS), 768, torch.float32)
    packed = kernels.pack_q6(blocks.q)
    for path in kernels.paths():
        for m in ROWS:
            got = op(x[:m], packed, blocks.scales, path, d_super=blocks.super_scales)
            assert torch.equal(got, op(x[:m], blocks.q, wide, path)), (path, m)


def test_gathered_rows_of_a_q6_k_weight_give_the_whole_products_bits(int8_dot_built):
    """The exact kernel on each row's own rows of the packed weight (ids): the whole
    product's bits, on every path."""
    blocks = q6_k()
    packed = kernels.pack_q6(blocks.q)
    x = activations(max(ROWS), 768, torch.float32)
    ids = torch.randint(0, blocks.q.shape[0], (len(x), 11))
    for path in kernels.paths():
        whole = kernels.int8_blocks_mm(x, packed, blocks.scales, path, d_super=blocks.super_scales)
        got = kernels.int8_blocks_mm(
            x, packed, blocks.scales, path, d_super=blocks.super_scales, ids=ids
        )
        assert torch.equal(got, whole.gather(1, ids)), path


def test_int8_mm_stages_a_long_weight_alike(int8_dot_built):
    """int8_mm stages 16 columns at a time, Q6_K's unpacked as they are staged (K = 4096, 300
    columns: a last tile of 12): the bits of int8 values with fp32 scales at every row count,
    and each row's bits alone."""
    blocks = q6_k(rows=300, columns=4096)
    packed, wide = kernels.pack_q6(blocks.q), blocks.flattened().scales
    x = activations(17, 4096, torch.float32)
    for path in kernels.paths():
        alone = kernels.int8_mm(x[:1], packed, blocks.scales, path, d_super=blocks.super_scales)
        for m in (1, 9, 17):
            got = kernels.int8_mm(x[:m], packed, blocks.scales, path, d_super=blocks.super_scales)
            assert torch.equal(got, kernels.int8_mm(x[:m], blocks.q, wide, path)), (path, m)
            assert torch.equal(got[:1], alone), (path, m)


def test_rows_and_dequantized_tiles_are_exact():
    blocks = q6_k()
    reference = blocks.flattened().dequantize()
    layer = Int8BlockLinear(blocks, None, torch.float32)
    assert torch.equal(layer.dequantize(), reference)
    ids = torch.tensor([[5, 0, 36], [7, 7, 1]])
    assert torch.equal(layer.rows(ids), reference[ids])
    assert torch.equal(layer._dequantize_rows(8, 24, torch.float32), reference[8:24])
    bf16 = Int8BlockLinear(blocks, None, torch.bfloat16)
    assert torch.equal(bf16._dequantize_rows(3, 30, torch.bfloat16), reference[3:30].bfloat16())


def test_the_row_copy_without_kernels_is_the_same():
    """Where the kernels cannot be built: the weight re-rounded to rows, as from fp32 scales."""
    blocks = q6_k()
    held = Int8BlockLinear(blocks, None, torch.bfloat16)
    wide = Int8BlockLinear(blocks.flattened(), None, torch.bfloat16)
    got, expected = held._rounded_to_rows(), wide._rounded_to_rows()
    assert torch.equal(got.q, expected.q) and torch.equal(got.scales, expected.scales)


def test_columns_and_gathers_keep_whole_super_blocks():
    """A tensor-parallel share or a gather of whole super-blocks keeps the file's scales; one
    that splits them keeps the weight exactly with fp32 scales."""
    blocks = q6_k()
    reference = blocks.dequantize()
    share = blocks.columns(256, 768)
    assert share.super_scales is not None
    assert torch.equal(share.dequantize(), reference[:, 256:768])
    half = blocks.columns(128, 512)
    assert half.super_scales is None and torch.equal(half.dequantize(), reference[:, 128:512])
    rows = torch.tensor([3, 1, 2])
    for columns, kept in ((torch.arange(512, 768), True), (torch.arange(128, 256), False)):
        gather = gathered(blocks, rows, columns)
        assert (gather.super_scales is not None) == kept
        assert torch.equal(gather.dequantize(), reference[rows][:, columns])


def test_fused_parts_stack_their_scales():
    a, b = q6_k(rows=16), q6_k(rows=24)
    fused = make_linear([a, b], [None, None], torch.float32, torch.device("cpu"))
    assert fused.super_scales is not None
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    mixed = make_linear([a, b.flattened()], [None, None], torch.float32, torch.device("cpu"))
    assert mixed.super_scales is None
    assert torch.equal(mixed.dequantize(), fused.dequantize())


def test_bad_sub_scales_are_named(int8_dot_built):
    blocks = q6_k(rows=4, columns=256)
    x = torch.zeros(1, 256)
    with pytest.raises(RuntimeError, match="int8 sub-scales need d_super"):
        kernels.int8_blocks_mm(x, blocks.q, blocks.scales)
    with pytest.raises(RuntimeError, match="d_super goes with int8 sub-scales"):
        kernels.int8_mm(x, blocks.q, blocks.scales.float(), d_super=blocks.super_scales)
    with pytest.raises(RuntimeError, match=r"d_super must be torch.float16"):
        kernels.int8_mm(x, blocks.q, blocks.scales, d_super=blocks.super_scales.float())
    with pytest.raises(RuntimeError, match=r"int8 sub-scales are \(N, K/16\)"):
        kernels.int8_mm(x, blocks.q, blocks.scales[:, :8], d_super=blocks.super_scales)
    packed = kernels.pack_q6(blocks.q)
    for op in (kernels.int8_blocks_mm, kernels.int8_mm):
        name = op.__name__
        with pytest.raises(RuntimeError, match=f"{name}: q must be torch.uint8, got torch.int8"):
            op(x, blocks.q, blocks.scales, d_super=blocks.super_scales)
        with pytest.raises(RuntimeError, match=r"q must have shape \(4, 192\), \(N, 3K/4\), Q6_K"):
            op(x, packed[:, :96], blocks.scales, d_super=blocks.super_scales)


def test_the_six_bit_layout():
    """`pack_q6` is lossless on -32..31 and lays a chunk out as q6.h says; the layer refuses
    values a Q6_K weight cannot hold."""
    q = torch.arange(64, dtype=torch.int8).sub(32).repeat(3, 4)  # (3, 256): every value
    packed = kernels.pack_q6(q)
    assert packed.shape == (3, 192) and torch.equal(kernels.unpack_q6(packed), q)
    with pytest.raises(
        ValueError, match=r"unpack_q6: packed must be torch.uint8 .* got torch.int8"
    ):
        kernels.unpack_q6(q)
    with pytest.raises(
        ValueError, match=r"a multiple of 48 bytes a row, got torch.uint8 \(3, 40\)"
    ):
        kernels.unpack_q6(packed[:, :40])
    u = q[0, :64].to(torch.int32) + 32
    reg = u.view(4, 16).T.flatten()  # R: byte 4 l + J holds value 16 J + l
    chunk = packed[0, :48].to(torch.int32)
    assert torch.equal(chunk[:32], (reg[:32] & 15) | ((reg[32:] & 15) << 4))
    bits = sum(((reg[16 * t : 16 * t + 16] >> 4) << (2 * t)) for t in range(4))
    assert torch.equal(chunk[32:], bits)
    blocks = q6_k(rows=4, columns=256)
    blocks.q[2, 5] = 40
    with pytest.raises(
        WeightsError, match=r"pack_q6: Q6_K's values are -32..31, got -32..40 \(weight \(4, 256\)\)"
    ):
        Int8BlockLinear(blocks, None, torch.float32)
