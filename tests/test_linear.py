"""The Linear family: each kernel path against the fp32 weight it claims to hold.

References: `gguf.quants.dequantize` for GGUF blocks kept as int4 groups (bit for bit), and
`F.linear` in fp32 over `dequantize()` for every kernel. Tolerances for bf16 paths come from
bf16's 8-bit mantissa: the activations are rounded to bf16 before the kernel (the reference
gets the same rounded activations) and the output is rounded to bf16, a relative error of
2^-9 per value, plus a different summation order; 1% of the output's scale bounds both.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from checkpoints import int4_kind
from gguf_files import synthetic_tensor

from qinfer import kernels
from qinfer.bench.linear_paths import path_table
from qinfer.core.errors import ConfigError, WeightsError
from qinfer.linear import (
    ConcatLinear,
    DenseLinear,
    Int4BlockLinear,
    Int4Linear,
    Int8BlockLinear,
    Int8Blocks,
    Int8Linear,
    Linear,
    choose,
    make_linear,
    paths,
    quantize_int4,
    quantize_int8,
)
from qinfer.linear.choose import choose_paths
from qinfer.linear.compute import cpu_class
from qinfer.linear.grouped import StackedDenseLinear
from qinfer.linear.int4 import _cpu_block_rows
from qinfer.weights.gguf import INT8_ROW_TYPES, open_gguf
from qinfer.weights.gguf_quants import INT4_GROUPS, INT8_BLOCKS, int4_groups, int8_blocks


def weight(rows: int = 48, columns: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.05


def activations(rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(7)).to(dtype)


def assert_matches_dequantized(w, x: torch.Tensor, tolerance: float | None = None) -> None:
    """w(x) against F.linear in fp32 over w.dequantize(), the same activations; tolerance:
    of the output's scale (default: 1e-5 for fp32 activations, 1e-2 for bf16)."""
    expected = F.linear(x.float(), w.dequantize(), None if w.bias is None else w.bias.float())
    got = w(x)
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = expected.abs().max().item()
    if tolerance is None:
        tolerance = 1e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=tolerance * scale)


# ------------------------------------------------------------- GGUF blocks kept as int4


@pytest.mark.parametrize("qtype", list(INT4_GROUPS), ids=lambda t: t.name)
def test_int4_groups_of_gguf_blocks_dequantize_bit_identically(qtype):
    data = synthetic_tensor(qtype, rows=32, columns=512)
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    groups = int4_groups(data, qtype)
    assert groups.group_size == 32
    assert torch.equal(groups.dequantize(), reference)
    # ... and as the CPU kernel multiplies by them (fp32 activations: no rounding of scales)
    assert torch.equal(Int4Linear(groups, None, torch.float32).dequantize(), reference)


@pytest.mark.parametrize("qtype", list(INT8_BLOCKS), ids=lambda t: t.name)
def test_int8_blocks_of_gguf_blocks_dequantize_bit_identically(qtype):
    """Q8_0, Q5_0 (blocks of 32) and Q6_K (16) as int8 with their own scales: the file's
    values exactly, in `dequantize`, in embedding rows and in the layer's tiles."""
    data = synthetic_tensor(qtype, rows=32, columns=512)
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    blocks = int8_blocks(data, qtype)
    assert blocks.block_size == (16 if qtype == gguf.GGMLQuantizationType.Q6_K else 32)
    assert torch.equal(blocks.dequantize(), reference)
    layer = Int8BlockLinear(blocks, None, torch.float32)
    assert torch.equal(layer.dequantize(), reference)
    ids = torch.tensor([[5, 0, 31]])
    assert torch.equal(layer.rows(ids), reference[ids])
    assert torch.equal(layer._dequantize_rows(8, 24, torch.float32), reference[8:24])


def test_smollm2_projections_keep_their_q4_1_bits(smollm2_reader):
    """Every Q4_1 projection of one layer (q/k rows unpermuted as for the dense path)."""
    from gguf_files import smollm2_path

    _, weights = open_gguf(smollm2_path(), lambda config, quantized, exact: torch.bfloat16, "cpu")
    assert weights.keep_types
    for name in [n for n in weights.names() if n.startswith("model.layers.3.")]:
        if not name.endswith("proj.weight"):
            continue
        kernel = Int4Linear(weights._stored(name), None, torch.float32)
        assert torch.equal(kernel.dequantize(), weights._read(name)), name


