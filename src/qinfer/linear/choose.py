"""Which path (`qinfer.linear.paths`) each quantized Linear takes, per row bucket, measured
on the running CPU.

`choose_paths(model)` runs after loading: the quantized Linears on CPU are grouped by
(kind, shape, dtype); for each group it times every path the layers offer at
`DECODE_PROBE_ROWS` and at `PREFILL_PROBE_ROWS` rows, cycling through the group's layers so
each call reads a cold weight as a forward does, in `ROUNDS` interleaved rounds, and sets
the fastest per bucket on every layer of the group (another path than the kernel only
when it is `KERNEL_MARGIN` times faster). Choices are kept per process (`CHOSEN`), so loading the same shapes
again measures nothing. CPUs differ in which path wins (AVX2: fp32 tiles at prefill, where a
bf16 GEMM runs several times slower than fp32; AVX512-BF16: bf16 tiles), which is why this
is measured rather than decided from the CPU's flags.

`QINFER_LINEAR_PATH` forces paths instead of timing them: a path name for both buckets
(`kernel`, `fp32_tiles`, `bf16_tiles`), or `decode=PATH,prefill=PATH` (a bucket left out is
timed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from qinfer.errors import ConfigError
from qinfer.linear.paths import BUCKETS, KERNEL, PATHS, QuantizedLinear

#: Rows of the timed calls: a batch-1 decode step, and a prefill chunk.
DECODE_PROBE_ROWS = 1
PREFILL_PROBE_ROWS = 128
#: Rounds of timing; each round times every path still in the running, in turn, so a
#: stretch of time when the machine is busy slows all of them alike.
ROUNDS = 3
#: After a round, a path slower than this many times the best so far is not timed again.
DROP = 3.0
#: Another path replaces the kernel only if it measures this many times faster: timings
#: on a shared machine jitter, and the kernel is the path that needs no buffer.
KERNEL_MARGIN = 1.25
#: Paths timed for the decode bucket. A tile path dequantizes the whole weight for a row or
#: a few, measured 10-30x slower than the kernel there on AVX512-BF16 and on emulated AVX2;
#: timing it anyway only let a busy machine flip the choice (the kernel's 2-thread calls
#: measured 5-8 ms, not 0.02-0.05, for whole rounds while other processes held the cores).
DECODE_PATHS = (KERNEL,)
ENV = "QINFER_LINEAR_PATH"

#: (seconds) a timer answers for one path of one group at one row count.
Timer = Callable[[list[QuantizedLinear], str, int], float]


@dataclass(frozen=True)
class Choice:
    """The path a group of same-shaped layers takes in one bucket, and what each candidate
    measured (ms per call; empty when the path was forced)."""

    kind: str
    shape: tuple
    bucket: str
    path: str
    ms: dict[str, float] = field(default_factory=dict)


#: Per process: (kind, shape key, dtype, device) -> {bucket: Choice}.
CHOSEN: dict[tuple, dict[str, Choice]] = {}


def measure_seconds(layers: list[QuantizedLinear], path: str, rows: int) -> float:
    """The fastest single call of `path` on `rows` random activation rows, over calls that
    each take the next of `layers` (one call per layer, at least 4, for decode rows; one for
    prefill rows): a shared machine only ever slows a call down."""
    first = layers[0]
    x = torch.randn(rows, first.in_features, dtype=first.dtype)
    calls = max(4, len(layers)) if rows <= 16 else 1
    best = float("inf")
    with torch.inference_mode():
        for i in range(calls):
            layer = layers[i % len(layers)]
            start = time.perf_counter()
            layer.run_path(path, x)
            best = min(best, time.perf_counter() - start)
    return best


def forced_paths() -> dict[str, str]:
    """{bucket: path} that QINFER_LINEAR_PATH forces (empty when it is unset)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return {}
    if "=" not in value:
        value = ",".join(f"{bucket}={value}" for bucket in BUCKETS)
    forced = {}
    for item in value.split(","):
        bucket, _, path = (part.strip() for part in item.partition("="))
        if bucket not in BUCKETS or path not in PATHS:
            raise ConfigError(
                f"{ENV}={os.environ[ENV]!r}: expected a path ({', '.join(PATHS)}) or "
                f"{'=PATH,'.join(BUCKETS)}=PATH"
            )
        forced[bucket] = path
    return forced


