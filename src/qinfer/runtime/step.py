"""The step a runner runs: what the engine hands the runtime, and what rank 0 broadcasts.

    step = StepInputs(new_tokens, num_computed, block_tables, num_logits)
    output = executor.execute(step)

Plain lists, no engine types: the engine builds one from its scheduled sequences
(`qinfer.engine.sequence.step_inputs`), a draft model from its own, and a tensor-parallel
worker from the two int64 tensors of `qinfer.runtime.step_channel`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInputs:
    """One engine step: per sequence b, new_tokens[b] (ids to run now), num_computed[b]
    (tokens already in the pool), block_tables[b] (its blocks in block space 0), and
    num_logits[b]: how many of its last new tokens produce logits (0 for a prompt chunk
    that leaves more for later steps; 1 to sample the next token; 1 + k to verify k
    proposed tokens; all of them for a prompt's logprobs). window_tables[b]: its blocks in
    space 1, the sliding-window layers' of a model that also has full-attention layers
    (None for a model of one space). A window space's table starts at the first block the
    step reads (`block_spaces.first_block`), whichever space it is."""

    new_tokens: list[list[int]]
    num_computed: list[int]
    block_tables: list[list[int]]
    num_logits: list[int]
    window_tables: list[list[int]] | None = None

    @property
    def tables(self) -> list[list[list[int]]]:
        """Every block space's tables, space after space."""
        if self.window_tables is None:
            return [self.block_tables]
        return [self.block_tables, self.window_tables]
