"""Where greedy decoding leaves a reference's path: the measure of tests/test_numerics.py
and bench/greedy_partings.py.

    gaps = top_two_gaps(outputs)            # the reference's outputs, with logprobs=2
    found = partings(reference, gaps, got)  # [(prompt, step, the reference's gap there)]

A parting at a small gap is a near-tie that any rounding may flip.
"""

from __future__ import annotations

from collections.abc import Sequence

from qinfer.engine.outputs import RequestOutput


def top_two_gaps(outputs: Sequence[RequestOutput]) -> list[list[float]]:
    """Each output's gap between its two highest logits at every step (its logprobs were
    asked for with logprobs >= 2: a difference of logprobs is one of logits)."""
    gaps = []
    for output in outputs:
        top = [sorted(lp.top_logprobs.values(), reverse=True) for lp in output.logprobs]
        gaps.append([best - second for best, second, *_ in top])
    return gaps


def partings(
    reference: Sequence[Sequence[int]],
    gaps: Sequence[Sequence[float]],
    got: Sequence[Sequence[int]],
) -> list[tuple[int, int, float]]:
    """(prompt, step, the reference's top-two gap there) where `got` first leaves the
    reference's tokens, for each prompt that it leaves."""
    found = []
    for p, (want, have) in enumerate(zip(reference, got, strict=True)):
        step = next((i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b), None)
        if step is not None:
            found.append((p, step, gaps[p][step]))
    return found
