"""The exact fp32 head kernel (`int8_blocks_mm`) at the row counts of decode steps: a Q6_K
table (Qwen3.5-0.8B's, its values packed at 6 bits) and a Q8_0 one (Qwen3-0.6B's), a quarter
of each, as GFLOP/s.

    python bench/head_kernel.py                 # 1, 4, 8 and 32 rows, 2 threads
    python bench/head_kernel.py --rows 8 --threads 1

One weight called again and again (at 62,080 x 1,024 it is read from memory at one row; at
more rows the multiplies bound it). A figure is the median over rounds of a call's mean time
(bench/int4_dot_kernel.py's timing); every row count of a shape is timed in the same rounds.
"""

from __future__ import annotations

import argparse
import functools

import torch
from int4_dot_kernel import time_pair  # bench/ is its folder

from qinfer import kernels
from qinfer.linear.compute import cpu_flags

#: (N, K): a quarter of each head (248,320 and 151,936 rows of 1,024)
SHAPES = {"Q6_K": (62080, 1024), "Q8_0": (37984, 1024)}


def q6_k(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed values (`kernels.pack_q6`), int8 sub-scales per 16, fp16 super-scales per 256."""
    q = kernels.pack_q6(torch.randint(-32, 32, (n, k), dtype=torch.int8))
    sub = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)
    return q, sub, (torch.rand(n, k // 256) * 0.01).half()


def q8_0(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """int8 values, an fp16 scale per 32."""
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return q, (torch.rand(n, k // 32) * 0.01).half(), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kernels.require()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU flags: {' '.join(cpu_flags()) or '-'}; {args.threads} thread(s)")
    for name, (n, k) in SHAPES.items():
        q, d, d_super = (q6_k if name == "Q6_K" else q8_0)(n, k)
        call = functools.partial(kernels.int8_blocks_mm, q=q, d=d, d_super=d_super)
        for rows in args.rows:
            timed = time_pair({"call": call}, torch.randn(rows, k), args.rounds)
            seconds = timed["call"][0]
            flops = 2 * rows * n * k / seconds / 1e9
            print(f"  {name} {n}x{k}, {rows:3d} rows: {seconds * 1e3:7.3f} ms {flops:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
