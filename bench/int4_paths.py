"""int4_mm's paths against each other on one CPU (e.g. VNNI's tiles against AVX2's, AMX's
against VNNI's), or int8_mm's (`--int8`: Q8_0-like weights, int8 with an fp16 scale per 32),
the same weights and activations, the paths alternating round by round
(bench/int4_dot_kernel.py's timing) so that a burst of load on a shared machine hits both.

    python bench/int4_paths.py                         # the CPU's vector paths, Qwen3-0.6B, M 16 512
    python bench/int4_paths.py --paths vnni avx2 --rows 1 8 16 32 --threads 1 2
    python bench/int4_paths.py --paths amx vnni --rows 16 32 64 512 --int8

A figure is the median over rounds of the mean ms per call; "x" is the first path's time over
each other's (> 1: the other is faster). The weights are cycled through as in
int4_dot_kernel.py (each call reads its weight from memory).
"""

from __future__ import annotations

import argparse
import functools

import torch
from int4_dot_kernel import COLD_BYTES, GROUP, SHAPES, cycling, time_pair  # bench/ is its folder

from qinfer import kernels
from qinfer.linear import quantize_int4
from qinfer.linear.compute import cpu_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", help="default: the CPU's vector paths, fastest first")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--int8", action="store_true", help="int8_mm on Q8_0-like weights")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=[s for s in SHAPES if s.startswith("Qwen3")],
        choices=list(SHAPES),
    )
    args = parser.parse_args()
    reason = kernels.available()
    if reason is not None:
        raise SystemExit(f"int4 dot kernel unavailable: {reason}")
    args.paths = args.paths or [p for p in reversed(kernels.paths()) if p != "scalar"]
    missing = [p for p in args.paths if p not in kernels.paths()]
    if missing:
        raise SystemExit(
            f"--paths: this CPU has no {', '.join(missing)} path ({', '.join(kernels.paths())})"
        )
    print(f"CPU flags: {' '.join(cpu_flags()) or '-'}; torch {torch.__version__}")
    print(
        f"ms per call (median of {args.rounds} alternating rounds), fp32 x; x = {args.paths[0]} / other"
    )
    torch.manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s), {'int8_mm' if args.int8 else 'int4_mm'}")
        print(
            f"{'shape':20} {'N x K':>11} {'M':>4} "
            + " ".join(f"{p:>9}" for p in args.paths)
            + "      x"
        )
        for name in args.shapes:
            n, k = SHAPES[name]
            copies = max(2, int(COLD_BYTES // (n * k // (1 if args.int8 else 2))))
            weights = [weight(n, k, args.int8) for _ in range(copies)]
            for m in args.rows:
                x = torch.randn(m, k)
                fns = {
                    p: cycling([functools.partial(w, path=p) for w in weights]) for p in args.paths
                }
                t = {p: median for p, (median, _) in time_pair(fns, x, args.rounds).items()}
                ratios = " ".join(f"{t[args.paths[0]] / t[p]:6.2f}" for p in args.paths[1:])
                times = " ".join(f"{t[p] * 1e3:9.3f}" for p in args.paths)
                print(f"{name:20} {n:>5} x {k:<5} {m:>4} {times} {ratios}")


def weight(n: int, k: int, int8: bool):
    """A random (N, K) weight as a call of its op on x (path= the path): int4 groups of 32 for
    int4_mm, or int8 values with an fp16 scale per 32 for int8_mm."""
    if int8:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        d = (torch.rand(n, k // GROUP) * 0.01).half()
        return lambda x, path: torch.ops.qinfer.int8_mm.default(x, q, d, path)
    w = kernels.pack_int4(quantize_int4(torch.randn(n, k) * 0.02, GROUP))
    return lambda x, path: torch.ops.qinfer.int4_mm.default(x, w.qs, w.d, w.m, w.n, path)


if __name__ == "__main__":
    main()
