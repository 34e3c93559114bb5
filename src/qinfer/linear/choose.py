"""Which path (`qinfer.linear.paths`) each quantized Linear takes, per row bucket: a rule
from what the machine is (`compute.cpu_class`), never a timing.

The rule (`rule_paths`), for quantized Linears on CPU:

- by default (not `exact`): `int8_dot` for both buckets wherever the layer has it (int8 rows,
  int8 blocks, int4 groups of 32; the compiled kernels load here): activations rounded to
  int8 per block of 32 and integer dot products, as llama.cpp multiplies its Q4, Q5, Q6 and
  Q8 weights. Its drift
  from the fp32 dequantized model is held under 0.75x llama.cpp's own (tests/test_quantize.py,
  tests/test_gemma3_gguf.py), and it computes a row alike at any row count, so a
  batch-invariant model takes it too. Layers without it take the exact rule below.
- `exact` (`--exact`: fp32 or bf16 activations, the reference mode), and the layers
  without int8_dot:
  - decode bucket (up to `DECODE_MAX_ROWS` rows): the kernel, always. A tile path
    dequantizes the whole weight for a row or a few, an order of magnitude slower.
  - prefill bucket: `fp32_tiles` where the CPU does not multiply bf16 natively
    (`compute.bf16_matmul_is_fast`, a table of CPU classes; AVX2-class CPUs), the kernel
    elsewhere. int8 rows and int8 blocks there take `bf16_tiles` (up to `INT8_TILED_MAX`
    elements): the int8 kernels do not block like a GEMM, and a bf16 GEMM on the widened
    weight catches them up from a few dozen rows.
- the lm_head's call (`rule_head_path`; every row alike at any row count): int8_dot by
  default where the layer has it (each row's top 256 logits recomputed exactly), the kernel
  with `exact` and elsewhere.

(The figures behind each bucket: docs/BENCHMARKS.md, "Paths of quantized Linears".)
An earlier version timed every path of every (kind, shape) at load instead. That cost
seconds per load and the RSS of the tile buffers on every CPU; and on a shared machine the timings are noise that flipped choices between runs,
and with them the numerics a test saw. The rule costs nothing at load, and a layer on a
CPU that keeps the kernel never allocates a tile buffer. `qinfer bench` still times every
path per shape, beside the one taken.

`QINFER_LINEAR_PATH` forces paths instead of the rule: a path name for both buckets
(`kernel`, `fp32_tiles`, `bf16_tiles`, `int8_dot`; `kernel` and `int8_dot` for the head
too), or `decode=PATH,prefill=PATH,head=PATH` (a bucket left out follows the rule). A kind's
own path (`int8_dot`: int8 rows, int8 blocks, int4 groups of 32) is forced on the layers that
have it; the others follow the rule.
"""

from __future__ import annotations

import os

from torch import nn

from qinfer import kernels
from qinfer.core.errors import ConfigError
from qinfer.linear.compute import bf16_matmul_is_fast
from qinfer.linear.dense import DenseLinear
from qinfer.linear.grouped import StackedDenseLinear
from qinfer.linear.int8 import Int8Linear
from qinfer.linear.int8_blocks import Int8BlockLinear
from qinfer.linear.paths import (
    BF16_TILES,
    BUCKETS,
    FP32_TILES,
    INT8_DOT,
    KERNEL,
    KIND_PATHS,
    PATHS,
    ROW_INVARIANT,
    QuantizedLinear,
)

ENV = "QINFER_LINEAR_PATH"
#: QINFER_LINEAR_PATH's name for the lm_head's call.
HEAD = "head"
#: int8 weights up to this many elements take bf16 tiles at prefill where bf16 is fast;
#: past it (a 262k-row head) the dequantizing outweighs what the GEMM saves.
INT8_TILED_MAX = 1 << 25


