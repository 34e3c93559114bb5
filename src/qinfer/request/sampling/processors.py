"""What happens to a row's logits before a token is drawn: per-request logits processors
(`logit_bias`, a thinking budget, a grammar's mask), penalties, top-k, top-p, min-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from qinfer.request.sampling.params import SamplingParams


class LogitsProcessor(Protocol):
    """Per-request logits changes applied before the penalties (a grammar's mask).

    A processor belongs to one request: `__call__` gets that request's row of logits
    (V,) and returns it changed (it may change it in place); `accept` is told every token
    the request accepts, in order; `release` frees what it holds when the request ends
    (finished or aborted), after which it is not called again.
    """

    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, token_id: int) -> None: ...

    def release(self) -> None: ...


class LogitBias:
    """The `LogitsProcessor` of `SamplingParams.logit_bias`: adds each bias to its token's
    logit. Ids past the row's width (a head narrower than the tokenizer says) are skipped:
    no such token can be sampled."""

    def __init__(self, logit_bias: Sequence[tuple[int, float]]) -> None:
        self.ids = [token_id for token_id, _ in logit_bias]
        self.biases = [bias for _, bias in logit_bias]
        self._on: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) with the biases added (in place)."""
        key = (logits.device, logits.shape[-1])
        if key not in self._on:  # built once per device and width: no copy every step
            kept = [(t, b) for t, b in zip(self.ids, self.biases, strict=True) if t < key[1]]
            ids = torch.tensor([t for t, _ in kept], dtype=torch.long, device=logits.device)
            biases = torch.tensor([b for _, b in kept], dtype=logits.dtype, device=logits.device)
            self._on[key] = (ids, biases)
        ids, biases = self._on[key]
        return logits.index_add_(0, ids, biases)

    def accept(self, token_id: int) -> None:
        pass

    def release(self) -> None:
        self._on.clear()


class ThinkingBudget:
    """The `LogitsProcessor` of `SamplingParams.thinking_budget`: once `budget` tokens were
    written inside the `<think>` block, only `</think>` may come next.

    think_open, think_close: the two tokens' ids; inside: the prompt left the block open
    (else the block opens when the first token is `<think>`, and a first token that is
    not means the model answers without thinking).
    """

    def __init__(self, budget: int, think_open: int | None, think_close: int, inside: bool):
        self.budget, self.think_open, self.think_close = budget, think_open, think_close
        self.state = "inside" if inside else "start"  # then "inside", then "done"
        self.spent = 0  # tokens written inside the block

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,), all but `</think>` masked once the budget is spent (in place)."""
        if self.state == "inside" and self.spent >= self.budget:
            close = logits[self.think_close].clone()
            logits.fill_(-math.inf)
            logits[self.think_close] = close if torch.isfinite(close) else 0.0
        return logits

    def accept(self, token_id: int) -> None:
        if self.state == "start":
            self.state = "inside" if token_id == self.think_open else "done"
        elif self.state == "inside":
            if token_id == self.think_close:
                self.state = "done"
            else:
                self.spent += 1

    def release(self) -> None:
        pass


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (to -inf), each row with its own params.

    logits: (B, V) fp32 after penalties. Returns a new (B, V) tensor; rows with temperature
    0 are left unscaled (greedy rows take the argmax, which scaling does not move).
    """
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 for p in params):
        top_k = [p.top_k for p in params]
        widest = max(min(k or vocab, vocab) for k in top_k)  # known here: no device sync
        logits = apply_top_k(logits, torch.tensor(top_k, device=device), widest)
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    return logits


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    prompt_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Repetition, presence and frequency penalties (see the module docstring for who counts).

    logits: (B, V) fp32. Returns a new tensor; rows without penalties are copied unchanged.
    The rows with penalties are processed together, at the ids of their histories only
    (O(history) per row, not O(vocabulary)), without waiting on the device.
    """
    rows = [b for b, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]

    def per_row(field: str) -> torch.Tensor:  # (R, 1)
        return torch.tensor([getattr(params[b], field) for b in rows], device=device)[:, None]

    index = torch.tensor(rows, device=device)
    # (R, V + 1): the rows with penalties, and a spare column that padding ids point to.
    # Several entries may name one id: they scatter the same value, so the result is defined.
    picked = torch.cat([logits[index], logits.new_zeros(len(rows), 1)], dim=1)
    seen = _padded_ids([histories[b] for b in rows], vocab, device)  # prompt and generated
    values, repetition = picked.gather(1, seen), per_row("repetition_penalty")
    picked.scatter_(1, seen, torch.where(values < 0, values * repetition, values / repetition))
    starts = [0 if prompt_lens is None else prompt_lens[b] for b in rows]
    generated = _padded_ids(
        [histories[b][start:] for b, start in zip(rows, starts, strict=True)], vocab, device
    )
    ordered = generated.sort(dim=1).values  # occurrences of each entry's id in its row:
    counts = torch.searchsorted(ordered, generated, right=True) - torch.searchsorted(
        ordered, generated
    )
    penalty = per_row("frequency_penalty") * counts + per_row("presence_penalty")
    picked.scatter_(1, generated, picked.gather(1, generated) - penalty)
    logits = logits.clone()
    logits[index] = picked[:, :vocab]
    return logits


def _padded_ids(
    histories: Sequence[Sequence[int]], vocab: int, device: torch.device | str
) -> torch.Tensor:
    """(R, longest) long: the ids of R histories, padded, with padding and ids outside the
    vocabulary replaced by `vocab` (the spare column of `apply_penalties`)."""
    width = max(1, max(len(history) for history in histories))
    ids = torch.tensor(
        [list(history) + [vocab] * (width - len(history)) for history in histories],
        dtype=torch.long,
        device=device,
    )
    return torch.where((ids >= 0) & (ids < vocab), ids, vocab)


def apply_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, widest: int | None = None
) -> torch.Tensor:
    """Keep each row's top_k[b] highest logits (ties with the k-th kept); 0 = keep all.

    logits: (B, V); top_k: (B,) long. widest: the largest k of any row (0 counting as V),
    when the caller knows it on the host; otherwise it is read from the device.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # (B,)
    widest = int(k.max()) if widest is None else widest
    top_values = torch.topk(logits, widest, dim=-1).values  # (B, K)
    kth = top_values.gather(1, (k - 1)[:, None])  # (B, 1)
    return logits.masked_fill(logits < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p[b].

    logits: (B, V); top_p: (B,) in (0, 1]. The most likely token is always kept.
    """
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
    drop_sorted = cumulative <= (1 - top_p)[:, None]
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p[b] times the row's top probability.

    logits: (B, V); min_p: (B,) in [0, 1].
    """
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -math.inf)
