"""qinfer.kernels' int4 x int8 and int8 (rows and blocks) x int8 dot-product kernels: exact
against a float64 reference built from the same quantized activations, within int8 rounding
of F.linear, alike on every dispatch path this CPU runs, the same for a row whatever batch it
is in, and one-line errors.

The extension builds on first use (about 20 s, then cached); every test skips with the
loader's reason where it cannot (no compiler, not x86-64, the build failed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from capped import in_capped_process, in_fresh_process
from gguf_files import synthetic_tensor
from threads import torch_threads

from qinfer import kernels
from qinfer.linear import Int4Groups, quantize_int4
from qinfer.weights.gguf_quants import int8_blocks

Q6_K = gguf.GGMLQuantizationType.Q6_K

ALL_PATHS = ("scalar", "avx2", "vnni")  # "amx": its own tests below (VNNI's bits)
# (N, K): K one block, an even and an odd number of block pairs' worth, and 48 blocks; no N
# a multiple of 16 (the kernel's column tiles of 16, 4 and 2 all get a tail)
SHAPES = [(40, 32), (77, 576), (33, 96), (50, 1536), (19, 288)]
FP32_UNIT = 2.0**-24  # fp32's unit roundoff


@pytest.fixture(scope="module")
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(params=ALL_PATHS)
def path(request, built) -> str:
    if request.param not in kernels.paths():
        pytest.skip(f"this CPU has no {request.param} path (it has {', '.join(kernels.paths())})")
    return request.param


def weight(n: int, k: int, seed: int = 0):
    """Random int4 groups of 32, with rows of very different magnitude (and so scales)."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * 0.05
    w *= torch.logspace(-2, 1, n)[torch.randperm(n, generator=generator)][:, None]
    return quantize_int4(w, 32)


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Gaussian rows with a few outlier columns, as real activations have."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    x[:, torch.randint(0, k, (max(1, k // 64),), generator=generator)] *= 20
    return x.to(dtype)


def kernel_weight(packed: kernels.PackedInt4, q: torch.Tensor) -> torch.Tensor:
    """(N, K) float64: d * q + m, the weight the kernel multiplies by."""
    d, m = (t.double().repeat_interleave(32, 1) for t in (packed.scales(), packed.offsets()))
    return d * q.double() + m


