"""`ForwardBatch`: everything one forward through the model reads, passed as an argument.

The tokens of every sequence in the step are flat, sequence after sequence, whatever mix
of prompt chunks and decode tokens the step holds:

    token_ids       (T,)   long   the ids to run
    positions       (T,)   long   each token's position in its sequence (RoPE); (3, T) under
                                  M-RoPE (temporal, height, width: `qinfer.vision.mrope`)
    query_starts    S + 1  ints   sequence s runs tokens query_starts[s]:query_starts[s + 1]
    logits_indices  (R,)   long   the rows of the hidden states whose logits are wanted,
                                  ascending: any number per sequence (the last token of each
                                  sequence that samples; several when verifying proposed
                                  tokens; every token for prompt logprobs)
    attention       the step's `StepAttention`: K/V storage and this step's metadata
                    (caches and row shape, or block tables, slots and history lengths)
    images          None (text), or the step's `BatchImages`: embeddings that replace the
                    image tokens' rows, and DeepStack features added to them
    states          None (no linear-attention layers), or the step's
                    `qinfer.attention.state_pool.StepStates`: the recurrent-state pool of
                    the Gated DeltaNet layers and each sequence's slot in it, in
                    query_starts order
    rotations       the RoPE cos/sin of these positions (`Rotations`), made with the batch:
                    computed once per RoPE setting, shared by every layer of the forward
    adapters        None (no row runs a LoRA adapter: the base model alone), or the step's
                    `AdapterRows`: which rows run through which adapter slot

and, for a step over KV pools (a runner's, `qinfer.attention.step_buffers`), what its
attention is planned from (`AttentionBackend.plan`):

    context_lens    (S,)   long   each sequence's history length after the step
    num_computed    S      ints   the tokens each sequence has in the pool before the step
    block_size             int    tokens per block
    spaces[s]       block space s's slots and tables (`SpaceTensors`;
                    `qinfer.attention.block_spaces`: sliding layers keep only their window)

    hidden = model.forward(batch)                                    # (T, hidden)
    logits = model.compute_logits(batch.logits_rows(hidden))        # (R, vocab) fp32

Nothing reaches the layers but this argument (no global context): data flow one can
follow. The forms a step takes are three: the plain step the scheduler decided
(`qinfer.runtime.step.ScheduledStep`), this, and what comes back
(`qinfer.runtime.runner.StepOutput`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import NamedTuple, Protocol

import torch


class StepAttention(Protocol):
    """One forward's attention: the storage (caches or pools, which outlive the step) and
    this step's metadata (row shape and mask, or block tables, slots and history lengths);
    `qinfer.attention.backend` makes them."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store k, v (T, Hkv, D) of `layer` and attend q (T, Hq, D) -> (T, Hq, D)."""
        ...


class SpaceTensors(NamedTuple):
    """One block space's part of a step over KV pools (views of the runner's buffers).

    slots (T,): where each new token's K/V go in the space's pool; block_tables (S, W) long:
    the blocks each sequence's step reads, padded with block 0, and tables: the same as
    host lists, unpadded. In a window space each table starts at logical block
    first_blocks[b] (host ints) and key_starts (S,) holds first_blocks[b] * block_size; in
    a whole-history space both are None (tables start at block 0)."""

    slots: torch.Tensor
    block_tables: torch.Tensor
    tables: list[list[int]]
    first_blocks: list[int] | None
    key_starts: torch.Tensor | None


class AdapterRows(NamedTuple):
    """The rows of one step that run through LoRA adapters: rows (n,) long, ascending, the
    flat step's rows of the sequences that chose one, and slots (n,) long, each row's
    adapter slot (`qinfer.linear.lora.LoraLinear`). Other rows run the base model alone."""

    rows: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of_sequences(
        cls, query_starts: list[int], slots: list[int | None], device: torch.device | str
    ) -> AdapterRows | None:
        """Sequence b's rows query_starts[b]:query_starts[b + 1] through slots[b] (None:
        the base model); None where no sequence has an adapter."""
        rows: list[int] = []
        row_slots: list[int] = []
        for (start, end), slot in zip(pairwise(query_starts), slots, strict=True):
            if slot is not None:
                rows += range(start, end)
                row_slots += [slot] * (end - start)
        if not rows:
            return None
        return cls(
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(row_slots, dtype=torch.long, device=device),
        )


