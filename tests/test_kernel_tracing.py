"""qinfer's compiled ops as torch's tracers see them: each op's schema matches what its kernel
does (which inputs it writes), and its fake kernel (`kernels.registry.FAKE_KERNELS`) gives the
shapes and dtypes the real one returns, so that `torch.compile` and `torch.export` can
trace a graph through it (`torch.library.opcheck`, which runs the real kernel beside each
check). The ops' arithmetic is tested in test_int_dot_kernels.py, test_rms_norm_kernel.py
test_paged_decode_kernel.py, test_deltanet_kernel.py and test_lora_kernel.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from qinfer import kernels
from tests.test_paged_decode_kernel import BLOCK, case, int8_pool


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


def samples() -> dict[str, tuple]:
    """Arguments for each op, small: 3 rows of 64 inputs, 8 outputs."""
    gen = torch.Generator().manual_seed(0)
    groups = types.SimpleNamespace(
        q=torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=gen),
        scales=torch.rand(8, 2, generator=gen),
        zeros=torch.rand(8, 2, generator=gen),
        group_size=32,
    )
    packed = kernels.pack_int4(groups)
    int4 = (packed.qs, packed.d, packed.m, packed.n)
    x = torch.randn(3, 64, generator=gen)
    q8 = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=gen)
    heads = torch.randn(3, 4, 64, generator=gen)
    c = case(torch.float32, torch.bfloat16, sliding=True)
    # the gated delta rule: 2 sequences of 5 tokens, 3 heads of 16
    rule = (*(torch.randn(2, 5, 3, 16, generator=gen) for _ in range(3)), -torch.rand(2, 5, 3))
    rule += (torch.rand(2, 5, 3), torch.randn(2, 3, 16, 16, generator=gen))
    return {
        "int4_mm": (x, *int4, "auto"),
        "int4_groups_mm": (x.bfloat16(), *int4, "auto"),
        "int8_mm": (x, q8, torch.rand(8, generator=gen), "auto"),
        "int8_blocks_mm": (x, q8, torch.rand(8, 2, generator=gen), "auto"),
        "quantize_q8_1": (x, "auto"),
        "add_rms_norm": (x.clone(), x.bfloat16(), torch.rand(64), 1e-6, torch.bfloat16, "auto"),
        "heads_rms_norm": (heads, torch.rand(64), torch.rand(64), 2, 1e-6, torch.float32, "auto"),
        "rope": (heads, torch.rand(3, 32, generator=gen), torch.rand(3, 32, generator=gen)),
        # LoRA: 2 slots of rank 2 on the first of two parts of 4 and 4 outputs
        "lora_add": (
            *(torch.randn(3, 8, generator=gen), x, torch.tensor([0, 2]), torch.tensor([1, 0])),
            *(torch.randn(4, 64, generator=gen), torch.tensor([0, 0, 1, 1])),
            *([torch.randn(4, 4, generator=gen), None], [4, 4], "auto"),
        ),
        "gated_delta_recurrent": rule,
        "gated_delta_chunked": (*rule, 2),
        "paged_decode_attention": (
            *(c["q"], c["k"], c["v"], c["keys"], c["values"], c["slots"], c["positions"]),
            *(c["tables"], c["totals"], c["key_starts"], BLOCK, 20, 0.125),
        ),
    }


@pytest.mark.parametrize("name", list(samples()))
def test_each_op_traces_as_it_runs(name):
    """Schema (what the op writes), fake kernel (shapes, dtypes) and dispatch through
    AOTAutograd all agree with the op's real run."""
    op = getattr(torch.ops.qinfer, name).default
    results = torch.library.opcheck(op, samples()[name])
    assert set(results.values()) == {"SUCCESS"}, results


def test_the_decode_op_traces_over_an_int8_pool():
    """Over an int8 pool the decode op also writes the pool's scales: traced as it runs."""
    c = case(torch.float32, torch.float32, sliding=True)
    pool = int8_pool(c)
    args = (
        *(c["q"], c["k"], c["v"], pool["keys"], pool["values"], c["slots"], c["positions"]),
        *(c["tables"], c["totals"], c["key_starts"], BLOCK, 20, 0.125),
        *(pool["key_scales"], pool["value_scales"]),
    )
    results = torch.library.opcheck(torch.ops.qinfer.paged_decode_attention.default, args)
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("name", ["int4_mm", "int4_groups_mm"])
def test_int4_ops_trace_without_m(name):
    """A symmetric weight's m left out (None: Q4_0's, m = -8 d in the kernels) traces as it
    runs too."""
    x, qs, d, _, n, path = samples()[name]
    op = getattr(torch.ops.qinfer, name).default
    results = torch.library.opcheck(op, (x, qs, d, None, n, path))
    assert set(results.values()) == {"SUCCESS"}, results


def test_a_graph_of_the_ops_compiles_to_the_eager_result():
    """A decode-like chain (residual add + RMSNorm -> int4 matmul -> RoPE) through
    torch.compile, whole (fullgraph): the same values as eager, the residual updated in
    place by both."""
    gen = torch.Generator().manual_seed(1)
    groups = types.SimpleNamespace(
        q=torch.randint(0, 16, (256, 64), dtype=torch.uint8, generator=gen),
        scales=torch.rand(256, 2, generator=gen) * 0.1,
        zeros=-torch.rand(256, 2, generator=gen) * 0.1,
        group_size=32,
    )
    packed = kernels.pack_int4(groups)
    w = torch.rand(64, generator=gen)
    cos, sin = torch.rand(2, 3, 32, generator=gen).unbind(0)

    def step(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        normed = kernels.add_rms_norm(h, x, w, 1e-6, torch.float32)
        y = kernels.int4_groups_mm(normed, packed).view(3, 4, 64)
        return kernels.rope(y, cos, sin)

    h, x = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    h_compiled = h.clone()
    expected = step(h, x)
    got = torch.compile(step, fullgraph=True, dynamic=False)(h_compiled, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(h_compiled, h)


def test_the_machines_answers_are_marked_as_torch_marks_constants():
    """`kernels` marks its cached answers as `torch.compiler.assume_constant_result` does,
    without importing torch._dynamo (71 MB resident) to do it."""
    marked = torch.compiler.assume_constant_result(lambda: None)
    assert getattr(marked, kernels.CONSTANT_MARK) is True
    for answer in (kernels.available, kernels.in_use, kernels.auto_path, kernels.norm_auto_path):
        assert getattr(answer, kernels.CONSTANT_MARK) is True


def test_loading_the_kernels_leaves_torchs_compiler_unimported():
    """Importing and loading the kernels (fake kernels registered) imports no torch._dynamo:
    a process that never compiles does not hold it."""
    import subprocess
    import sys

    code = (
        "import sys, qinfer.kernels as k; k.available(); k.in_use(); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


@pytest.mark.parametrize("name", list(samples()))
def test_tensors_off_the_cpu_are_refused_in_one_line(name):
    """Each op has a kernel for the other devices' tensors (`kernels.REFUSED_DEVICES`; none
    is at hand here, so the registration is checked and the kernel called): it refuses them
    in one line that names the op and the devices."""
    qualname = f"qinfer::{name}"
    for device in kernels.REFUSED_DEVICES:
        key = {"cuda": "CUDA", "mps": "MPS", "xpu": "XPU"}[device]
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (name, key)
    with pytest.raises(RuntimeError) as refused:
        kernels.refusal(name)(torch.empty(2, device="meta"), torch.empty(2), "auto")
    message = str(refused.value)
    assert "\n" not in message
    assert message == f"qinfer::{name} runs on CPU tensors only, got tensors on cpu, meta"