def symmetric_weight(n: int, k: int) -> Int4Groups:
    """`weight`'s q and fp16 scales with zeros 0, as GGUF's Q4_0 loads; among the scales
    +0, -0 (m = 0 - 8 d is +0 for both) and 10000, whose 8 d is past fp16's range."""
    g = weight(n, k)
    g.scales[0, 0], g.scales[-1, -1], g.scales[n // 2, 0] = 0.0, -0.0, 10000.0
    return Int4Groups(g.q, g.scales, torch.zeros_like(g.zeros))


def held_m(groups: Int4Groups) -> kernels.PackedInt4:
    """The weight as pack_int4 packed it before symmetric weights dropped m: d and m = zero -
    8 scale, both fp16 where both are exact (a d past 8188: both fp32)."""
    qs, d, m = torch.ops.qinfer.pack_int4(groups.q, groups.scales, groups.zeros)
    return kernels.PackedInt4(qs, *kernels.fp16_if_exact(d, m), groups.q.shape[0])


def test_pack_layout(built) -> None:
    """24 columns in 2 tiles of 16 (8 of padding), 3 blocks each: per tile and block 4
    registers of 64 bytes, register r's dword l holding bytes 4r..4r+3 of column 16 g + l's
    block, byte j its element j (low nibble) and j + 16 (high); d and m 16 a block, a lane a
    column."""
    groups = weight(24, 96)
    packed = kernels.pack_int4(groups)
    assert packed.shape == (24, 96)
    assert packed.qs.shape == (2, 3 * 256) and packed.d.shape == packed.m.shape == (2, 3 * 16)
    registers = packed.qs.view(2, 3, 4, 16, 4)  # (tile, block, register, lane, byte)
    q = groups.q.view(24, 3, 32)
    for n, b, j in ((0, 0, 0), (5, 1, 7), (17, 2, 13), (23, 0, 15)):
        byte = registers[n // 16, b, j // 4, n % 16, j % 4]
        assert byte & 15 == q[n, b, j] and byte >> 4 == q[n, b, j + 16]
    assert not registers[1, :, :, 8:].any() and not packed.d.view(2, 3, 16)[1, :, 8:].any()
    assert torch.equal(packed.values(), groups.q)
    # quantize_int4's scales and mins are fp16 values: packed as fp16, the same numbers
    assert packed.d.dtype == packed.m.dtype == torch.float16
    assert torch.equal(packed.d.view(2, 3, 16)[0, 1, 5].float(), groups.scales[5, 1])
    assert torch.equal(packed.scales().float(), groups.scales)
    assert torch.equal(packed.offsets(), groups.zeros - 8 * groups.scales)


def test_pack_keeps_fp32_where_fp16_would_round(built) -> None:
    """One scale that is no fp16 value (Q4_K's d * sc, say) keeps d and m in fp32, as given."""
    groups = weight(24, 96)
    groups.scales[5, 1] *= 1 + 2.0**-20
    packed = kernels.pack_int4(groups)
    assert packed.d.dtype == packed.m.dtype == torch.float32
    assert torch.equal(packed.scales(), groups.scales)
    assert torch.equal(packed.offsets(), groups.zeros - 8 * groups.scales)


def test_pack_holds_no_m_for_a_symmetric_weight(built) -> None:
    """Zeros +0 (Q4_0's): m is 0 - 8 d bit for bit, not held; d fp16 even where 8 d is past
    fp16 (which held both in fp32 before). Any other m (a zero of -0 on a d of 0) is held."""
    groups = symmetric_weight(24, 96)
    packed = kernels.pack_int4(groups)
    assert packed.m is None and packed.d.dtype == torch.float16
    assert torch.equal(packed.scales().float(), groups.scales)
    # a block: 16 bytes of nibbles, an fp16 d (32 columns in 2 tiles of 16: 8 of padding)
    assert packed.nbytes == 32 * 3 * (16 + 2)
    assert held_m(groups).nbytes == 32 * 3 * (16 + 4 + 4)
    offsets = packed.offsets()
    assert torch.equal(offsets.view(torch.int32), held_m(groups).offsets().view(torch.int32))
    assert not torch.signbit(offsets[-1, -1])  # d = -0: m = +0, as held
    groups.zeros[0, 0] = -0.0  # on d = +0: m = -0, not 0 - 8 d's +0
    assert kernels.pack_int4(groups).m is not None


# (N, K) with an odd block count (a half pair, a last group of fewer than 4 blocks), every
# column tile's tail, and a K of more than 16 blocks (the offsets' chunks of 16 and 8)
HALF_SHAPES = [(19, 32), (33, 96), (40, 288), (77, 1536)]


@pytest.mark.parametrize(("n", "k"), HALF_SHAPES)
def test_fp16_scales_give_the_bits_of_fp32_ones(path, n, k) -> None:
    """fp16 scales (GGUF's, widened in the kernels) and the same values in fp32 give the same
    bits on every op and path, at 1 row and at 9: only the bytes read differ."""
    groups = weight(n, k)
    half = kernels.pack_int4(groups)
    wide = kernels.PackedInt4(half.qs, half.d.float(), half.m.float(), half.n)
    q, scales, _ = int8_weight(n, k, 32)
    q16, scales16, _ = int8_weight(n, k, 16)
    for rows in (1, 9):
        x = activations(rows, k, torch.float32)
        for op in (kernels.int4_mm, kernels.int4_groups_mm):
            assert torch.equal(op(x, half, path), op(x, wide, path)), (op.__name__, rows)
        for q_, s in ((q, scales.half()), (q16, scales16.half()), (q, scales[:, 0].half())):
            for op in (kernels.int8_mm, kernels.int8_blocks_mm):
                if op is kernels.int8_blocks_mm and s.dim() == 1:
                    continue  # int8 blocks only: no per-row scales
                got, want = op(x, q_, s, path), op(x, q_, s.float(), path)
                assert torch.equal(got, want), (op.__name__, tuple(s.shape), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_is_q8_1_on_every_path(built, dtype) -> None:
    """Every path's quantizer gives the bits this torch computation gives: dx = amax / 127,
    qx = round half to even of x * (1 / dx), and the block sums."""
    x = activations(7, 288, dtype)
    x[3, :32] = 0  # an all-zero block: dx = 0, qx = 0
    blocks = x.float().view(7, -1, 32)
    dx = blocks.abs().amax(-1) / 127
    inverse = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    qx = torch.round(blocks * inverse[..., None]).to(torch.int8)
    for name in kernels.paths():
        got_qx, got_dx, got_sums = kernels.quantize_q8_1(x, name)
        assert torch.equal(got_qx, qx.view(7, -1)), name
        assert torch.equal(got_dx, dx), name
        assert torch.equal(got_sums, qx.int().sum(-1)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_exact_from_the_same_quantized_activations(path, dtype, n, k) -> None:
    """Against float64 from the kernel's own int8 activations: only fp32 rounding differs,
    at most (blocks + 8) units in the last place of the sum of the terms' magnitudes."""
    groups = weight(n, k)
    packed = kernels.pack_int4(groups)
    x = activations(6, k, dtype)
    qx, dx, _ = kernels.quantize_q8_1(x, path)
    xq = qx.double() * dx.double().repeat_interleave(32, 1)  # (M, K): dx * qx
    w = kernel_weight(packed, groups.q)
    reference = xq @ w.T
    # every term of the kernel's sum, in magnitude: dx |qx| (d q + |m|)
    magnitude = xq.abs() @ (w.abs() + packed.offsets().double().abs().repeat_interleave(32, 1)).T
    y = kernels.int4_mm(x, packed, path)
    assert y.dtype == torch.float32 and y.shape == (6, n)
    bound = (k // 32 + 8) * 2 * FP32_UNIT * magnitude
    assert ((y.double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_within_int8_rounding_of_float_linear(path, dtype, n, k) -> None:
    """Against F.linear(x, W) with W the dequantized weight: rounding x to int8 moves each
    element by at most dx / 2, so an output by at most sum_j dx_j / 2 |W[n, j]|; and a
    little fp32 slack for the kernel's m = zero - 8 * scale and its fp32 sums."""
    groups = weight(n, k)
    packed = kernels.pack_int4(groups)
    x = activations(6, k, dtype)
    _, dx, _ = kernels.quantize_q8_1(x, path)
    w = groups.dequantize().double()
    reference = F.linear(x.double(), w)
    rounding = 0.5 * dx.double().repeat_interleave(32, 1) @ w.abs().T
    offsets = (8 * groups.scales.abs() + groups.zeros.abs()).double().repeat_interleave(32, 1)
    slack = (k // 32 + 8) * 4 * FP32_UNIT * (x.double().abs() @ (w.abs() + offsets).T)
    error = (kernels.int4_mm(x, packed, path).double() - reference).abs()
    assert (error <= rounding + slack).all()
    assert error.max() > 0  # the int8 activations do round (a vacuous bound would pass too)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paths_give_the_same_bits(built, dtype) -> None:
    """A tile's lane is a column, each output the same chain of fused multiply-adds on every
    path: scalar, AVX2 and VNNI agree bit for bit, both ops (so a model's text does not
    depend on the CPU the kernels run on)."""
    groups = weight(77, 1536)
    packed = kernels.pack_int4(groups)
    x = activations(9, 1536, dtype)
    for op in (kernels.int4_mm, kernels.int4_groups_mm):
        results = [op(x, packed, name) for name in kernels.paths()]
        for name, other in zip(kernels.paths()[1:], results[1:], strict=True):
            assert torch.equal(other, results[0]), (op.__name__, name)
        assert torch.equal(op(x, packed), results[-1])  # auto: the last path


def test_the_avx2_path_gives_its_bits_with_and_without_avx_vnni(built, tmp_path) -> None:
    """int4_mm's "avx2" path takes AVX-VNNI's vpdpbusd where the CPU has it, and vpmaddubsw
    where not (an AVX2-only CPU, or ATEN_CPU_CAPABILITY=avx2 emulating one): the same bits.
    Run capped in a fresh process (the cap is read once), against this process's."""
    if "avx2" not in kernels.paths():
        pytest.skip(f"this CPU has no avx2 path (it has {', '.join(kernels.paths())})")
    packed = kernels.pack_int4(weight(77, 1536))
    x = activations(9, 1536, torch.float32)
    call = "kernels.int4_mm(inputs[0], kernels.PackedInt4(*inputs[1:]), 'avx2')"
    capped = in_capped_process("avx2", tmp_path, call, x, packed.qs, packed.d, packed.m, packed.n)
    assert torch.equal(capped, kernels.int4_mm(x, packed, "avx2"))


@pytest.mark.parametrize(
    ("cap", "dot", "vector"),
    [("avx2", "avx2", "avx2"), ("default", "scalar", "scalar"), ("avx512", "vnni", "avx512")]
    + [("", None, None)],
)
def test_auto_follows_torchs_cap_on_its_own_kernels(built, tmp_path, cap, dot, vector) -> None:
    """ATEN_CPU_CAPABILITY emulates a smaller CPU for torch's kernels, and so for these:
    an emulated AVX2 machine rounds as a real one does. The library reads the cap once a
    process, so a fresh one answers for each (None: no cap, the fastest path)."""
    if dot is not None and dot not in kernels.paths():
        pytest.skip(f"this CPU has no {dot} path")
    answer = in_capped_process(cap, tmp_path, "(kernels.auto_path(), kernels.cpu.norm_auto_path())")
    assert answer == (dot or kernels.paths()[-1], vector or kernels.cpu.norm_paths()[-1])


#: Row counts a multi-row call is checked at: every count up to 33 (row tiles of 4 and
#: their remainders, column tiles that change with them) and a prompt's 512.
ROW_COUNTS = (*range(1, 34), 512)


@pytest.mark.parametrize(("n", "k"), HALF_SHAPES)
def test_a_symmetric_weight_gives_the_bits_of_its_held_m(path, n, k) -> None:
    """Both ops on every path, at 1..9, 16, 33 and 512 rows: m = 0 - 8 d computed in the
    kernels gives the bits of the same weight with m held (what Q4_0 read before)."""
    groups = symmetric_weight(n, k)
    packed, held = kernels.pack_int4(groups), held_m(groups)
    x = activations(512, k, torch.float32)
    for op in (kernels.int4_mm, kernels.int4_groups_mm):
        for rows in (*range(1, 10), 16, 33, 512):
            got, want = op(x[:rows], packed, path), op(x[:rows], held, path)
            assert torch.equal(got, want), (op.__name__, rows)


@pytest.mark.parametrize(("n", "k"), [(77, 576), (19, 32), (50, 96)])
def test_a_row_is_the_same_in_any_batch(path, n, k) -> None:
    """Row i of an M-row call equals the 1-row call of that row, bit for bit, for every M
    of ROW_COUNTS, and with 1 thread or all of them."""
    groups = weight(n, k)
    packed = kernels.pack_int4(groups)
    x = activations(ROW_COUNTS[-1], k, torch.float32)
    alone = torch.cat([kernels.int4_mm(x[i : i + 1], packed, path) for i in range(len(x))])
    with torch_threads(2):
        for m in ROW_COUNTS:
            assert torch.equal(kernels.int4_mm(x[:m], packed, path), alone[:m]), f"M = {m}"
    with torch_threads(1):
        assert torch.equal(kernels.int4_mm(x, packed, path), alone)


def test_empty_batch(built) -> None:
    packed = kernels.pack_int4(weight(19, 64))
    assert kernels.int4_mm(torch.empty(0, 64), packed).shape == (0, 19)


def test_non_contiguous_activations(built) -> None:
    packed = kernels.pack_int4(weight(40, 64))
    x = activations(64, 5, torch.float32).T  # (5, 64), strided
    assert torch.equal(kernels.int4_mm(x, packed), kernels.int4_mm(x.contiguous(), packed))


#: Row counts the AMX tiles are checked at: fewer than the 32 they take (VNNI's tiles), whole
#: groups of 16 and a group's tails, two passes of rows (K = 1536: 160 rows a pass) and a
#: prompt's 512.
AMX_ROWS = (1, 9, 31, 32, 33, 47, 48, 64, 100, 161, 512)


def amx_outputs(path: str) -> list[torch.Tensor]:
    """The products the AMX tiles take, on `path`, at every row count of AMX_ROWS with 1
    thread and 2: int4_mm on three shapes (a tail tile, one block, an odd block count) of an
    asymmetric weight (fp16 d and m), a symmetric one (no m; d = 10000 among them) and the
    same with m held (fp32: 8 d past fp16), each also with fp32 scales; int8_mm with a scale
    per row, per 32 and per 16 (half blocks), fp32 and fp16 scales, and Q6_K's sub-scales."""
    cases = []
    for n, k in [(77, 1536), (19, 32), (40, 96)]:
        x = activations(AMX_ROWS[-1], k, torch.float32)
        weights = [
            kernels.pack_int4(weight(n, k)),
            kernels.pack_int4(symmetric_weight(n, k)),
            held_m(symmetric_weight(n, k)),
        ]
        weights += [
            kernels.PackedInt4(p.qs, p.d.float(), None if p.m is None else p.m.float(), p.n)
            for p in weights
        ]
        cases += [(kernels.int4_mm, x, (p,), {}) for p in weights]
    x = activations(AMX_ROWS[-1], 1536, torch.float32)
    for block in SCALE_BLOCKS:
        q, scales, _ = int8_weight(77, 1536, block)
        cases += [(kernels.int8_mm, x, (q, s), {}) for s in (scales, scales.half())]
    q6 = int8_blocks(synthetic_tensor(Q6_K, 37, 768), Q6_K)
    x6 = activations(AMX_ROWS[-1], 768, torch.float32)
    extra = {"d_super": q6.super_scales}
    cases.append((kernels.int8_mm, x6, (kernels.pack_q6(q6.q), q6.scales), extra))
    outputs = []
    for threads in (1, 2):
        with torch_threads(threads):
            for op, x, weights, extra in cases:
                outputs += [op(x[:m], *weights, path, **extra) for m in AMX_ROWS]
    return outputs


def test_the_amx_tiles_model_gives_the_vnni_bits(built, tmp_path) -> None:
    """int4_mm's and int8_mm's "amx" path on the kernels' software model of the tile unit
    (QINFER_AMX=emulate, in a fresh process; amx.h): the tiles' layout, strides, padding rows,
    sets, half blocks and block order give the VNNI tiles' bits on every case of
    `amx_outputs`. (A model with TDPBUUD's unsigned A fails it.)"""
    if "vnni" not in kernels.paths():
        pytest.skip(f"the tiles' fp32 steps need the vnni path (this CPU has {kernels.paths()})")
    tests = str(Path(__file__).parent)
    env = {"QINFER_AMX": "emulate", "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    call = "__import__('test_int_dot_kernels').amx_outputs('amx')"
    assert_vnni_bits(in_fresh_process(env, tmp_path, call))


def test_the_amx_tiles_give_the_vnni_bits(built) -> None:
    """The same on this CPU's tile unit (AMX-INT8 and Linux's leave to use it)."""
    if "amx" not in kernels.paths():
        pytest.skip(f"this CPU has no amx path (it has {', '.join(kernels.paths())})")
    assert_vnni_bits(amx_outputs("amx"))


def assert_vnni_bits(outputs: list[torch.Tensor]) -> None:
    """`outputs` (`amx_outputs` on "amx") are the VNNI path's, case by case, bit for bit."""
    for i, (a, b) in enumerate(zip(outputs, amx_outputs("vnni"), strict=True)):
        assert torch.equal(a, b), f"case {i // len(AMX_ROWS)}, {AMX_ROWS[i % len(AMX_ROWS)]} rows"


def test_amx_is_a_path_where_the_tiles_run_and_else_refused(built, tmp_path) -> None:
    """With the model, "amx" is a path and the automatic one, and every dot product takes it
    (the ops without tiles on VNNI's code, the same bits); QINFER_AMX=off removes it; where it
    is missing, asking for it is refused in one line naming what it needs."""
    if "vnni" not in kernels.paths():
        pytest.skip(f"the amx path needs the vnni path (this CPU has {kernels.paths()})")
    packed = kernels.pack_int4(weight(40, 96))
    q, scales = torch.randint(-128, 128, (40, 96), dtype=torch.int8), torch.rand(40, 3)
    x = activations(64, 96, torch.float32)
    call = (
        "(kernels.paths(), kernels.auto_path(), "
        "torch.ops.qinfer.int4_groups_mm(inputs[0], *inputs[1:4], 40, 'amx'), "
        "torch.ops.qinfer.int8_blocks_mm(inputs[0], inputs[4], inputs[5], 'amx'), "
        "torch.ops.qinfer.quantize_q8_1(inputs[0], 'amx'))"
    )
    fields = (x, packed.qs, packed.d, packed.m, q, scales)
    paths, auto, groups, blocks, quantized = in_fresh_process(
        {"QINFER_AMX": "emulate"}, tmp_path, call, *fields
    )
    assert paths[-2:] == ("vnni", "amx") and auto == "amx"
    assert torch.equal(groups, kernels.int4_groups_mm(x, packed, "vnni"))
    assert torch.equal(blocks, kernels.int8_blocks_mm(x, q, scales, "vnni"))
    for got, want in zip(quantized, torch.ops.qinfer.quantize_q8_1(x, "vnni"), strict=True):
        assert torch.equal(got, want)
    assert "amx" not in in_fresh_process({"QINFER_AMX": "off"}, tmp_path, "kernels.paths()")
    if "amx" not in kernels.paths():
        assert (
            "int4_mm: path 'amx' needs VNNI's and AMX-TILE/AMX-INT8 with Linux's leave to use "
            "the tiles, which this CPU lacks"
        ) in _error(lambda: kernels.int4_mm(x, packed, "amx"))


def _error(call) -> str:
    with pytest.raises(RuntimeError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message.strip(), message
    return message


def test_bad_inputs_name_the_tensor(built) -> None:
    groups = weight(16, 64)
    packed = kernels.pack_int4(groups)
    qs, d, m = packed.qs, packed.d, packed.m

    def op(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.ops.qinfer.int4_mm(*tensors, 16)

    x = torch.randn(2, 64)
    assert "x must be torch.float32 or torch.bfloat16, got torch.float64" in _error(
        lambda: kernels.int4_mm(x.double(), packed)
    )
    assert "x's K must be a positive multiple of 32, got shape (2, 40)" in _error(
        lambda: kernels.int4_mm(torch.randn(2, 40), packed)
    )
    assert "x must be 2-D" in _error(lambda: kernels.int4_mm(torch.randn(64), packed))
    tiles = "(G, K/32 * 256) for x's K = 96 and n = 16 columns in tiles of 16, G = 1"
    assert f"qs must have shape (1, 768), {tiles}, got (1, 512)" in _error(
        lambda: kernels.int4_mm(torch.randn(2, 96), packed)
    )
    assert "qs must be torch.uint8, got torch.int32" in _error(lambda: op(x, qs.int(), d, m))
    assert "d must have shape (1, 32)" in _error(lambda: op(x, qs, d[:, :16], m))
    assert "n (the weight's columns) must be >= 0, got -1" in _error(
        lambda: torch.ops.qinfer.int4_mm(x, qs, d, m, -1)
    )
    assert "qs must have shape (2, 512)" in _error(
        lambda: torch.ops.qinfer.int4_mm(x, qs, d, m, 17)
    )
    assert "d must be torch.float16 or torch.float32, got torch.bfloat16" in _error(
        lambda: op(x, qs, d.bfloat16(), m)
    )
    assert "m must be torch.float16, got torch.float32" in _error(lambda: op(x, qs, d, m.float()))
    assert "path must be auto, scalar, avx2, vnni or amx, got 'fast'" in _error(
        lambda: kernels.int4_mm(x, packed, "fast")
    )
    pack = torch.ops.qinfer.pack_int4
    assert "q must be torch.uint8, got torch.int32" in _error(
        lambda: pack(groups.q.int(), groups.scales, groups.zeros)
    )
    assert "q must hold values 0..15" in _error(
        lambda: pack(groups.q | 16, groups.scales, groups.zeros)
    )
    assert "zeros must have shape (16, 2)" in _error(
        lambda: pack(groups.q, groups.scales, groups.zeros[:8])
    )
    assert "q's K must be a positive multiple of 32" in _error(
        lambda: pack(groups.q[:, :48], groups.scales, groups.zeros)
    )


def test_groups_of_other_sizes_are_refused(built) -> None:
    with pytest.raises(ValueError, match="groups of 32, got groups of 64"):
        kernels.pack_int4(quantize_int4(torch.randn(16, 128), 64))


# ------------------------------------------------------------- int8 rows and int8 blocks

#: int8_mm's weight scales: one per row (0), or one per block of 32 or 16 input columns (GGUF's
#: Q8_0 and Q5_0, Q6_K).
SCALE_BLOCKS = (0, 32, 16)


def int8_weight(n: int, k: int, block: int = 0, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random int8 q (N, K) with -128 and 127 among them, fp32 scales of very different
    magnitude, one per row (block 0: (N,)) or per block of `block` columns (N, K / block), and
    the weight they make, (N, K) float64."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    shape = (n,) if block == 0 else (n, k // block)
    magnitudes = torch.logspace(-4, -1, shape[0] * (1 if block == 0 else k // block))
    scales = magnitudes[torch.randperm(len(magnitudes), generator=generator)].view(shape)
    per_column = scales[:, None] if block == 0 else scales.repeat_interleave(block, 1)
    return q, scales, q.double() * per_column.double()


@pytest.mark.parametrize("block", SCALE_BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_exact_from_the_same_quantized_activations(path, dtype, n, k, block) -> None:
    """Against float64 from the kernel's own int8 activations: the integer dots are exact,
    so only fp32's sums of the blocks and the scales differ."""
    q, scales, w = int8_weight(n, k, block)
    x = activations(6, k, dtype)
    qx, dx, _ = kernels.quantize_q8_1(x, path)
    xq = qx.double() * dx.double().repeat_interleave(32, 1)
    y = kernels.int8_mm(x, q, scales, path)
    assert y.dtype == torch.float32 and y.shape == (6, n)
    bound = (k // (block or 32) + 8) * 2 * FP32_UNIT * (xq.abs() @ w.abs().T)
    assert ((y.double() - xq @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("block", SCALE_BLOCKS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_within_int8_rounding_of_float_linear(path, n, k, block) -> None:
    q, scales, w = int8_weight(n, k, block)
    x = activations(6, k, torch.float32)
    _, dx, _ = kernels.quantize_q8_1(x, path)
    rounding = 0.5 * dx.double().repeat_interleave(32, 1) @ w.abs().T
    slack = (k // (block or 32) + 8) * 4 * FP32_UNIT * (x.double().abs() @ w.abs().T)
    error = (kernels.int8_mm(x, q, scales, path).double() - F.linear(x.double(), w)).abs()
    assert (error <= rounding + slack).all()
    assert error.max() > 0


@pytest.mark.parametrize("block", SCALE_BLOCKS)
@pytest.mark.parametrize(("n", "k"), [(77, 576), (19, 32), (50, 96)])
def test_int8_row_is_the_same_in_any_batch(path, n, k, block) -> None:
    """As int4_mm's: row i of an M-row call is the 1-row call's, bit for bit, for every M of
    ROW_COUNTS, with 1 thread or all of them (an odd block count: the half pair at the end)."""
    q, scales, _ = int8_weight(n, k, block)
    x = activations(ROW_COUNTS[-1], k, torch.float32)
    alone = torch.cat([kernels.int8_mm(x[i : i + 1], q, scales, path) for i in range(len(x))])
    with torch_threads(2):
        for m in ROW_COUNTS:
            assert torch.equal(kernels.int8_mm(x[:m], q, scales, path), alone[:m]), f"M = {m}"
    with torch_threads(1):
        assert torch.equal(kernels.int8_mm(x, q, scales, path), alone)


@pytest.mark.parametrize("block", SCALE_BLOCKS)
@pytest.mark.parametrize("rows", [1, 5, 9, 33])
def test_int8_paths_give_the_same_bits(built, block, rows) -> None:
    """Every path sums an output's blocks in one order (a lane of a staged tile is a column),
    so scalar, AVX2 and VNNI agree bit for bit, at 77 columns (a last tile of 13)."""
    q, scales, _ = int8_weight(77, 1536, block)
    x = activations(rows, 1536, torch.float32)
    results = [kernels.int8_mm(x, q, scales, name) for name in kernels.paths()]
    for name, other in zip(kernels.paths()[1:], results[1:], strict=True):
        assert torch.equal(other, results[0]), name
    assert kernels.int8_mm(torch.empty(0, 1536), q, scales).shape == (0, 77)


def test_int8_bad_inputs_name_the_tensor(built) -> None:
    q, scales, _ = int8_weight(16, 64)
    x = torch.randn(2, 64)
    assert "int8_mm: q must have shape (16, 96), (N, K) for x's K = 96" in _error(
        lambda: kernels.int8_mm(torch.randn(2, 96), q, scales)
    )
    assert "int8_mm: q must be torch.int8, got torch.uint8" in _error(
        lambda: kernels.int8_mm(x, q.view(torch.uint8), scales)
    )
    per = "per row, or (16, 2) or (16, 4) per block of 32 or 16, for q's N and x's K = 64"
    assert f"int8_mm: scales must have shape (16,) {per}, got (8,)" in _error(
        lambda: kernels.int8_mm(x, q, scales[:8])
    )
    assert f"{per}, got (16, 8)" in _error(lambda: kernels.int8_mm(x, q, torch.ones(16, 8)))
    kinds = "torch.float16, torch.float32 or (with d_super) torch.int8"
    assert f"int8_mm: scales must be {kinds}, got torch.bfloat16" in _error(
        lambda: kernels.int8_mm(x, q, scales.bfloat16())
    )
    assert "int8_mm: path must be auto, scalar, avx2, vnni or amx, got 'fast'" in _error(
        lambda: kernels.int8_mm(x, q, scales, "fast")
    )
