"""qinfer's two decode-step kernels timed alone: the exact int4 matmul
(`kernels.int4_groups_mm`) on a model's four projection shapes, and the paged decode
attention (`kernels.paged_decode_attention`) on its heads.

    python bench/decode_kernels.py                        # Qwen3-0.6B's shapes, 1 and 2 threads
    python bench/decode_kernels.py --model smollm2 --rows 1 512 --threads 2
    python bench/decode_kernels.py --kernels attention --keys 2048 --threads 2

int4: random int4 groups of 32 packed as the layers hold them; several copies of each weight
are cycled through so that every call reads its weight from memory, as a decode step's layers
do. A figure is the median over rounds of a call's mean time, times the model's layers (a
step's worth of that shape). Attention: one new token per sequence over `--keys` keys of a
bf16 pool (the GGUF default's KV dtype), block size 16, tables of shuffled blocks, one pool
per layer: the best of 10 rounds over one layer's pool (in cache) and over every layer's in
turn (from memory, as a decode step reads them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qinfer import kernels
from qinfer.linear import quantize_int4
from qinfer.linear.compute import cpu_flags

# name: (layers, projection shapes (N, K), (query heads, KV heads, head dim))
MODELS = {
    "qwen3-0.6b": (28, [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], (16, 8, 128)),
    "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (9, 3, 64)),
    "gemma3-270m": (18, [(1536, 640), (640, 1024), (4096, 640), (640, 2048)], (4, 1, 256)),
}
COLD_BYTES = 64e6  # more than the caches hold
BLOCK = 16


def time_int4(layers: int, shapes: list[tuple[int, int]], rows: int, rounds: int = 7) -> None:
    step = 0.0
    for N, K in shapes:
        packed = kernels.pack_int4(quantize_int4(torch.randn(N, K), 32))
        nbytes = packed.nbytes
        copies = [
            kernels.PackedInt4(packed.qs.clone(), packed.d.clone(), packed.m.clone(), packed.n)
            for _ in range(max(2, int(COLD_BYTES // nbytes)))
        ]
        x = torch.randn(rows, K)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for weight in copies:
                kernels.int4_groups_mm(x, weight)
            times.append((time.perf_counter() - start) / len(copies))
        t = statistics.median(times)
        step += t * layers
        flops = 2 * rows * N * K / t / 1e9
        print(f"  int4 {N} x {K}, {rows} rows: {t * 1e6:8.1f} us  {nbytes / t / 1e9:5.1f} GB/s  "
              f"{flops:6.1f} GFLOP/s")  # fmt: skip
    print(f"  int4, {layers} layers of these: {step * 1e3:.2f} ms")


def time_attention(layers: int, heads: tuple[int, int, int], keys: int, sequences: int) -> None:
    Hq, Hkv, D = heads
    blocks = -(-keys // BLOCK)
    gen = torch.Generator().manual_seed(0)

    def pool() -> torch.Tensor:
        return torch.randn(Hkv, sequences * blocks * BLOCK, D, generator=gen).bfloat16()

    # one (keys, values) pool per layer; the tables' blocks shuffled, as an engine's are
    # after sequences come and go
    pools = [(pool(), pool()) for _ in range(layers)]
    tables = torch.randperm(sequences * blocks, generator=gen).view(sequences, blocks)
    totals = torch.full((sequences,), keys)
    positions = totals - 1
    slots = tables[:, (keys - 1) // BLOCK] * BLOCK + (keys - 1) % BLOCK
    q, k, v = (
        torch.randn(sequences, Hq, D),
        torch.randn(sequences, Hkv, D),
        torch.randn(sequences, Hkv, D),
    )

    def call(layer: int) -> None:
        keys_pool, values_pool = pools[layer]
        kernels.paged_decode_attention(
            q, k, v, keys_pool, values_pool, slots, positions, tables, totals, None, BLOCK,
            None, D**-0.5,
        )  # fmt: skip

    # in cache: one layer's pool over and over; from memory: every layer's in turn, as a
    # decode step reads them (between two reads of a layer's, the whole step's weights)
    for name, order in (("in cache", [0] * layers), ("from memory", list(range(layers)))):
        for layer in order * 2:
            call(layer)
        best = float("inf")
        for _ in range(10):
            start = time.perf_counter()
            for layer in order * 2:
                call(layer)
            best = min(best, (time.perf_counter() - start) / (2 * layers))
        print(
            f"  attention {Hq}/{Hkv} heads of {D}, {sequences} x {keys} keys, {name}: "
            f"{best * 1e6:.1f} us, {layers} layers {best * layers * 1e3:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--keys", type=int, default=540)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--kernels", nargs="+", choices=["int4", "attention"], default=["int4", "attention"]
    )
    args = parser.parse_args()
    reason = kernels.available()
    if reason is not None:
        raise SystemExit(f"the kernels cannot run here: {reason}")
    layers, shapes, heads = MODELS[args.model]
    print(f"CPU flags: {' '.join(sorted(cpu_flags()))}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"{args.model}, {threads} thread(s):")
        for rows in args.rows if "int4" in args.kernels else []:
            time_int4(layers, shapes, rows)
        for sequences in args.sequences if "attention" in args.kernels else []:
            time_attention(layers, heads, args.keys, sequences)


if __name__ == "__main__":
    main()
