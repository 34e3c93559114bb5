"""`ForwardBatch`: everything one forward through the model needs, passed as an argument.

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
    states          None (no linear-attention layers), or the step's `StepStates`: the
                    recurrent-state pool of the Gated DeltaNet layers and each sequence's
                    slot in it, in query_starts order
    rotations       the RoPE cos/sin of these positions (`Rotations`), made with the batch:
                    computed once per RoPE setting, shared by every layer of the forward

    hidden = model.forward(batch)                                    # (T, hidden)
    logits = model.compute_logits(batch.logits_rows(hidden))        # (R, vocab) fp32

Nothing reaches the layers but this argument (no global context): data flow one can follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qinfer.attention.backend import StepAttention
from qinfer.attention.state_pool import StepStates
from qinfer.layers.rope import Rotations, row_positions


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


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor
    positions: torch.Tensor
    query_starts: list[int]
    logits_indices: torch.Tensor
    attention: StepAttention
    images: BatchImages | None = None
    states: StepStates | None = None
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
        states: StepStates | None = None,
    ) -> ForwardBatch:
        """B rows of L tokens each (tokens (B, L), on the model's device), flattened row by
        row; offsets as `row_positions` takes them. Logits for every token, or for the last
        of each row with last_only. states: row b's recurrent state in slot states.slots[b]."""
        B, L = tokens.shape
        device = tokens.device
        if last_only:
            logits_indices = torch.arange(L - 1, B * L, L, device=device)
        else:
            logits_indices = torch.arange(B * L, device=device)
        return cls(
            token_ids=tokens.reshape(B * L),
            positions=row_positions(offsets, B, L, device).reshape(B * L),
            query_starts=list(range(0, B * L + 1, L)),
            logits_indices=logits_indices,
            attention=attention,
            states=states,
        )

    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden) -> its rows at logits_indices (R, hidden): hidden itself when
        R == T (ascending indices, so every row in order: a decode step), which spares a
        gather of the whole step."""
        if self.logits_indices.shape[0] == hidden.shape[0]:
            return hidden
        return hidden[self.logits_indices]
