"""The greedy pick of every row, the fastest way for the row count and vocabulary at hand."""

from __future__ import annotations

import torch

#: Width of the slices `argmax_rows` reduces first, the vocabulary from which it does
#: (below it, one argmax pass is as fast), and the logits per thread (rows per thread x V)
#: up to which one argmax pass is still faster (see `argmax_rows`).
ARGMAX_SLICE = 1024


ARGMAX_SLICED_FROM = 32 * ARGMAX_SLICE


ARGMAX_LOGITS_PER_THREAD = 150_000


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) the index of each row's maximum, the first one on ties:
    `logits.argmax(-1)`, or the same index in two cheap passes (`sliced_argmax`) where V
    is large and each thread has more than ARGMAX_LOGITS_PER_THREAD logits to scan.

    On CPU torch's argmax over a row is not vectorized (about 0.7-0.9 ns a logit, rows
    spread over the threads), while `sliced_argmax` costs about 100 us whatever B, then a
    few us per row: its dozen small ops each pay their dispatch, and between two forwards
    (where sampling runs, the CPU's caches full of the model's) that is several us an op.
    (Where each wins: docs/BENCHMARKS.md, "Argmax over a vocabulary".)
    """
    B, V = logits.shape
    threads = torch.get_num_threads()
    if (
        logits.device.type != "cpu"
        or V < ARGMAX_SLICED_FROM
        or -(-B // threads) * V <= ARGMAX_LOGITS_PER_THREAD
    ):
        return logits.argmax(dim=-1)
    return sliced_argmax(logits)


def sliced_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) `logits.argmax(-1)` in two vectorized passes: each row's
    maximum is found per slice of ARGMAX_SLICE logits (`amax`), the first slice holding
    the row's maximum is picked (argmax over B x V/1024 values), and the argmax within that
    slice (B x 1024) is the answer: the same index argmax gives, NaN included (both take
    NaN as largest)."""
    B, V = logits.shape
    whole = V - V % ARGMAX_SLICE  # the tail past the last whole slice is a slice of its own
    maxima = logits[:, :whole].view(B, -1, ARGMAX_SLICE).amax(dim=-1)  # (B, V // slice)
    if whole < V:
        maxima = torch.cat((maxima, logits[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    starts = maxima.argmax(dim=-1) * ARGMAX_SLICE  # (B,) each row's slice
    columns = starts[:, None] + torch.arange(ARGMAX_SLICE, device=logits.device)
    # the tail's slice is short: its columns past V read the last logit again, which can
    # only be picked if that logit is the maximum (argmax keeps its first occurrence)
    window = logits.gather(1, columns.clamp_(max=V - 1))  # (B, slice)
    return starts + window.argmax(dim=-1)