@dataclass(frozen=True)
class BatchImages:
    """The images of one step, as the language model takes them (Qwen2.5-VL, Qwen3-VL).

    rows        (N,) long: the step's token rows (its image tokens) the images fill, in the
                order of the embeddings; a chunk of a prompt holds the rows it runs
    embeddings  (N, hidden) fp32: the vision tower's merged tokens, which replace the
                embedded image tokens at those rows
    deepstack   k tensors (N, hidden) fp32 (Qwen3-VL; none for Qwen2.5-VL): feature i is
                added to those rows' hidden states after text layer i
    """

    rows: torch.Tensor
    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


class Rotations:
    """The cos/sin of one forward's positions (`ForwardBatch.rotations`), for each RoPE
    setting its layers use (`qinfer.layers.rope`: anything with `rotation(positions,
    dtype)`): computed when the first layer of a setting asks, then shared by every other
    layer of that setting (and by q and k). Made with each batch, so a step never reads
    another's.

    A graph being traced (`torch.compile`) keeps none: what it read of them would be a
    guard on the layers before, and the graph merges the layers' equal ops itself."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self._computed: dict[tuple, tuple] = {}

    def of(self, rope, dtype: torch.dtype) -> tuple:
        """`rope.rotation(self.positions, dtype)`, computed once per setting and dtype."""
        if torch.compiler.is_compiling():
            return rope.rotation(self.positions, dtype)
        key = (getattr(rope, "frequencies", None), dtype)  # settings share their frequencies
        found = self._computed.get(key)
        if found is None:
            found = self._computed[key] = rope.rotation(self.positions, dtype)
        return found


def row_positions(
    offsets: int | torch.Tensor, batch_size: int, length: int, device: torch.device | str
) -> torch.Tensor:
    """The (B, L) positions of B rows of L tokens: offsets is the first position of every
    row (an int), of each row ((B,)), or already every token's ((B, L)). Left-padded rows
    have negative positions in their padding (RoPE clamps them; the caches mask them)."""
    if isinstance(offsets, int):
        row = torch.arange(offsets, offsets + length, device=device)
        return row.expand(batch_size, length)
    offsets = offsets.to(device)
    if offsets.dim() == 1:
        return offsets[:, None] + torch.arange(length, device=device)
    return offsets


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor
    positions: torch.Tensor
    query_starts: list[int]
    logits_indices: torch.Tensor
    # None only until a backend plans it (`planned`): a step over pools is planned from it
    attention: StepAttention | None = None
    images: BatchImages | None = None
    # a StepStates (attention/, above this package: not named here)
    states: object | None = None
    context_lens: torch.Tensor | None = None
    num_computed: list[int] | None = None
    block_size: int = 0
    spaces: list[SpaceTensors] = field(default_factory=list)
    adapters: AdapterRows | None = None
    # (not an argument: a batch replaced with other positions gets rotations of its own)
    rotations: Rotations = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rotations", Rotations(self.positions))

    @classmethod
    def from_rows(
        cls,
        tokens: torch.Tensor,
        offsets: int | torch.Tensor,
        attention: StepAttention,
        last_only: bool = False,
        states: object | None = None,
        adapters: list[int | None] | None = None,
    ) -> ForwardBatch:
        """B rows of L tokens each (tokens (B, L), on the model's device), flattened row by
        row; offsets as `row_positions` takes them. Logits for every token, or for the last
        of each row with last_only. states: row b's recurrent state in slot states.slots[b].
        adapters: row b's LoRA adapter slot (None: the base model), or None for none."""
        B, L = tokens.shape
        device = tokens.device
        if last_only:
            logits_indices = torch.arange(L - 1, B * L, L, device=device)
        else:
            logits_indices = torch.arange(B * L, device=device)
        starts = list(range(0, B * L + 1, L))
        return cls(
            token_ids=tokens.reshape(B * L),
            positions=row_positions(offsets, B, L, device).reshape(B * L),
            query_starts=starts,
            logits_indices=logits_indices,
            attention=attention,
            states=states,
            adapters=None
            if adapters is None
            else AdapterRows.of_sequences(starts, adapters, device),
        )

    @property
    def num_new(self) -> list[int]:
        """The tokens each sequence runs in the step."""
        return [end - start for start, end in pairwise(self.query_starts)]

    def planned(self, attention: StepAttention) -> ForwardBatch:
        """This batch with its attention, planned from it."""
        return replace(self, attention=attention)

    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden) -> its rows at logits_indices (R, hidden): hidden itself when
        R == T (ascending indices, so every row in order: a decode step), which spares a
        gather of the whole step."""
        if self.logits_indices.shape[0] == hidden.shape[0]:
            return hidden
        return hidden[self.logits_indices]
