"""The shape-static decode step: a step of decode tokens padded to a bucket of shapes.

A dynamic step's tensors are as large as what it holds: G sequences, tables as wide as the
longest. A bucketed step (`RuntimeConfig.static_decode`) pads both up to the next power of
two, so that one bucket (Gb rows, Wb blocks per table in each block space) is one fixed
set of shapes, step after step:

    G = 3 decode rows, longest table 5 blocks  ->  Gb = 4 rows, Wb = 8 blocks

The padding rows decode token 0 at position 0 into a scratch block of each pool, which no
sequence is ever given (the runner allocates it past the blocks it reports): their K/V
land there, their one key is that token's own, and their logits are dropped. With the
step's tensors in the runner's `StepBuffers` (fixed addresses) and a backend that plans
such a step without host work or new tensors (`AttentionBackend.static_decode`), every
tensor of a bucket's step is a view of those buffers or an op's output over them: what a
CUDA graph captured per bucket replays, and what the tests count.
"""

from __future__ import annotations

from dataclasses import replace

from qinfer.runtime.step import ScheduledStep


def bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, or cap when that is larger than cap (and n fits)."""
    return min(1 << (n - 1).bit_length(), max(n, cap))


def is_decode(step: ScheduledStep) -> bool:
    """Every sequence runs one token and samples from it: a step a bucket can hold."""
    return all(len(ids) == 1 for ids in step.new_tokens) and all(
        count == 1 for count in step.num_logits
    )


def padded(
    step: ScheduledStep, scratch: list[int], max_rows: int, max_widths: list[int]
) -> tuple[ScheduledStep, list[int]]:
    """A decode step padded to its bucket: (the step with Gb - G padding rows after its own,
    each space's table width Wb). scratch[s]: the scratch block of space s's pool;
    max_rows, max_widths[s]: the buffers' capacities (a bucket never grows them)."""
    G = len(step.new_tokens)
    pad = bucket(G, max_rows) - G
    widths = [
        bucket(max(map(len, tables)), cap)
        for tables, cap in zip(step.tables, max_widths, strict=True)
    ]
    bucketed = replace(
        step,
        new_tokens=step.new_tokens + [[0]] * pad,
        num_computed=step.num_computed + [0] * pad,
        tables=[
            tables + [[block]] * pad for tables, block in zip(step.tables, scratch, strict=True)
        ],
        num_logits=step.num_logits + [1] * pad,
    )
    return bucketed, widths
