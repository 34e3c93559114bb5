"""The Linear family's kernels: each against the fp32 weight it claims to hold.

References: `gguf.quants.dequantize` for GGUF blocks kept as int4 groups and int8 blocks (bit
for bit), and `F.linear` in fp32 over `dequantize()` for every kernel (tests/linear_layers.py).
Tolerances for bf16 kernels come from bf16's 8-bit mantissa: the activations are rounded to
bf16 before the kernel (the reference gets the same rounded activations) and the output is
rounded to bf16, a relative error of 2^-9 per value, plus a different summation order; 1% of
the output's scale bounds both. Also: quantizing, and parts fused into one projection.
"""

from __future__ import annotations

import re

import gguf
import pytest
import torch
import torch.nn.functional as F
from checkpoints import int4_kind
from gguf_files import synthetic_tensor
from linear_layers import activations, assert_matches_dequantized, int8_blocks_of, weight

import qinfer
from qinfer import kernels
from qinfer.core.errors import WeightsError
from qinfer.linear import (
    ConcatLinear,
    DenseLinear,
    Int4BlockLinear,
    Int4Linear,
    Int8BlockLinear,
    Int8Blocks,
    Int8Linear,
    make_linear,
    quantize_int4,
    quantize_int8,
    quantize_int8_blocks,
)
from qinfer.weights import gguf_quants
from qinfer.weights.gguf import REROUNDED_TYPES, open_gguf
from qinfer.weights.gguf_quants import INT4_GROUPS, INT8_BLOCKS, int4_groups, int8_blocks

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


@pytest.mark.parametrize("qtype", [*INT4_GROUPS, *INT8_BLOCKS], ids=lambda t: t.name)
def test_a_tensor_converts_in_pieces_as_whole(qtype, monkeypatch):
    """A large tensor's blocks convert CONVERT_BYTES of rows at a time (a bounded peak at
    load): the fields are those of the whole, a last piece short of the others included, and
    a read-only map is taken as it is."""
    data = synthetic_tensor(qtype, rows=37, columns=512)
    convert = int4_groups if qtype in INT4_GROUPS else int8_blocks
    whole = convert(data, qtype)
    monkeypatch.setattr(gguf_quants, "CONVERT_BYTES", data.shape[1] * 5)  # 5 rows a piece
    data.flags.writeable = False
    pieces = convert(data, qtype)
    for a, b in zip(vars(whole).values(), vars(pieces).values(), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


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
    # the file's scales as they are: fp16 (Q8_0, Q5_0), int8 sub-scales per 16 (Q6_K, with
    # an fp16 super-scale per 256)
    sub = qtype == gguf.GGMLQuantizationType.Q6_K
    assert layer.scales.dtype == (torch.int8 if sub else torch.float16)
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
    """int4 groups of 32 in qinfer's layout: the weight d q + m (the scales and zeros as
    given, fp16 values held in fp16, not re-rounded to the activations' dtype) times the
    activations as they are, fp32
    products and sums only, on every path; each row alike at any row count, bit for bit;
    the layer's tiles, rows and int8_dot path read the same packed weight."""
    groups = quantize_int4(weight(201, k), 32)  # odd: a last column of its own in 2-col tiles
    w = Int4BlockLinear(groups, None, dtype)
    assert w.d.dtype == torch.float16 and torch.equal(w.packed.scales().float(), groups.scales)
    assert w.m is not None  # quantize_int4's min/max groups are not symmetric: m held
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


def test_a_q4_0_layer_holds_no_m_and_keeps_every_bit(int8_dot_built, monkeypatch):
    """Q4_0 holds d and the nibbles only (18 bytes a block, as the file; 20 with m held):
    every path at 1..9, 16, 33 and 512 rows, the rows, the dequantized weight (the file's,
    bit for bit) and the groups are those of the same layer with its m = -8 d held."""
    data = synthetic_tensor(gguf.GGMLQuantizationType.Q4_0, rows=67, columns=288)
    groups = int4_groups(data, gguf.GGMLQuantizationType.Q4_0)
    qs, d, m = torch.ops.qinfer.pack_int4(groups.q, groups.scales, groups.zeros)
    held = kernels.PackedInt4(qs, *kernels.fp16_if_exact(d, m), groups.q.shape[0])
    layers = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = Int4BlockLinear(groups, None, dtype)
        with monkeypatch.context() as patch:  # the layer as it was: m held
            patch.setattr(kernels, "pack_int4", lambda _: held)
            layers[dtype] = w, Int4BlockLinear(groups, None, dtype)
    w, old = layers[torch.float32]
    assert w.m is None and old.m.dtype == torch.float16
    # 67 columns in 5 tiles of 16: 80 columns' blocks (13 of them padding)
    assert (w.nbytes, old.nbytes) == (80 * 9 * 18, 80 * 9 * 20)
    reference = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_0))
    assert torch.equal(w.dequantize(), reference) and torch.equal(old.dequantize(), reference)
    ids = torch.tensor([[0, 66], [31, 5]])
    assert torch.equal(w.rows(ids), old.rows(ids))
    new_groups, old_groups = w.groups(), old.groups()
    for field in ("q", "scales", "zeros"):
        assert torch.equal(getattr(new_groups, field), getattr(old_groups, field)), field
    for dtype, (w, old) in layers.items():
        x = activations(512, 288, dtype)
        for path in w.paths():
            for rows in (*range(1, 10), 16, 33, 512):
                got, want = w.run_path(path, x[:rows]), old.run_path(path, x[:rows])
                assert torch.equal(got, want), (dtype, path, rows)


