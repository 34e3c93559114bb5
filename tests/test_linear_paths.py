"""The Linear family's paths (kernel, fp32 tiles, bf16 tiles, int8_dot): each against the
fp32 weight it claims to hold, and the rule that picks one per layer and row count.

The reference is `F.linear` in fp32 over `dequantize()` (tests/linear_layers.py); tolerances
for bf16 paths come from bf16's 8-bit mantissa (activations and output rounded to bf16, a
relative error of 2^-9 per value, plus a different summation order: 1% of the output's scale
bounds both). Also: where each path is offered, QINFER_LINEAR_PATH, the CPU class, the bench
table, the head's logits, and batch-invariant layers.
"""

from __future__ import annotations

import pytest
import torch
from linear_layers import activations, assert_matches_dequantized, int8_blocks_of, weight

from qinfer import kernels
from qinfer.bench.linear_paths import format_path_table, path_table
from qinfer.core.errors import ConfigError, WeightsError
from qinfer.linear import (
    DenseLinear,
    Int4Linear,
    Int8BlockLinear,
    Int8Linear,
    Linear,
    choose,
    paths,
    quantize_int4,
    quantize_int8,
)
from qinfer.linear.choose import choose_paths
from qinfer.linear.compute import cpu_class
from qinfer.linear.grouped import StackedDenseLinear
from qinfer.linear.int4 import _cpu_block_rows
from qinfer.linear.logits import EXACT_TOP_INT8

# ------------------------------------------------- paths: kernel, fp32 tiles, bf16 tiles


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


def dot_kernel_output(w, x: torch.Tensor) -> torch.Tensor:
    """What the compiled kernel gives for `w`'s own weight (int4: its groups read back)."""
    if isinstance(w, Int8Linear):
        return kernels.int8_mm(x, w.q, w.scales.float())
    if isinstance(w, Int8BlockLinear):
        return kernels.int8_mm(x, w.q, w.scales, d_super=w.super_scales)
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
    of 128 (no int8_dot) the exact rule's paths; the head takes int8_dot where the layer has
    it, else its kernel."""
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
    assert [layer.head_path for layer in layers] == ["int8_dot"] * 4 + ["kernel"]


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


def test_bench_times_the_lm_heads_own_path(monkeypatch):
    """A model's quantized lm_head gets a row of its own for the head path it takes (the
    rule's: int8_dot where the kernels load), timed on the paths that compute a row alike at
    any row count."""
    monkeypatch.delenv(choose.ENV, raising=False)
    model = torch.nn.Module()
    model.lm_head = quantized("int8/32", 96, torch.float32)
    choose_paths(model)
    table = path_table(model)
    assert [r["bucket"] for r in table] == ["decode", "prefill", "head"]
    head = table[-1]
    assert head["path"] == ("int8_dot" if kernels.available() is None else "kernel")
    assert head["path"] == model.lm_head.head_path
    assert list(head["ms"]) == [p for p in model.lm_head.paths() if p in ("kernel", "int8_dot")]
    assert all(0 < ms < 1e3 for ms in head["ms"].values())
    assert f"head (1)      -> {head['path']}" in format_path_table(table)


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
    to int8: the 256 highest of each row are recomputed exactly (int8 blocks: by their exact
    kernel, the bits of its whole product; the other kinds in fp64 sums rounded to fp32), the
    rest lie within the int8 rounding (half a step of each block of 32, test_int_dot_kernels'
    bound)."""
    head = head_kinds()[kind]
    head.use_head_path("int8_dot")
    x = torch.randn(5, 256) * 3
    got = head.logits(x, torch.bfloat16)
    weight = head.rows(torch.arange(1000)).double()
    exact = (x.double() @ weight.T).float()
    if kind == "int8/32":
        head.use_head_path("kernel")
        exact = head.logits(x, torch.float32)  # the exact kernel's, within fp32 sums of fp64's
        torch.testing.assert_close(exact.double(), x.double() @ weight.T, rtol=0, atol=1e-4)
    top = exact.topk(EXACT_TOP_INT8 - 16, dim=-1).indices  # clear of the int8 pass's choice
    assert torch.equal(got.gather(1, top), exact.gather(1, top))
    _, dx, _ = kernels.quantize_q8_1(x)
    rounding = 0.5 * dx.double().repeat_interleave(32, 1) @ weight.abs().T
    assert ((got.double() - exact.double()).abs() <= rounding + 1e-4).all()
    assert (got != exact).sum() > 5 * 500  # the rest: the int8 pass's


def test_a_quantized_head_takes_int8_dot_unless_exact(monkeypatch):
    """The rule's head (rule_head_path): int8_dot by default wherever the layer has it (its
    top logits recomputed exactly), the kind's kernel with `exact`;
    QINFER_LINEAR_PATH=head=kernel forces the kernel, head=int8_dot (or int8_dot for all)
    int8_dot."""
    monkeypatch.setattr(kernels, "buildable", lambda: True)
    layers = torch.nn.ModuleList([*three_layers(), quantized("int8/32", 96, torch.bfloat16)])
    monkeypatch.delenv(choose.ENV, raising=False)
    choose_paths(layers)
    assert [layer.head_path for layer in layers] == ["int8_dot"] * 4
    choose_paths(layers, exact=True)
    assert [layer.head_path for layer in layers] == ["kernel"] * 4
    monkeypatch.setenv(choose.ENV, "head=kernel")
    choose_paths(layers)
    assert [layer.head_path for layer in layers] == ["kernel"] * 4
    for forced in ("head=int8_dot", "int8_dot"):
        monkeypatch.setenv(choose.ENV, forced)
        choose_paths(layers, exact=True)
        assert [layer.head_path for layer in layers] == ["int8_dot"] * 4
    monkeypatch.setenv(choose.ENV, "bf16_tiles")  # a tile path is no head path: the rule's
    choose_paths(layers)
    assert [layer.head_path for layer in layers] == ["int8_dot"] * 4
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
