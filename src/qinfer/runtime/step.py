"""The step a runner runs: what the engine hands the runtime, and what rank 0 broadcasts.

    step = ScheduledStep(new_tokens, num_computed, tables, num_logits)
    output = executor.execute(step)

Plain lists (and, for images, their tensors), no engine types: what the scheduler decided.
The engine builds one from its scheduled sequences
(`qinfer.engine.sequence.scheduled_step`), a draft model from its own, and a tensor-parallel
worker from the two int64 tensors of `qinfer.runtime.step_channel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepImages:
    """One sequence's part of a step of a vision-language model, for a sequence with images.

    positions: (3, n) long, the M-RoPE positions (temporal, height, width) of its n new
    tokens; rows: which of them (0 .. n - 1, ascending) are image tokens; embeddings:
    (len(rows), hidden) fp32, the vision tower's tokens for those rows, in order;
    deepstack: Qwen3-VL's features for the same rows, (len(rows), hidden) fp32 each."""

    positions: torch.Tensor
    rows: list[int]
    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class ScheduledStep:
    """One engine step: per sequence b, new_tokens[b] (ids to run now), num_computed[b]
    (tokens already in the pool), tables[s][b] (its blocks in block space s of the model,
    `qinfer.attention.block_spaces`: a window space's table from the first block the step
    reads, `block_spaces.first_block`), and num_logits[b]: how many of its last new tokens
    produce logits (0 for a prompt chunk that leaves more for later steps; 1 to sample the
    next token; 1 + k to verify k proposed tokens; all of them for a prompt's logprobs;
    `logits_rows` places them). images[b]: None for a
    sequence without images (its positions count up from num_computed[b]), else its
    `StepImages`; images None: no sequence of the step has any (a text step). Images stay
    on rank 0's runner: `step_channel` carries none. state_slots[b]: sequence b's slot in
    the runner's recurrent-state pool (a hybrid model's Gated DeltaNet layers,
    `qinfer.attention.state_pool`; a sequence whose step starts at position 0 starts from
    a zero state there); None for a model without such layers. state_restores: (snapshot
    row, slot) pairs, copied before the forward (sequences that start from a prefix-cache
    hit); state_saves: (slot, snapshot row) pairs, copied after it (sequences whose step
    ends where the prefix cache keeps a snapshot): rows of the same pool
    (`StatePool.copy`). num_proposed[b]: how many of sequence b's new tokens are proposals
    to verify (None: no sequence has any), a hybrid model's state before them kept in the
    slot's checkpoint row; state_rollbacks: slots whose state is set back to that
    checkpoint before the forward (a verification that rejected a proposal). Like images,
    the state copies stay on rank 0's runner (the DeltaNet layers are not split over
    ranks). adapters[b]: the LoRA
    adapter slot sequence b runs through (None: the base model); adapters None: no
    sequence has one."""

    new_tokens: list[list[int]]
    num_computed: list[int]
    tables: list[list[list[int]]]
    num_logits: list[int]
    images: list[StepImages | None] | None = None
    state_slots: list[int] | None = None
    adapters: list[int | None] | None = None
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    num_proposed: list[int] | None = None
    state_rollbacks: list[int] = field(default_factory=list)

    def logits_rows(self) -> tuple[list[int], list[range]]:
        """Its rows of logits, as `logits_rows` places them."""
        return logits_rows([len(ids) for ids in self.new_tokens], self.num_logits)


def logits_rows(num_new: list[int], num_logits: list[int]) -> tuple[list[int], list[range]]:
    """Which rows of a step's logits belong to which sequence, the one place they are
    counted: sequence b runs num_new[b] tokens (flat, after the sequences before it), the
    last num_logits[b] of which produce logits. Returns (rows, spans): rows, the flat
    step's rows whose logits are computed, ascending (`ForwardBatch.logits_indices`);
    spans[b], sequence b's rows of the (R, V) logits, in order: a sampling sequence's last
    row is its next token's, the k before it verify its k proposed tokens (row j: the
    distribution after the j-th proposal); a prompt's logprobs take one row per token."""
    rows: list[int] = []
    spans: list[range] = []
    end = first = 0
    for n, k in zip(num_new, num_logits, strict=True):
        end += n
        rows += range(end - k, end)
        spans.append(range(first, first + k))
        first += k
    return rows, spans
