"""Which linear kernel is fastest on this machine, by shape: the evidence behind
`qinfer.linear.compute` (bf16 activations for quantized weights, the dense dtype measured).

    python bench/linear_kernels.py                 # SmolLM2 and Qwen3-0.6B shapes
    python bench/linear_kernels.py --rows 1 8 512 --threads 1

For each (out, in) weight shape and each number of activation rows M it times one call of
dense fp32, dense bf16, int8 per channel and int4 groups of 32 (bf16 activations) through
qinfer's own Linear kinds, each quantized kind along each of its paths (`kernel`, then
`f32t` / `b16t`: dequantized tile by tile into an fp32 / bf16 buffer + GEMM, see
`qinfer.linear.paths`), and prints milliseconds and the best GFLOP/s. Several copies of
each weight are cycled through so that a decode-sized call reads its weight from memory,
not from cache, as a real forward does.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from qinfer.linear import DenseLinear, Int4Linear, Int8Linear, quantize_int4, quantize_int8
from qinfer.linear.compute import cpu_flags
from qinfer.linear.paths import BF16_TILES, FP32_TILES, KERNEL

SHAPES = {
    "SmolLM2 q/k/v": (960, 576),
    "SmolLM2 gate/up": (3072, 576),
    "SmolLM2 down": (576, 1536),
    "SmolLM2 lm_head": (49152, 576),
    "Qwen3-0.6B gate/up": (6144, 1024),
    "Qwen3-0.6B down": (1024, 3072),
}
COLD_BYTES = 64e6  # weights cycled per measurement: more than the caches hold


def best_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """Fastest single call of `calls`, after a warm-up, in milliseconds (on a shared machine
    a mean mostly measures the other processes)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def cycling(kernels: list, x: torch.Tensor, path: str | None) -> Callable[[], torch.Tensor]:
    """A call that applies the next of `kernels` to x each time (along `path`, if given)."""
    state = {"i": 0}

    def call() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(kernels)
        kernel = kernels[state["i"]]
        return kernel(x) if path is None else kernel.run_path(path, x)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"CPU flags: {' '.join(cpu_flags()) or '-'}; {torch.get_num_threads()} threads")
    columns = {"fp32": None, "bf16": None}
    for kind in ("int8", "int4"):
        columns |= {kind: KERNEL, f"{kind} f32t": FP32_TILES, f"{kind} b16t": BF16_TILES}
    print(f"{'shape':20} {'M':>4}" + "".join(f"{c:>10}" for c in columns) + "  best GFLOP/s")
    for name, (n, k) in SHAPES.items():
        copies = max(1, int(COLD_BYTES // (n * k * 4)))
        weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        kinds = {
            "fp32": [DenseLinear(w) for w in weights],
            "bf16": [DenseLinear(w.bfloat16()) for w in weights],
            "int8": [Int8Linear(quantize_int8(w), None, torch.bfloat16) for w in weights],
            "int4": [Int4Linear(quantize_int4(w, 32), None, torch.bfloat16) for w in weights],
        }
        for m in args.rows:
            x = torch.randn(m, k)
            times = {
                column: best_ms(
                    cycling(kinds[column.split()[0]], x if column == "fp32" else x.bfloat16(), path)
                )
                for column, path in columns.items()
            }
            gflops = 2 * m * n * k / min(times.values()) / 1e6
            cells = "".join(f"{t:10.3f}" for t in times.values())
            print(f"{name:20} {m:4} {cells}  {gflops:8.1f} ({min(times, key=times.get)})")


if __name__ == "__main__":
    main()