def choose_paths(
    module: nn.Module,
    timer: Timer = measure_seconds,
    chosen: dict[tuple, dict[str, Choice]] = CHOSEN,
) -> list[Choice]:
    """Set the decode and prefill path of every quantized Linear on CPU in `module`; returns
    the choices, one per (group, bucket). Layers on other devices keep the kernel."""
    forced = forced_paths()
    table = []
    for key, layers in _groups(module).items():
        if key not in chosen or forced:
            choices = {b: _choose(key, layers, b, forced, timer) for b in BUCKETS}
            if not forced:
                chosen[key] = choices
        else:
            choices = chosen[key]
        for layer in layers:
            layer.use_paths(choices["decode"].path, choices["prefill"].path)
        table.extend(choices.values())
    return table


def chosen_paths(module: nn.Module) -> list[Choice]:
    """The paths `module`'s quantized Linears on CPU take, one Choice per (group, bucket),
    with the timings behind them when they were measured."""
    table = []
    for key, layers in _groups(module).items():
        measured = CHOSEN.get(key, {})
        for bucket, path in layers[0].chosen.items():
            choice = measured.get(bucket)
            if choice is None or choice.path != path:  # forced, or set by hand
                choice = Choice(key[0], key[1], bucket, path)
            table.append(choice)
    return table


def _groups(module: nn.Module) -> dict[tuple, list[QuantizedLinear]]:
    """module's quantized Linears on CPU by (kind, shape key, dtype, device)."""
    groups: dict[tuple, list[QuantizedLinear]] = {}
    for layer in module.modules():
        if isinstance(layer, QuantizedLinear) and layer.device.type == "cpu":
            key = (type(layer).__name__, layer.shape_key(), layer.dtype, layer.device)
            groups.setdefault(key, []).append(layer)
    return groups


def _choose(
    key: tuple, layers: list[QuantizedLinear], bucket: str, forced: dict[str, str], timer: Timer
) -> Choice:
    kind, shape = key[0], key[1]
    if bucket in forced:
        return Choice(kind, shape, bucket, forced[bucket])
    rows = DECODE_PROBE_ROWS if bucket == "decode" else PREFILL_PROBE_ROWS
    candidates = DECODE_PATHS if bucket == "decode" else layers[0].paths()
    ms = {path: float("inf") for path in candidates}
    running = list(ms)
    for _ in range(ROUNDS):
        for path in running:
            ms[path] = min(ms[path], timer(layers, path, rows) * 1e3)
        running = [path for path in running if ms[path] <= DROP * min(ms.values())]
    best = min(ms, key=ms.get)  # ties: the earlier path
    if ms[best] * KERNEL_MARGIN > ms[KERNEL]:
        best = KERNEL
    return Choice(kind, shape, bucket, best, ms)


def format_choices(table: list[dict]) -> str:
    """Choices (as dicts) as lines: kind, shape, bucket (rows timed) -> path, each path's ms."""
    lines = []
    for c in table:
        times = "  ".join(f"{path} {ms:.3f}" for path, ms in c["ms"].items()) or "(forced)"
        shape = "x".join(map(str, c["shape"]))
        rows = DECODE_PROBE_ROWS if c["bucket"] == "decode" else PREFILL_PROBE_ROWS
        bucket = f"{c['bucket']} ({rows})"
        lines.append(f"  {c['kind']:10} {shape:14} {bucket:13} -> {c['path']:10} ms: {times}")
    return "\n".join(lines)