@pytest.mark.parametrize("block", [32, 16])
def test_int8_blocks_kernel_on_gathered_rows_gives_the_whole_products_bits(int8_dot_built, block):
    """ids (M, k): row r against the weight's rows ids[r] alone (the head's exact recompute of
    its top logits), each output the bits the whole product gives it, repeats and any order
    included, on every path and at any row count."""
    w = Int8BlockLinear(int8_blocks_of(weight(200, 256), block), None, torch.float32)
    x = activations(9, 256, torch.float32)
    ids = torch.randint(0, 200, (9, 37))
    ids[0, :3] = torch.tensor([199, 0, 199])
    for path in kernels.paths():
        whole = kernels.int8_blocks_mm(x, w.q, w.scales, path)  # (9, 200)
        for rows in (1, 5, 9):
            got = kernels.int8_blocks_mm(x[:rows], w.q, w.scales, path, ids=ids[:rows])
            assert torch.equal(got, whole[:rows].gather(1, ids[:rows])), (path, rows)
    none = kernels.int8_blocks_mm(x, w.q, w.scales, ids=ids[:, :0])
    assert none.shape == (9, 0)


def test_top_k_ids_picks_each_rows_highest_as_torch_topk(int8_dot_built):
    """Each row's k highest columns in ascending order: torch.topk's set; of equal logits the
    lower columns, NaN below -inf; a row's k whatever the other rows are."""
    logits = torch.randn(6, 5000) * 4
    got = kernels.top_k_ids(logits, 256)
    assert torch.equal(got, logits.topk(256, dim=-1).indices.sort(-1).values)
    for r in range(6):
        assert torch.equal(kernels.top_k_ids(logits[r : r + 1], 256), got[r : r + 1])
    ties = torch.zeros(3, 40)
    ties[0, 20:] = 1.0  # twenty equal highest: the first four of them
    ties[1, :] = float("-inf")
    ties[1, 7] = float("nan")
    ties[2, 30] = float("nan")
    assert kernels.top_k_ids(ties, 4).tolist() == [[20, 21, 22, 23], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert kernels.top_k_ids(ties, 40)[0].tolist() == list(range(40))
    for k in (0, 41):
        with pytest.raises(RuntimeError, match=f"k must lie in 1..40 .logits' columns., got {k}"):
            kernels.top_k_ids(ties, k)
    with pytest.raises(RuntimeError, match="logits must be torch.float32 .R, N."):
        kernels.top_k_ids(ties.double(), 4)


def test_int8_blocks_kernel_names_a_bad_argument_in_one_line(int8_dot_built):
    q, d = torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 2)
    with pytest.raises(RuntimeError, match=r"d must have shape \(N, K/32\) or \(N, K/16\)"):
        kernels.int8_blocks_mm(torch.zeros(1, 64), q, torch.zeros(4, 3))
    with pytest.raises(RuntimeError, match="q must be torch.int8, got torch.uint8"):
        kernels.int8_blocks_mm(torch.zeros(1, 64), q.view(torch.uint8), d)
    with pytest.raises(RuntimeError, match=r"ids must lie in 0..3 \(q's rows\), got 4"):
        kernels.int8_blocks_mm(torch.zeros(1, 64), q, d, ids=torch.tensor([[0, 4]]))
    with pytest.raises(RuntimeError, match=r"ids must be torch.int64 \(M, k\) on the CPU"):
        kernels.int8_blocks_mm(torch.zeros(2, 64), q, d, ids=torch.tensor([[0, 1]]))
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


