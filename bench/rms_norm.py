"""The compiled residual add + RMSNorm (`qinfer.kernels.add_rms_norm`) against torch's ops.

    python bench/rms_norm.py [--threads 1 2] [--rounds 8] [--tokens 48] [--skip-micro] [--skip-decode]

1. The op alone against what `RMSNorm.add` runs without it (h += x; F.rms_norm with the
   fp32 weight; the cast to bf16), x bf16, at (1, 576), (8, 576), (512, 576), (1, 640): µs a
   call, median of 7 repeats of many calls.
2. Greedy decode of `--tokens` tokens at batch 1 (a 128-token prompt) of the embedded
   model, in one process on one loaded model: the compiled norm and torch's swapped in
   (`qinfer.layers.norm._compiled`) round by round, the first of each round alternating,
   so that a loaded machine's drift falls on both. Prints each round's ratio and the median.
   Then the same decode with the two swapped step by step (`Transformer.forward` wrapped,
   the side flipped at every call): the median forward time of each side over all rounds'
   decode steps, neighbours in time, which a drift of seconds cannot tell apart.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.layers import norm as norm_module

SHAPES = [(1, 576), (8, 576), (512, 576), (1, 640)]


def per_call_us(run, calls: int) -> float:
    """Median over 7 repeats of the µs one call of `run` takes."""
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def microbenchmark() -> None:
    for T, H in SHAPES:
        h = torch.randn(T, H)
        x = (torch.randn(T, H) * 0.1).bfloat16()
        w = torch.randn(H)
        calls = max(20, 20000 // T)
        theirs = functools.partial(torch_add_norm, h, x, w)
        ours = functools.partial(kernels.add_rms_norm, h, x, w, 1e-6, torch.bfloat16)
        a, b = per_call_us(theirs, calls), per_call_us(ours, calls)
        print(f"  ({T}, {H}): torch {a:8.1f} µs  op {b:8.1f} µs  torch/op {a / b:5.2f}")


def torch_add_norm(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What `RMSNorm.add` runs without the op."""
    h += x
    return F.rms_norm(h, (h.shape[1],), w, 1e-6).to(torch.bfloat16)


def decode_ab(threads: int, rounds: int, tokens: int) -> None:
    from qinfer import SamplingParams, load_model
    from qinfer.core.checkpoint import resolve_model
    from qinfer.engine.generation import generate_ids

    torch.set_num_threads(threads)
    model = load_model(resolve_model(None), device="cpu")
    rng = random.Random(0)
    prompt = [[rng.randrange(model.config.vocab_size) for _ in range(128)]]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    compiled = norm_module._compiled

    def run(side: str) -> tuple[float, list[int]]:
        norm_module._compiled = compiled if side == "op" else (lambda h, x, out: False)
        try:
            (result,) = generate_ids(model, prompt, params)
        finally:
            norm_module._compiled = compiled
        return (tokens - 1) / result.timings.decode_seconds, result.token_ids

    run("op"), run("torch")  # warm-up
    ratios, speeds = [], {"op": [], "torch": []}
    same = True
    for r in range(rounds):
        order = ("op", "torch") if r % 2 else ("torch", "op")
        got = {side: run(side) for side in order}
        same &= got["op"][1] == got["torch"][1]
        for side in order:
            speeds[side].append(got[side][0])
        ratios.append(got["op"][0] / got["torch"][0])
    steps = {"op": [], "torch": []}
    forward = model.forward

    def alternating(batch):
        side = "op" if len(steps["op"]) < len(steps["torch"]) else "torch"
        norm_module._compiled = compiled if side == "op" else (lambda h, x, out: False)
        start = time.perf_counter()
        try:
            return forward(batch)
        finally:
            steps[side].append(time.perf_counter() - start)
            norm_module._compiled = compiled

    model.forward = alternating
    try:
        for _ in range(rounds):
            generate_ids(model, prompt, params)
    finally:
        del model.forward
    # each side's median: the prefills (one a round, 128 tokens) are the few slowest
    step_ms = {side: statistics.median(times) * 1e3 for side, times in steps.items()}
    print(
        f"  {threads} thread(s), step by step: median forward ms op {step_ms['op']:.2f}, "
        f"torch {step_ms['torch']:.2f}, torch/op {step_ms['torch'] / step_ms['op']:.3f} "
        f"({len(steps['op'])} + {len(steps['torch'])} steps)"
    )
    print(
        f"  {threads} thread(s): op/torch decode tok/s per round "
        f"{[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}; "
        f"median tok/s op {statistics.median(speeds['op']):.1f}, "
        f"torch {statistics.median(speeds['torch']):.1f}; same tokens: {same}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()
    reason = kernels.available()
    if reason is not None:
        raise SystemExit(reason)
    print(f"norm path {kernels.norm_auto_path()} (of {', '.join(kernels.norm_paths())})")
    if not args.skip_micro:
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"op alone, {threads} thread(s), x bf16, out bf16:")
            microbenchmark()
    if not args.skip_decode:
        print("decode at batch 1, in-process A/B:")
        for threads in args.threads:
            decode_ab(threads, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
