"""The default path's one-row (decode) kernels timed alone, from memory and from cache: the
int4 x int8 product (`int4_mm`, a Q4_0 weight), the int8 x int8 one (`int8_mm`) and the exact
fp32 one the head takes (`int8_blocks_mm`), both on a Q6_K-shaped weight (int8 sub-scales per
16, an fp16 super-scale per 256), as weight bytes read per second.

    python bench/one_row_kernels.py                          # Qwen3.5-0.8B's shapes, 1 and 2 threads
    python bench/one_row_kernels.py --path avx2 --threads 2

"memory": several copies of each weight cycled through (more than the caches hold), as a
decode step reads its layers; "cache": one copy called again and again. The two alternate
round by round (bench/int4_dot_kernel.py's timing), a figure is the median over rounds of a
call's mean time. The machine's read bandwidth, for scale: bench/llama_cpp_peer.py's
`read_bandwidth_gb_s`.
"""

from __future__ import annotations

import argparse

import torch
from int4_dot_kernel import COLD_BYTES, cycling, time_pair  # bench/ is its folder

from qinfer import kernels
from qinfer.linear.compute import cpu_flags
from qinfer.linear.int4 import Int4Groups

# name: (N, K) of Qwen3.5-0.8B's decode projections (Q4_0) and a slice of its head (Q6_K)
INT4_SHAPES = {
    "gate/up": (7168, 1024),
    "down": (1024, 3584),
    "DeltaNet qkvz": (8192, 1024),
    "out": (1024, 2048),
}
HEAD_SLICE = (16384, 1024)


def q4_0(n: int, k: int) -> kernels.PackedInt4:
    """A random Q4_0-like weight: nibbles, fp16 scales, zero 0 (no m held)."""
    scales = (torch.rand(n, k // 32) * 0.01).half().float()
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return kernels.pack_int4(Int4Groups(q, scales, torch.zeros_like(scales)))


def q6_k(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K) in -32..31 packed (`kernels.pack_q6`), int8 sub-scales (N, K/16), fp16
    super-scales (N, K/256)."""
    q = kernels.pack_q6(torch.randint(-32, 32, (n, k), dtype=torch.int8))
    sub = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)
    return q, sub, (torch.rand(n, k // 256) * 0.01).half()


def report(name: str, nbytes: int, calls: dict, x: torch.Tensor, rounds: int) -> None:
    timed = time_pair(calls, x, rounds)
    figures = "  ".join(
        f"{where} {t * 1e6:7.1f} µs {nbytes / t / 1e9:5.1f} GB/s" for where, (t, _) in timed.items()
    )
    print(f"  {name:28} {figures}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--path", default="auto", help="the kernels' path (auto, vnni, avx2)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kernels.require()
    print(f"CPU flags: {' '.join(cpu_flags()) or '-'}; path {args.path}")
    torch.manual_seed(0)
    weights = {}
    for name, (n, k) in INT4_SHAPES.items():
        copies = max(2, int(COLD_BYTES // (n * k // 2)))
        weights[name] = [q4_0(n, k) for _ in range(copies)]
    head_n, head_k = HEAD_SLICE
    heads = [q6_k(head_n, head_k) for _ in range(max(2, int(COLD_BYTES // (head_n * head_k))))]
    head_bytes = sum(t.nbytes for t in heads[0])
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"{threads} thread(s), one row")
        for name, packed in weights.items():
            calls = [lambda x, p=p: kernels.int4_mm(x, p, args.path) for p in packed]
            n, k = INT4_SHAPES[name]
            report(
                f"int4_mm {name} {n}x{k}",
                packed[0].nbytes,
                {"memory": cycling(calls), "cache": calls[0]},
                torch.randn(1, k),
                args.rounds,
            )
        for op in ("int8_mm", "int8_blocks_mm"):
            fn = getattr(kernels, op)
            calls = [
                lambda x, w=w, fn=fn: fn(x, w[0], w[1], args.path, d_super=w[2]) for w in heads
            ]
            report(
                f"{op} Q6_K {head_n}x{head_k}",
                head_bytes,
                {"memory": cycling(calls), "cache": calls[0]},
                torch.randn(1, head_k),
                args.rounds,
            )


if __name__ == "__main__":
    main()