# ------------------------------------------------------------------ kernel paths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int4_kernel_matches_its_dequantized_weight(dtype, rows):
    w = Int4Linear(quantize_int4(weight(), 32), torch.randn(48).to(dtype), dtype)
    assert_matches_dequantized(w, activations(rows, 256, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_kernel_matches_its_dequantized_weight(dtype, rows):
    w = Int8Linear(quantize_int8(weight()), None, dtype)
    assert_matches_dequantized(w, activations(rows, 256, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block", [32, 16])
def test_int8_blocks_kernel_multiplies_the_exact_weight(int8_dot_built, block, dtype):
    """The compiled kernel: the exact weight times the activations (bf16 widened exactly),
    fp32 sums only, whatever the path; each row alike at any row count, bit for bit."""
    w = Int8BlockLinear(int8_blocks_of(weight(200, 256), block), None, dtype)
    x = activations(20, 256, dtype)
    expected = x.double() @ w.dequantize().double().T
    for path in kernels.paths():
        got = kernels.int8_blocks_mm(x, w.q, w.scales, path)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
        for rows in (1, 3, 5, 17):  # tiles of 4 rows, one column or two
            assert torch.equal(kernels.int8_blocks_mm(x[:rows], w.q, w.scales, path), got[:rows])
    assert_matches_dequantized(w, x, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
# 8 blocks; 5, 3 and 18 (the kernel loads 4 at once; 18 is SmolLM2's 576: two chunks of m)
@pytest.mark.parametrize("k", [256, 160, 96, 576])
def test_int4_blocks_kernel_multiplies_the_exact_weight(int8_dot_built, dtype, k):
    """int4 groups of 32 in qinfer's layout: the weight d q + m (the fp32 scales and zeros,
    not re-rounded to the activations' dtype) times the activations as they are, fp32
    products and sums only, on every path; each row alike at any row count, bit for bit;
    the layer's tiles, rows and int8_dot path read the same packed weight."""
    groups = quantize_int4(weight(201, k), 32)  # odd: a last column of its own in 2-col tiles
    w = Int4BlockLinear(groups, None, dtype)
    assert torch.equal(w.d, groups.scales)  # fp32, as given
    exact = (groups.q.double() - 8) * groups.scales.double().repeat_interleave(
        32, 1
    ) + groups.zeros.double().repeat_interleave(32, 1)
    torch.testing.assert_close(w.dequantize().double(), exact, rtol=0, atol=1e-6)
    x = activations(20, k, dtype)
    expected = x.double() @ w.dequantize().double().T
    for path in kernels.paths():
        got = kernels.int4_groups_mm(x, w.packed, path)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)
        for rows in (1, 3, 5, 17):  # tiles of 4 rows, one column or two
            assert torch.equal(kernels.int4_groups_mm(x[:rows], w.packed, path), got[:rows])
    assert_matches_dequantized(w, x, 1e-5 if dtype == torch.float32 else 1e-2)
    ids = torch.tensor([[0, 199], [57, 3]])
    assert torch.equal(w.rows(ids), w.dequantize()[ids])
    assert torch.equal(w.groups().q, groups.q)
    for path in ("fp32_tiles", "int8_dot"):
        torch.testing.assert_close(w.run_path(path, x).double(), expected, rtol=0.02, atol=0.05)


def test_int8_blocks_kernel_names_a_bad_argument_in_one_line(int8_dot_built):
    q, d = torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 2)
    with pytest.raises(RuntimeError, match=r"d must have shape \(N, K/32\) or \(N, K/16\)"):
        kernels.int8_blocks_mm(torch.zeros(1, 64), q, torch.zeros(4, 3))
    with pytest.raises(RuntimeError, match="q must be torch.int8, got torch.uint8"):
        kernels.int8_blocks_mm(torch.zeros(1, 64), q.view(torch.uint8), d)
    with pytest.raises(WeightsError, match="int8 blocks of 8 columns are not one of 32, 16"):
        Int8BlockLinear(Int8Blocks(q, torch.zeros(4, 8)), None, torch.float32)
    with pytest.raises(WeightsError, match="int8 blocks need a multiple of 32 input columns"):
        Int8BlockLinear(Int8Blocks(q[:, :48], torch.zeros(4, 3)), None, torch.float32)


def test_int8_blocks_take_fp16_activations(int8_dot_built):
    """An fp16 model on CPU (allowed) widens its activations for the kernel."""
    w = Int8BlockLinear(int8_blocks_of(weight(48, 256), 32), None, torch.float16)
    assert_matches_dequantized(w, activations(3, 256, torch.float16), 1e-2)


def test_int8_blocks_without_the_compiled_kernel_take_torchs_on_a_row_copy(monkeypatch):
    """No compiler here: one warning naming why, torch's int8 kernel on a copy re-rounded
    to one scale per row (the speed of before), embedding rows still exact."""
    from qinfer.linear import int8_blocks

    reason = "no C++ compiler (c++) to build the qinfer_kernels library"
    monkeypatch.setattr(int8_blocks.kernels, "available", lambda: reason)
    monkeypatch.setattr(int8_blocks, "_warned", False)
    exact = int8_blocks_of(weight(96, 256), 32)
    x = activations(3, 256, torch.bfloat16)
    with pytest.warns(UserWarning, match=f"multiply as int8 rows .*: {re.escape(reason)}"):
        w = Int8BlockLinear(exact, None, torch.bfloat16)  # at load, not in a step
    got = w(x)
    rows = quantize_int8(exact.dequantize())
    assert torch.equal(got, torch._weight_int8pack_mm(x, rows.q, rows.scales.bfloat16()))
    assert_matches_dequantized(w, x)
    assert torch.equal(w.rows(torch.tensor([4])), exact.dequantize()[[4]])


def test_int4_rows_not_a_multiple_of_16_are_padded():
    w = Int4Linear(quantize_int4(weight(rows=24), 64), None, torch.bfloat16)
    x = activations(3, 256, torch.bfloat16)
    assert w(x).shape == (3, 24)
    assert_matches_dequantized(w, x)


def test_batched_activations_keep_their_leading_shape():
    w = Int4Linear(quantize_int4(weight(), 32), None, torch.bfloat16)
    x = activations(6, 256, torch.bfloat16).reshape(2, 3, 256)
    torch.testing.assert_close(w(x), w(x.reshape(6, 256)).reshape(2, 3, 48), rtol=0, atol=0)


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_quantize_int4_error_is_at_most_half_a_step(group_size):
    w = weight()
    groups = quantize_int4(w, group_size)
    step = groups.scales.repeat_interleave(group_size, dim=1)
    assert ((groups.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert int(groups.q.min()) >= 0 and int(groups.q.max()) <= 15


def test_quantize_int8_error_is_at_most_half_a_step():
    w = weight()
    rows = quantize_int8(w)
    assert ((rows.dequantize() - w).abs() <= rows.scales[:, None] / 2 + 1e-7).all()


def test_int8_rows_serve_embedding_lookups():
    w = Int8Linear(quantize_int8(weight()), None, torch.bfloat16)
    ids = torch.tensor([[3, 0, 47]])
    expected = w.dequantize()[ids]  # fp32: q * scale exact
    torch.testing.assert_close(w.rows(ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "group_size, message",
    [(48, "must be one of 32, 64, 128, 256, got 48"), (64, "64 does not divide its 96 input")],
)
def test_quantize_int4_refuses_a_group_that_does_not_fit(group_size, message):
    with pytest.raises(WeightsError, match=f"cannot quantize q_proj: .*{message}"):
        quantize_int4(weight(columns=96), group_size, "q_proj")


# --------------------------------------------------------------- fused projections


def test_parts_of_one_kind_become_one_kernel():
    parts = [quantize_int4(weight(seed=s), 32) for s in range(3)]
    fused = make_linear(parts, [None] * 3, torch.bfloat16, torch.device("cpu"))
    assert isinstance(fused, int4_kind()) and fused.out_features == 144
    x = activations(2, 256, torch.bfloat16)
    alone = [int4_kind()(p, None, torch.bfloat16)(x) for p in parts]
    torch.testing.assert_close(fused(x), torch.cat(alone, -1), rtol=0, atol=0)


def test_parts_of_different_kinds_run_side_by_side():
    parts = [quantize_int4(weight(seed=0), 32), weight(seed=1), quantize_int8(weight(seed=2))]
    biases = [None, torch.ones(48), None]
    fused = make_linear(parts, biases, torch.bfloat16, torch.device("cpu"))
    assert isinstance(fused, ConcatLinear)
    assert [type(p) for p in fused.parts] == [int4_kind(), DenseLinear, Int8Linear]
    assert fused.parts[1].bias is not None and fused.parts[0].bias is None
    x = activations(3, 256, torch.bfloat16)
    bias = torch.cat([torch.zeros(48), torch.ones(48), torch.zeros(48)])
    expected = F.linear(x.float(), fused.dequantize(), bias)
    torch.testing.assert_close(fused(x).float(), expected, rtol=0, atol=1e-2)


@pytest.mark.parametrize("qtype", sorted(INT8_ROW_TYPES))
def test_the_other_gguf_blocks_become_int8_rows_within_half_a_row_step(qtype):
    data = synthetic_tensor(qtype, rows=8, columns=256)
    exact = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    rows = quantize_int8(exact)
    # Half a step, up to fp32 rounding (Q6_K values can sit exactly on a half step).
    assert ((rows.dequantize() - exact).abs() <= rows.scales[:, None] / 2 * (1 + 1e-5)).all()
    assert np.array_equal(rows.q.shape, exact.shape)


# ------------------------------------------------- paths: kernel, fp32 tiles, bf16 tiles


def int8_blocks_of(w: torch.Tensor, block: int) -> Int8Blocks:
    """w as int8 blocks of `block` columns, each block's absmax at 127 (as Q8_0 rounds)."""
    blocks = w.view(len(w), -1, block)
    scales = blocks.abs().amax(-1) / 127  # (N, K / block)
    q = torch.round(blocks / scales[..., None]).to(torch.int8).view_as(w)
    return Int8Blocks(q, scales)


def quantized(kind: str, rows: int, dtype: torch.dtype, columns: int = 256):
    w, bias = weight(rows, columns), torch.randn(rows).to(dtype)
    if kind == "int8":
        return Int8Linear(quantize_int8(w), bias, dtype)
    if kind.startswith("int8/"):
        return Int8BlockLinear(int8_blocks_of(w, int(kind.removeprefix("int8/"))), bias, dtype)
    return Int4Linear(quantize_int4(w, int(kind.removeprefix("int4/"))), bias, dtype)


@pytest.mark.parametrize("path", ["fp32_tiles", "bf16_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["int8", "int8/32", "int8/16", "int4/32", "int4/128"])
@pytest.mark.parametrize("out", [48, 200, 1000])
def test_tile_paths_match_the_dequantized_weight(monkeypatch, kind, out, dtype, path):
    """Tiles of 64 rows (so 200 and 1000 rows take several, and end in the int4 layout's
    short last block of 16 / 48 rows); the fp32 path within fp32 rounding of the reference
    when the activations are fp32, the bf16 path within bf16's."""
    monkeypatch.setattr(paths, "TILE_BYTES", 64 * 256 * 4)
    w = quantized(kind, out, dtype)
    if path not in w.paths():  # bf16 tiles: bf16 activations only
        assert (path, dtype) == ("bf16_tiles", torch.float32)
        return
    w.use_paths(path, path)
    tolerance = 1e-5 if path == "fp32_tiles" and dtype == torch.float32 else 1e-2
    for rows in (1, 40):
        assert_matches_dequantized(w, activations(rows, 256, dtype), tolerance)


def test_int4_tiles_read_the_kernels_packed_layout_on_this_cpu():
    """The layout is read back (blocks of 64 rows with AVX512, 32 with AVX2), so the tile
    paths are offered; a torch whose layout differs would turn them off here."""
    assert _cpu_block_rows() in (64, 32)
    offered = paths.PATHS if kernels.buildable() else paths.PATHS[:-1]  # int8_dot: compiled
    assert quantized("int4/32", 48, torch.bfloat16).paths() == offered


@pytest.fixture
def int8_dot_built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


def dot_kernel_output(w, x: torch.Tensor) -> torch.Tensor:
    """What the compiled kernel gives for `w`'s own weight (int4: its groups read back)."""
    if isinstance(w, Int8Linear):
        return kernels.int8_mm(x, w.q, w.scales.float())
    if isinstance(w, Int8BlockLinear):
        return kernels.int8_mm(x, w.q, w.scales)
    return kernels.int4_mm(x, kernels.pack_int4(w.groups()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["int8", "int8/32", "int8/16", "int4/32"])
@pytest.mark.parametrize("out", [48, 200])
def test_int8_dot_multiplies_the_kernels_own_weight(int8_dot_built, kind, out, dtype):
    """The int8_dot path gives the compiled kernel's output on the layer's own weight (int8
    rows and blocks as stored, int4 groups read back out of torch's packed layout), bit for bit plus
    the bias, and so lies within the activations' int8 rounding of the dequantized weight
    (test_int_dot_kernels holds the kernels to that bound)."""
    w = quantized(kind, out, dtype)
    assert "int8_dot" in w.paths()
    w.use_paths("int8_dot", "int8_dot")
    x = activations(5, 256, dtype)
    assert torch.equal(w(x), dot_kernel_output(w, x).to(dtype) + w.bias)
    assert_matches_dequantized(w, x, tolerance=2e-2)


def test_int8_dot_is_offered_where_the_kernels_take_the_weight(monkeypatch):
    assert "int8_dot" not in quantized("int4/128", 48, torch.bfloat16).paths()
    assert "int8_dot" not in quantized("int8", 48, torch.bfloat16, columns=80).paths()
    monkeypatch.setattr(kernels, "buildable", lambda: False)  # no compiler, say
    assert quantized("int4/32", 48, torch.bfloat16).paths() == (
        "kernel",
        "fp32_tiles",
        "bf16_tiles",
    )


def test_int8_dot_is_not_offered_to_fp16_activations(monkeypatch):
    monkeypatch.setattr(kernels, "buildable", lambda: True)
    assert "int8_dot" not in quantized("int8", 48, torch.float16).paths()
    assert "int8_dot" in quantized("int8", 48, torch.float32).paths()


def test_a_kernel_that_cannot_be_built_is_one_error_at_the_first_call(monkeypatch):
    monkeypatch.setattr(kernels, "buildable", lambda: True)
    monkeypatch.setattr(
        kernels, "available", lambda: "no C++ compiler (c++) to build the qinfer_kernels library"
    )
    w = quantized("int8", 48, torch.bfloat16)
    w.use_paths("int8_dot", "kernel")
    with pytest.raises(WeightsError) as error:
        w(activations(1, 256, torch.bfloat16))
    assert str(error.value) == (
        "Int8Linear (48, 256) has no int8_dot path: no C++ compiler (c++) to build the qinfer_kernels library"
    )


def test_a_forced_kind_path_applies_to_the_layers_that_have_it(monkeypatch):
    """QINFER_LINEAR_PATH=decode=int8_dot on layers of which one (int4 groups of 128) lacks
    it: the others take it, that one keeps the rule's path (no error: the path is not its)."""
    monkeypatch.setattr(choose, "bf16_matmul_is_fast", lambda device: False)
    monkeypatch.setattr(kernels, "buildable", lambda: True)
    layers = torch.nn.ModuleList(
        [quantized(kind, 48, torch.bfloat16) for kind in ("int8", "int4/32", "int4/128")]
    )
    monkeypatch.setenv(choose.ENV, "decode=int8_dot")
    choose_paths(layers)
    assert [layer.chosen["decode"] for layer in layers] == ["int8_dot", "int8_dot", "kernel"]


def test_a_failed_kernel_build_leaves_the_exact_rule(monkeypatch):
    """A compiler that cannot build the kernels (offered int8_dot, not loadable): the
    default rule takes the exact rule's paths instead of failing at the first call."""
    monkeypatch.delenv(choose.ENV, raising=False)
    monkeypatch.setattr(choose, "bf16_matmul_is_fast", lambda device: True)
    monkeypatch.setattr(kernels, "buildable", lambda: True)
    monkeypatch.setattr(kernels, "available", lambda: "the build failed")
    layers = three_layers()
    choose_paths(layers)
    assert [layer.chosen for layer in layers] == [choose.rule_paths(w, exact=True) for w in layers]
    assert "int8_dot" not in {p for layer in layers for p in layer.chosen.values()}


def test_calls_up_to_decode_max_rows_take_the_decode_path():
    w = quantized("int4/32", 200, torch.bfloat16)
    w.use_paths("kernel", "fp32_tiles")
    for rows, path in (
        (paths.DECODE_MAX_ROWS, "kernel"),
        (paths.DECODE_MAX_ROWS + 1, "fp32_tiles"),
    ):
        x = activations(rows, 256, torch.bfloat16)
        assert torch.equal(w(x), w.run_path(path, x) + w.bias), rows
    assert w.chosen == {"decode": "kernel", "prefill": "fp32_tiles"}


def three_layers() -> torch.nn.ModuleList:
    """Two int8 layers of one shape and an int4 layer, bf16 activations."""
    return torch.nn.ModuleList(
        [quantized("int8", 96, torch.bfloat16), quantized("int8", 96, torch.bfloat16)]
        + [quantized("int4/32", 48, torch.bfloat16)]
    )


@pytest.mark.parametrize(
    ("bf16_fast", "prefills"),
    [(True, ["bf16_tiles", "bf16_tiles", "kernel"]), (False, ["fp32_tiles"] * 3)],
    ids=["fast", "slow"],
)
def test_the_exact_rule_takes_the_kernel_at_decode_and_tiles_at_prefill_by_what_bf16_costs(
    monkeypatch, bf16_fast, prefills
):
    """`exact`: decode: the kernel. Prefill where bf16 is slow: fp32 tiles; where it is
    fast: bf16 tiles for int8 rows (their kernel does not block like a GEMM), the int4
    kernel."""
    monkeypatch.delenv(choose.ENV, raising=False)
    monkeypatch.setattr(choose, "bf16_matmul_is_fast", lambda device: bf16_fast)
    layers = three_layers()
    choose_paths(layers, exact=True)
    assert [layer.chosen for layer in layers] == [
        {"decode": "kernel", "prefill": prefill} for prefill in prefills
    ]


@pytest.mark.parametrize("bf16_fast", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize("same_at_any_rows", [False, True], ids=["any", "invariant"])
def test_the_default_rule_takes_int8_dot_wherever_a_layer_has_it(
    monkeypatch, bf16_fast, same_at_any_rows
):
    """Not `exact`: int8 rows, int8 blocks and int4 groups of 32 take int8_dot for both
    buckets on any CPU class, batch-invariant too (a row alike at any row count); int4 groups
    of 128 (no int8_dot) the exact rule's paths; the head keeps its kernel."""
    monkeypatch.delenv(choose.ENV, raising=False)
    monkeypatch.setattr(choose, "bf16_matmul_is_fast", lambda device: bf16_fast)
    monkeypatch.setattr(kernels, "buildable", lambda: True)
    monkeypatch.setattr(kernels, "available", lambda: None)
    kinds = ("int8", "int8/32", "int8/16", "int4/32", "int4/128")
    layers = torch.nn.ModuleList([quantized(kind, 48, torch.bfloat16) for kind in kinds])
    choose_paths(layers, same_at_any_rows=same_at_any_rows)
    dot = {"decode": "int8_dot", "prefill": "int8_dot"}
    wide = choose.rule_paths(layers[-1], exact=True)
    if same_at_any_rows:
        wide = {"decode": "kernel", "prefill": "kernel"}
    assert [layer.chosen for layer in layers] == [dot] * 4 + [wide]
    assert {layer.head_path for layer in layers} == {"kernel"}


AMX_XEON = ["avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"]


@pytest.mark.parametrize(
    ("flags", "environ", "expected"),
    [
        (AMX_XEON, {}, "amx"),
        (AMX_XEON[:-1], {}, "avx512_bf16"),
        (["avx2", "fma", "avx512f", "avx512_vnni"], {}, "avx512"),
        (["avx2", "fma"], {}, "avx2"),
        ([], {}, "default"),
        (AMX_XEON, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2"),
        (AMX_XEON, {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "avx512"),
        (AMX_XEON, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "avx512_bf16"),
        (AMX_XEON, {"ONEDNN_MAX_CPU_ISA": "ALL"}, "amx"),
        (AMX_XEON, {"ATEN_CPU_CAPABILITY": "avx2"}, "avx2"),
        (AMX_XEON, {"ATEN_CPU_CAPABILITY": "avx512"}, "amx"),
        (["avx2"], {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "avx2"),  # a cap adds nothing
    ],
)
def test_the_cpu_class_is_the_flags_capped_by_the_emulation_knobs(flags, environ, expected):
    """What decides bf16 and the prefill paths is a table of flags and ISA caps: the same
    answer in every process of a machine (a timing at load flipped it on an AMX Xeon)."""
    assert cpu_class(flags, environ) == expected


def test_an_int8_weight_past_the_tiled_size_keeps_its_kernel(monkeypatch):
    monkeypatch.delenv(choose.ENV, raising=False)
    monkeypatch.setattr(choose, "bf16_matmul_is_fast", lambda device: True)
    monkeypatch.setattr(choose, "INT8_TILED_MAX", 96 * 256 - 1)  # one element short
    layer = quantized("int8", 96, torch.bfloat16)
    choose_paths(layer, exact=True)
    assert layer.chosen == {"decode": "kernel", "prefill": "kernel"}


def test_a_layer_without_tile_paths_keeps_the_kernel(monkeypatch):
    """An int4 layout this torch packs differently: the tile paths are off, so the rule
    leaves the kernel even where bf16 is slow."""
    monkeypatch.delenv(choose.ENV, raising=False)
    monkeypatch.setattr(choose, "bf16_matmul_is_fast", lambda device: False)
    monkeypatch.setattr(Int4Linear, "_tiles_supported", lambda self: False)
    layers = three_layers()
    choose_paths(layers, exact=True)
    assert layers[0].chosen["prefill"] == "fp32_tiles"
    assert layers[2].chosen == {"decode": "kernel", "prefill": "kernel"}


def test_the_environment_overrides_the_rule(monkeypatch):
    monkeypatch.setattr(choose, "bf16_matmul_is_fast", lambda device: False)
    layers = three_layers()
    monkeypatch.setenv(choose.ENV, "prefill=bf16_tiles")
    choose_paths(layers, exact=True)
    assert layers[2].chosen == {"decode": "kernel", "prefill": "bf16_tiles"}
    monkeypatch.setenv(choose.ENV, "kernel")
    choose_paths(layers, exact=True)
    assert {p for layer in layers for p in layer.chosen.values()} == {"kernel"}
    monkeypatch.setenv(choose.ENV, "decode=fp32_tiles")  # prefill: the rule
    choose_paths(layers, exact=True)
    assert layers[0].chosen == {"decode": "fp32_tiles", "prefill": "fp32_tiles"}
    monkeypatch.setenv(choose.ENV, "prefill=fast")
    with pytest.raises(ConfigError) as error:
        choose_paths(layers, exact=True)
    assert str(error.value) == (
        "QINFER_LINEAR_PATH='prefill=fast': expected a path (kernel, fp32_tiles, bf16_tiles, "
        "int8_dot) or decode=PATH,prefill=PATH[,head=PATH] (head: kernel or int8_dot)"
    )


def test_a_forced_path_a_layer_lacks_is_one_error(monkeypatch):
    monkeypatch.setattr(kernels, "buildable", lambda: False)  # no int8_dot either
    layer = quantized("int8", 96, torch.float32)  # fp32 activations: no bf16 tiles
    monkeypatch.setenv(choose.ENV, "bf16_tiles")
    with pytest.raises(WeightsError) as error:
        choose_paths(layer)
    assert str(error.value) == (
        "Int8Linear (96, 256) has no path 'bf16_tiles' here (it has: kernel, fp32_tiles)"
    )


def test_bench_times_every_path_beside_the_one_taken(monkeypatch):
    monkeypatch.delenv(choose.ENV, raising=False)
    layers = three_layers()
    layers[2].use_paths("kernel", "fp32_tiles")
    table = path_table(layers)
    assert [(r["kind"], r["shape"], r["bucket"], r["path"]) for r in table] == [
        ("Int8Linear", (96, 256), "decode", "kernel"),
        ("Int8Linear", (96, 256), "prefill", "kernel"),
        ("Int4Linear", (48, 256, 32), "decode", "kernel"),
        ("Int4Linear", (48, 256, 32), "prefill", "fp32_tiles"),
    ]
    assert [list(r["ms"]) for r in table] == [list(layers[0].paths())] * 2 + [
        list(layers[2].paths())
    ] * 2
    assert all(0 < ms < 1e3 for r in table for ms in r["ms"].values())


def head_kinds() -> dict[str, Linear]:
    """A 1000-row bf16 head of each kind (the int4 one ends in its layout's 40-row tail)."""
    kinds = ("int8", "int8/32", "int4/32")
    heads = {kind: quantized(kind, 1000, torch.bfloat16) for kind in kinds}
    heads["dense"] = DenseLinear(weight(1000, 256).bfloat16())
    for head in heads.values():
        head.bias = None
    return heads


@pytest.mark.parametrize("kind", ["dense", "int8", "int4/32"])
def test_a_bf16_head_gives_each_row_its_top_logits_as_fp32_computes_them(kind):
    """The kernel rounds logits to bf16 (0.125 apart near 25); the 16 highest of each row
    are recomputed from the fp32 input and the exact weight: fp64 sums rounded to fp32."""
    head = head_kinds()[kind]
    if kind != "dense":
        head.use_head_path("kernel")
    x = torch.randn(5, 256) * 3
    got = head.logits(x, torch.bfloat16)
    weight = head.rows(torch.arange(1000)).double()  # as stored, exact in fp32
    exact = (x.double() @ weight.T).float()  # (5, 1000)
    top = exact.topk(8, dim=-1).indices
    assert torch.equal(got.gather(1, top), exact.gather(1, top))
    torch.testing.assert_close(got, exact, atol=0.5, rtol=1 / 128)  # the rest: bf16's


@pytest.mark.parametrize("kind", ["int8", "int8/32", "int4/32"])
def test_an_int8_dot_head_gives_each_row_its_top_logits_as_fp32_computes_them(int8_dot_built, kind):
    """The compiled kernel takes the fp32 input and writes fp32, its activations rounded
    to int8: the 16 highest of each row are still recomputed exactly, the rest lie within
    the int8 rounding (half a step of each block of 32, test_int_dot_kernels' bound)."""
    head = head_kinds()[kind]
    head.use_head_path("int8_dot")
    x = torch.randn(5, 256) * 3
    got = head.logits(x, torch.bfloat16)
    weight = head.rows(torch.arange(1000)).double()
    exact = (x.double() @ weight.T).float()
    top = exact.topk(8, dim=-1).indices
    assert torch.equal(got.gather(1, top), exact.gather(1, top))
    _, dx, _ = kernels.quantize_q8_1(x)
    rounding = 0.5 * dx.double().repeat_interleave(32, 1) @ weight.abs().T
    assert ((got.double() - exact.double()).abs() <= rounding + 1e-4).all()


def test_a_quantized_head_keeps_its_kernel_unless_int8_dot_is_forced(monkeypatch):
    """int8_dot is faster at the head but moves the KL divergence (rule_head_path): the rule
    keeps torch's kernel; QINFER_LINEAR_PATH=head=int8_dot (or int8_dot for all) takes it."""
    monkeypatch.setattr(kernels, "buildable", lambda: True)
    layers = three_layers()
    monkeypatch.delenv(choose.ENV, raising=False)
    choose_paths(layers)
    assert [layer.head_path for layer in layers] == ["kernel"] * 3
    for forced in ("head=int8_dot", "int8_dot"):
        monkeypatch.setenv(choose.ENV, forced)
        choose_paths(layers)
        assert [layer.head_path for layer in layers] == ["int8_dot"] * 3
    monkeypatch.setenv(choose.ENV, "bf16_tiles")  # a tile path is no head path: the rule's
    choose_paths(layers)
    assert [layer.head_path for layer in layers] == ["kernel"] * 3
    monkeypatch.setenv(choose.ENV, "head=bf16_tiles")
    with pytest.raises(ConfigError, match="head: kernel or int8_dot"):
        choose_paths(layers)
    with pytest.raises(WeightsError, match="has no head path 'bf16_tiles'"):
        layers[0].use_head_path("bf16_tiles")


@pytest.mark.parametrize("head_path", ["kernel", "int8_dot"])
@pytest.mark.parametrize("kind", ["int8", "int8/32", "int4/32"])
def test_a_quantized_head_gives_a_row_the_same_logits_in_any_batch(kind, head_path):
    """Even where its other calls of over 16 rows take tiles (whose GEMM blocks by rows):
    the head's first pass takes its head path (the kernel, or int8_dot) at every row count."""
    head = head_kinds()[kind]
    if head_path not in head.paths():
        pytest.skip(f"no {head_path} path here")
    head.use_paths("kernel", "bf16_tiles")
    head.use_head_path(head_path)
    x = torch.randn(40, 256)
    alone = torch.cat([head.logits(x[i : i + 1], torch.bfloat16) for i in range(len(x))])
    for rows in (1, 5, 17, 40):
        assert torch.equal(head.logits(x[:rows], torch.bfloat16), alone[:rows])


@pytest.mark.parametrize("out", [48, 64, 200, 1000])
def test_int4_rows_read_the_packed_layout_as_the_kernel_multiplies(out):
    """Rows of whole 64-row blocks and of the short last block (16 or 48 rows of pairs),
    in any order: (q - 8) * scale + zero with the stored (bf16) scales and zeros."""
    groups = quantize_int4(weight(out, 128), 32)
    layer = Int4Linear(groups, None, torch.bfloat16)
    ids = torch.randperm(out)
    scales = groups.scales.bfloat16().float().repeat_interleave(32, dim=1)
    zeros = groups.zeros.bfloat16().float().repeat_interleave(32, dim=1)
    expected = ((groups.q.float() - 8) * scales + zeros)[ids]
    assert torch.equal(layer.rows(ids.view(2, -1)).view(out, -1), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_invariant_dense_layer_gives_a_row_the_same_output_at_any_row_count(dtype):
    """fixed_rows (a batch-invariant model's dense Linears): every GEMM is FIXED_ROWS rows
    whatever the call's row count, and a row's output is its own wherever it sits: the
    same bits alone, at the start or the end of a call, across a chunk boundary. (Whole
    fp32 GEMMs of this shape differ from row count to row count on the CPUs measured.)"""
    layer = DenseLinear(weight(1024, 1024).to(dtype), torch.randn(1024).to(dtype))
    choose_paths(layer, same_at_any_rows=True)
    x = torch.randn(40, 1024).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for start, rows in ((0, 40), (0, 17), (3, 1), (15, 2), (23, 17)):
        assert torch.equal(layer(x[start : start + rows]), alone[start : start + rows])
    assert torch.equal(layer(x.view(2, 20, 1024)).view(40, -1), alone)  # leading dims kept
    choose_paths(layer)  # a model that is not batch-invariant: whole GEMMs again
    assert not layer.fixed_rows


def test_batch_invariant_experts_run_each_run_in_fixed_chunks():
    """StackedDenseLinear with fixed_rows: each expert's run of rows gets what that expert's
    rows get alone, whatever the other runs' lengths."""
    experts = StackedDenseLinear(torch.randn(4, 64, 256))
    choose_paths(experts, same_at_any_rows=True)
    x = torch.randn(30, 256)
    counts = torch.tensor([7, 0, 20, 3])
    got = experts(x, counts)
    ends = counts.cumsum(0).tolist()
    for e, (start, stop) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        for i in range(start, stop):
            alone = experts(x[i : i + 1], torch.eye(4, dtype=torch.long)[e])
            assert torch.equal(got[i : i + 1], alone)
