"""The gated delta rule's forms timed at Qwen3.5-0.8B's shapes (16 value heads, d_k = d_v =
128, fp32 state): the chunked form over a prompt at several chunk sizes, and one decode step
of the recurrent form for 1 and 8 sequences, each as torch's ops and (where the kernels build)
as the compiled op (`kernels.gated_delta_chunked`, `kernels.gated_delta_recurrent`).

    python bench/deltanet_times.py [--prompt 512] [--rounds 5] [--threads 1]

Every case runs once per round, the cases interleaved within each round (so a change in the
machine's load touches them all alike); the best and the median over the rounds are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from qinfer import kernels
from qinfer.attention.deltanet import (
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

HEADS, DK, DV = 16, 128, 128
CHUNK_SIZES = (16, 32, 64, 128)
DECODE_BATCHES = (1, 8)


def rule_inputs(B: int, L: int) -> tuple[torch.Tensor, ...]:
    """q, k (B, L, H, Dk) normalised, v (B, L, H, Dv), g, beta (B, L, H), state (B, H, Dk, Dv)."""
    g = torch.Generator().manual_seed(0)
    q, k = (l2_normalize(torch.randn(B, L, HEADS, DK, generator=g)) for _ in range(2))
    v = torch.randn(B, L, HEADS, DV, generator=g)
    decay = -2 * torch.rand(B, L, HEADS, generator=g)
    beta = torch.rand(B, L, HEADS, generator=g)
    state = torch.randn(B, HEADS, DK, DV, generator=g)
    return q, k, v, decay, beta, state


#: Calls per timing of a decode step (a step is well under a millisecond: one call alone is
#: mostly the timer's and the scheduler's noise).
STEP_CALLS = 20


def cases(prompt: int) -> dict[str, tuple[Callable[[], object], int]]:
    """Name -> (a call of one form, each on its own copy of the start state; calls per timing)."""
    out: dict[str, tuple[Callable[[], object], int]] = {}
    *args, state = rule_inputs(1, prompt)
    compiled = kernels.available() is None
    for C in CHUNK_SIZES:
        out[f"chunked {prompt} tokens, C={C}"] = (
            lambda C=C: chunked_gated_delta_rule(*args, state.clone(), chunk_size=C),
            1,
        )
        if compiled:
            out[f"chunked {prompt} tokens, C={C}, kernel"] = (
                lambda C=C: kernels.gated_delta_chunked(*args, state.clone(), C),
                1,
            )
    for B in DECODE_BATCHES:
        *step, state_b = rule_inputs(B, 1)
        out[f"recurrent step, {B} seq"] = (
            lambda step=step, s=state_b: recurrent_gated_delta_rule(*step, s.clone()),
            STEP_CALLS,
        )
        if compiled:
            out[f"recurrent step, {B} seq, kernel"] = (
                lambda step=step, s=state_b: kernels.gated_delta_recurrent(*step, s.clone()),
                STEP_CALLS,
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timed = cases(args.prompt)
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    with torch.inference_mode():
        for fn, _ in timed.values():  # warm-up
            fn()
        for _ in range(args.rounds):
            for name, (fn, calls) in timed.items():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                seconds[name].append((time.perf_counter() - start) / calls)
    print(f"threads={args.threads} rounds={args.rounds}")
    for name, s in seconds.items():
        print(
            f"{name:32s} best {min(s) * 1e3:8.3f} ms  median {statistics.median(s) * 1e3:8.3f} ms"
        )


if __name__ == "__main__":
    main()