def test_quantize_int4_rounds_scales_and_mins_to_fp16_within_its_range():
    """Scales and mins are fp16 values (held in 2 bytes by the kernels), q rounded against
    them; a weight past fp16's range keeps fp32 ones, still within half a step."""
    w = weight()
    groups = quantize_int4(w, 32)
    mins = groups.zeros - 8 * groups.scales
    assert torch.equal(groups.scales.half().float(), groups.scales)
    assert torch.equal(mins.half().float(), mins)
    huge = quantize_int4(w * 1e7, 32)
    assert not torch.equal(huge.scales.half().float(), huge.scales)
    step = huge.scales.repeat_interleave(32, dim=1)
    assert ((huge.dequantize() - w * 1e7).abs() <= step / 2 * (1 + 1e-5)).all()


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


@pytest.mark.parametrize("qtype", sorted(REROUNDED_TYPES))
def test_the_other_gguf_blocks_become_int8_blocks_within_half_a_block_step(qtype):
    """Q5_1, Q2_K, Q3_K, Q5_K re-rounded as the loader does: int8 blocks of 32 (the
    kernels' kind), each value within half of its block's step (max|w| / 127)."""
    data = synthetic_tensor(qtype, rows=8, columns=256)
    exact = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    blocks = quantize_int8_blocks(exact)
    assert blocks.block_size == 32 and blocks.q.shape == exact.shape
    step = exact.view(8, 8, 32).abs().amax(-1) / 127  # (rows, blocks)
    error = (blocks.dequantize() - exact).view(8, 8, 32).abs()
    assert (error <= step[..., None] / 2 * (1 + 1e-5)).all()  # up to fp32 rounding


def test_a_q5_1_file_loads_its_projections_as_int8_blocks(tmp_path):
    """The loader's way for those types: a Q5_1 file's projections become `Int8BlockLinear`
    (on the kernels' paths, as Q8_0's), within half a block step of the file's values."""
    from checkpoints import build_checkpoint
    from gguf_files import write_gguf_model

    reference = build_checkpoint(tmp_path / "hf", "qwen3")
    path = write_gguf_model(reference, tmp_path / "m.gguf", "qwen3", gguf.GGMLQuantizationType.Q5_1)
    kept = qinfer.load_model(path, device="cpu").layers[0].mlp.down
    exact = qinfer.load_model(path, device="cpu", dtype="float32").layers[0].mlp.down
    assert isinstance(kept, Int8BlockLinear)
    want = exact.dequantize()
    step = want.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / 127
    error = (kept.dequantize() - want).unflatten(-1, (-1, 32)).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all()
