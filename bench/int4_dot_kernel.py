"""qinfer's int4 x int8 dot-product kernel (`qinfer.kernels.int4_mm`) against torch's
`_weight_int4pack_mm_for_cpu` with bf16 activations, what `Int4Linear` calls today.

    python bench/int4_dot_kernel.py                      # all shapes, M 1 8 32 128, 1 and 2 threads
    python bench/int4_dot_kernel.py --rows 1 --threads 1 --rounds 9

Both take the same bf16 activations (M, K) and the same int4 groups of 32 (torch's packed as
`Int4Linear` packs them, bf16 scales_and_zeros; ours by `pack_int4`, fp32 d and m). Several
copies of each weight are cycled through so that every call reads its weight from memory, as
a decode step's layers do, not from a cache a repeated call would leave it in. A figure is the
median over rounds of the mean time of a round's calls; the two kernels alternate round by
round so a burst of load on a shared machine hits both. At M = 1 it also prints the weight
bytes each kernel reads per second, and the sum over one SmolLM2-135M decode step (30 layers
of its four shapes, M = 1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from qinfer import kernels
from qinfer.linear import quantize_int4
from qinfer.linear.compute import cpu_flags

SHAPES = {  # (N, K): out, in
    "SmolLM2 qkv": (960, 576),
    "SmolLM2 o": (576, 576),
    "SmolLM2 gate/up": (3072, 576),
    "SmolLM2 down": (576, 1536),
    "Qwen3-0.6B qkv": (4096, 1024),
    "Qwen3-0.6B o": (1024, 2048),
    "Qwen3-0.6B gate/up": (6144, 1024),
    "Qwen3-0.6B down": (1024, 3072),
}
SMOLLM2_LAYERS = 30
COLD_BYTES = 64e6  # weight bytes cycled through per measurement: more than the caches hold
GROUP = 32


class TorchInt4:
    """torch's CPU int4 kernel with Int4Linear's packing (N here is a multiple of 16)."""

    def __init__(self, groups) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.int(), 2)
        sz = torch.stack([groups.scales, groups.zeros], dim=-1).transpose(0, 1).contiguous()
        self.scales_and_zeros = sz.to(torch.bfloat16)  # (K / 32, N, 2)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


class Ours:
    """qinfer.kernels.int4_mm, the op bound once (torch.ops' attribute lookups cost a few µs
    a call; a layer would hold the bound op as this does)."""

    op = None

    def __init__(self, groups) -> None:
        self.packed = kernels.pack_int4(groups)
        if Ours.op is None:
            Ours.op = torch.ops.qinfer.int4_mm.default

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        return Ours.op(x, p.qs, p.d, p.m, p.n, "auto")


def cycling(weights: list) -> Callable[[torch.Tensor], torch.Tensor]:
    state = {"i": 0}

    def call(x: torch.Tensor) -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(weights)
        return weights[state["i"]](x)

    return call


def calls_for(seconds: float) -> int:
    """Calls per round: about 20 ms of work, at least 3."""
    return max(3, min(200, int(0.02 / max(seconds, 1e-6))))


def time_pair(fns: dict, x: torch.Tensor, rounds: int) -> dict[str, tuple[float, float]]:
    """(median, min) over rounds of the mean seconds per call of each fn, alternating fns."""
    for fn in fns.values():
        for _ in range(3):
            fn(x)
    probe = {name: _mean(fn, x, 3) for name, fn in fns.items()}
    counts = {name: calls_for(t) for name, t in probe.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_mean(fn, x, counts[name]))
    return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def _mean(fn, x, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    reason = kernels.available()
    if reason is not None:
        raise SystemExit(f"int4 dot kernel unavailable: {reason}")
    print(f"CPU flags: {' '.join(cpu_flags()) or '-'}")
    print(
        f"kernel paths here: {', '.join(kernels.paths())} (auto takes the last); torch "
        f"{torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        "times in µs per call: torch = _weight_int4pack_mm_for_cpu (bf16 x, bf16 scales), "
        "ours = int4_mm (bf16 x, fp32 d/m, fp32 out), medians; x = torch / ours (> 1: ours "
        "faster), x (min): the same of the fastest rounds"
    )
    torch.manual_seed(0)
    layers = {}
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, int(COLD_BYTES // (n * k // 2)))
        groups = [quantize_int4(torch.randn(n, k) * 0.02, GROUP) for _ in range(copies)]
        layers[name] = ([TorchInt4(g) for g in groups], [Ours(g) for g in groups])
    results: dict[tuple, dict[str, float]] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s)")
        print(
            f"{'shape':20} {'N x K':>11} {'M':>4} {'torch':>9} {'ours':>9} {'x':>6}"
            f" {'x (min)':>8} {'torch GB/s':>10} {'ours GB/s':>10}"
        )
        for name, (torch_ws, our_ws) in layers.items():
            n, k = SHAPES[name]
            for m in args.rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                timed = time_pair(
                    {"torch": cycling(torch_ws), "ours": cycling(our_ws)}, x, args.rounds
                )
                t = {kind: median for kind, (median, _) in timed.items()}
                best = {kind: low for kind, (_, low) in timed.items()}
                results[(threads, name, m)] = t
                bandwidth = ""
                if m == 1:
                    bandwidth = (
                        f" {torch_ws[0].nbytes / t['torch'] / 1e9:10.1f}"
                        f" {our_ws[0].nbytes / t['ours'] / 1e9:10.1f}"
                    )
                print(
                    f"{name:20} {n:>5} x {k:<4} {m:>4} {t['torch'] * 1e6:9.1f}"
                    f" {t['ours'] * 1e6:9.1f} {t['torch'] / t['ours']:6.2f}"
                    f" {best['torch'] / best['ours']:8.2f}{bandwidth}",
                    flush=True,
                )
    smol = [s for s in SHAPES if s.startswith("SmolLM2")]
    if 1 in args.rows and all(s in args.shapes for s in smol):
        print(
            f"\nSmolLM2-135M decode step, {SMOLLM2_LAYERS} layers x 4 shapes at M = 1 "
            "(the linears only, lm_head excluded)"
        )
        for threads in args.threads:
            total = {
                kind: SMOLLM2_LAYERS * sum(results[(threads, s, 1)][kind] for s in smol)
                for kind in ("torch", "ours")
            }
            print(
                f"  {threads} thread(s): torch {total['torch'] * 1e3:.2f} ms, ours "
                f"{total['ours'] * 1e3:.2f} ms ({total['torch'] / total['ours']:.2f}x)"
            )


if __name__ == "__main__":
    main()