def forced_paths() -> dict[str, str]:
    """{bucket: path} that QINFER_LINEAR_PATH forces (empty when it is unset); "head" is the
    lm_head's call (`QuantizedLinear.use_head_path`), which a single path name forces too
    where the path computes a row alike at any row count."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return {}
    if "=" not in value:
        buckets = (*BUCKETS, HEAD) if value in ROW_INVARIANT else BUCKETS
        value = ",".join(f"{bucket}={value}" for bucket in buckets)
    forced = {}
    for item in value.split(","):
        bucket, _, path = (part.strip() for part in item.partition("="))
        valid = path in ROW_INVARIANT if bucket == HEAD else bucket in BUCKETS and path in PATHS
        if not valid:
            raise ConfigError(
                f"{ENV}={os.environ[ENV]!r}: expected a path ({', '.join(PATHS)}) or "
                f"{'=PATH,'.join(BUCKETS)}=PATH[,head=PATH] (head: {' or '.join(ROW_INVARIANT)})"
            )
        forced[bucket] = path
    return forced


def rule_head_path(layer: QuantizedLinear, exact: bool = False) -> str:
    """The lm_head's path: by default int8_dot where the layer has it and the kernels load
    (each row's top EXACT_TOP_INT8 (256) logits recomputed exactly, so the greedy pick and
    what a sampler keeps are the exact weight's), else the kind's kernel (torch's; int8
    blocks: qinfer's exact one, which `exact` keeps). int8_dot stages the head's int8
    columns in tiles of 16 for integer dot products: Qwen3-0.6B's Q8_0 head at 32 rows 38 ->
    14 ms, Qwen3.5-0.8B's Q6_K at 8 rows 21 -> 10, at one row as fast as the exact kernel; its KL to fp32 stays within the default path's bound
    (tests/test_quantize.py, tests/test_gemma3_gguf.py; docs/BENCHMARKS.md)."""
    if not exact and INT8_DOT in layer.paths() and kernels.available() is None:
        return INT8_DOT
    return KERNEL


def rule_paths(layer: QuantizedLinear, exact: bool = False) -> dict[str, str]:
    """{bucket: path} the rule (module docstring) gives `layer` on the running CPU; exact:
    the fp32-activation paths only (no int8_dot)."""
    paths = layer.paths()
    # int8_dot is offered where the kernels can be built; taken by default where they load
    # (built at load, the first time, not in a step; a failed build leaves the exact rule)
    if not exact and INT8_DOT in paths and kernels.available() is None:
        return {bucket: INT8_DOT for bucket in BUCKETS}
    if not bf16_matmul_is_fast(layer.device):
        return {"decode": KERNEL, "prefill": FP32_TILES if FP32_TILES in paths else KERNEL}
    int8 = isinstance(layer, (Int8Linear, Int8BlockLinear))
    widened = int8 and layer.out_features * layer.in_features <= INT8_TILED_MAX
    return {"decode": KERNEL, "prefill": BF16_TILES if widened and BF16_TILES in paths else KERNEL}


def choose_paths(module: nn.Module, same_at_any_rows: bool = False, exact: bool = False) -> None:
    """Set the decode and prefill path of every quantized Linear on CPU in `module`: the
    rule's (`exact`: without int8_dot), except where QINFER_LINEAR_PATH forces one.
    Quantized layers on other devices keep the kernel.

    same_at_any_rows (a batch-invariant model): every quantized Linear takes a path that
    computes a row alike at any row count for both buckets (the rule's where it is one of
    ROW_INVARIANT, else its kernel: the tile paths' GEMMs block by row count) and every dense
    one, grouped experts included, its fixed-chunk GEMMs (`qinfer.linear.dense`), on any
    device."""
    forced = {} if same_at_any_rows else forced_paths()
    for layer in cpu_quantized(module):
        # a kind's own path forced: the layers of other kinds follow the rule
        has = layer.paths()
        ours = {b: p for b, p in forced.items() if p not in KIND_PATHS or p in has}
        paths = rule_paths(layer, exact) | ours
        if same_at_any_rows:
            paths = {b: p if p in ROW_INVARIANT else KERNEL for b, p in paths.items()}
        layer.use_paths(paths["decode"], paths["prefill"])
        layer.use_head_path(ours.get(HEAD) or rule_head_path(layer, exact))
    for layer in module.modules():
        if isinstance(layer, (DenseLinear, StackedDenseLinear)):
            layer.fixed_rows = same_at_any_rows


def cpu_quantized(module: nn.Module) -> list[QuantizedLinear]:
    """module's quantized Linears on CPU (the layers whose paths are chosen)."""
    return [
        layer
        for layer in module.modules()
        if isinstance(layer, QuantizedLinear) and layer.device.type == "cpu"
    ]
