"""What each path (`qinfer.linear.paths`) of a model's quantized shapes costs on this CPU,
beside the path `qinfer.linear.choose` gave it: timed here, in the benchmark, never at load.

Each path is timed `CALLS` times after a warm-up, the fastest kept (other processes only
ever slow a call down), cycling through the layers of a shape so that a call reads a cold
weight as a forward does; few calls keep the table to a few seconds (the 49,152-row head).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from qinfer.linear.choose import HEAD, cpu_quantized
from qinfer.linear.paths import BUCKETS, ROW_INVARIANT, QuantizedLinear

#: Rows of the timed calls per bucket: a batch-1 decode step, and a prefill chunk; the
#: lm_head's call (`QuantizedLinear.use_head_path`) as at a batch-1 decode step.
PROBE_ROWS = {"decode": 1, "prefill": 128, HEAD: 1}
#: Timed calls per path and row count (after one warm-up call).
CALLS = 2


def path_table(module: nn.Module) -> list[dict]:
    """One row per (kind, shape key, bucket) of `module`'s quantized Linears on CPU: the
    path taken and {path: ms} for every path the layers offer; and, where `module` has a
    quantized lm_head on CPU, a row for its head path (bucket "head": the paths that compute
    a row alike at any row count, timed without the exact recompute of the top logits)."""
    groups: dict[tuple, list[QuantizedLinear]] = {}
    quantized = cpu_quantized(module)
    for layer in quantized:
        groups.setdefault((type(layer).__name__, layer.shape_key()), []).append(layer)
    table = []
    for (kind, shape), layers in groups.items():
        for bucket in BUCKETS:
            rows = PROBE_ROWS[bucket]
            ms = {path: path_ms(layers, path, rows) for path in layers[0].paths()}
            path = layers[0].chosen[bucket]
            table.append({"kind": kind, "shape": shape, "bucket": bucket, "path": path, "ms": ms})
    head = getattr(module, "lm_head", None)
    if any(layer is head for layer in quantized):
        paths = [path for path in head.paths() if path in ROW_INVARIANT]
        ms = {path: path_ms([head], path, PROBE_ROWS[HEAD]) for path in paths}
        kind, shape = type(head).__name__, head.shape_key()
        table.append(
            {"kind": kind, "shape": shape, "bucket": HEAD, "path": head.head_path, "ms": ms}
        )
    return table


def path_ms(layers: list[QuantizedLinear], path: str, rows: int) -> float:
    """The fastest of CALLS calls of `path` on `rows` random activation rows, each call on
    the next of `layers`, in milliseconds."""
    x = torch.randn(rows, layers[0].in_features, dtype=layers[0].dtype)
    best = float("inf")
    with torch.inference_mode():
        layers[0].run_path(path, x)  # warm-up: first-call kernel selection, the tile buffer
        for i in range(CALLS):
            start = time.perf_counter()
            layers[(i + 1) % len(layers)].run_path(path, x)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def format_path_table(table: list[dict]) -> str:
    """`path_table` as lines: kind, shape, bucket (rows timed) -> path taken, each path's ms."""
    lines = []
    for row in table:
        times = "  ".join(f"{path} {ms:.3f}" for path, ms in row["ms"].items())
        shape = "x".join(map(str, row["shape"]))
        bucket = f"{row['bucket']} ({PROBE_ROWS[row['bucket']]})"
        lines.append(f"  {row['kind']:15} {shape:14} {bucket:13} -> {row['path']:10} ms: {times}")
    return "\n".join(lines)
