"""A draft model: a smaller (or more quantized) model that guesses the target's next tokens.

The draft keeps its own KV pool with as many blocks as the target's block space 0, and uses
each sequence's table of that space as it is: the target's blocks hold the target's K/V at
the same positions, so no second allocator is needed, and the blocks the scheduler grows for
a verification already cover the positions the draft writes first. Space 0 keeps whole
histories whenever a draft model drafts (`qinfer.attention.block_spaces`: the full-attention
layers' space, or every layer's when all of the target's slide), and the draft keeps all
its layers in one space: its sliding layers, if any, read whole histories masked to their
window.

Proposing k tokens for a batch of sequences costs k draft forwards: the first catches each
sequence up on the tokens its draft cache lacks (the whole prompt the first time, then
the tokens accepted since, and the last sampled one) and guesses the first token; each
next forward runs the previous guess. Guesses are greedy (a point mass, which the target's
rejection sampling handles exactly). `Sequence.num_draft_computed` says how many leading
tokens have their K/V in the draft's pool: after a proposal it counts the guesses too, and
the next proposal first cuts it to the tokens the target kept (a guess that was rejected,
or cut by the scheduler and never verified, is not the sequence's); freeing a sequence's
blocks resets it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from qinfer.attention.block_spaces import BlockSpaces
from qinfer.core.errors import QinferError
from qinfer.engine.sequence import Sequence
from qinfer.model.transformer import Transformer
from qinfer.request.sampling import argmax_rows
from qinfer.runtime.config import RuntimeConfig
from qinfer.runtime.runner import ModelRunner
from qinfer.runtime.step import ScheduledStep


class DraftModel:
    """Greedy proposals from a draft model over the target's block tables.

    target: the model it drafts for (vocabulary and device are checked against it);
    num_blocks, block_size: the target's pool of block space 0, so that block ids mean the
    same.
    """

    def __init__(
        self, draft: Transformer, target: Transformer, num_blocks: int, block_size: int
    ) -> None:
        if draft.config.vocab_size != target.config.vocab_size:
            raise QinferError(
                f"speculative model has a vocabulary of {draft.config.vocab_size} tokens, "
                f"the target {target.config.vocab_size}: a draft must share the target's"
            )
        if draft.config.deltanet is not None:
            raise QinferError(
                f"speculative model: model_type {draft.config.model_type!r} keeps a recurrent "
                "state (Gated DeltaNet), which a draft model cannot keep yet: choose a draft without linear attention"
            )
        if draft.device != target.device:
            raise QinferError(
                f"speculative model is on {draft.device}, the target on {target.device}: "
                "load the draft on the target's device"
            )
        self.model = draft
        spaces = BlockSpaces.whole(draft.config)
        self.runner = ModelRunner(draft, RuntimeConfig(block_size=block_size), [num_blocks], spaces)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        """ks[b] greedy guesses for each sequence after its last token (its blocks cover
        positions up to num_tokens + ks[b] - 2, the last the draft writes)."""
        proposals: list[list[int]] = [[] for _ in seqs]
        for seq in seqs:  # the draft's K/V is the sequence's only up to the tokens kept
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        # First forward: each sequence's missing tokens, up to and with its last one.
        live = list(range(len(seqs)))
        step = ScheduledStep(
            [seqs[b].token_ids[seqs[b].num_draft_computed :] for b in live],
            [seqs[b].num_draft_computed for b in live],
            [[seqs[b].tables[0] for b in live]],
            [1] * len(live),
        )
        for round_ in range(max(ks, default=0)):
            guesses = self._greedy(step)
            for b, guess in zip(live, guesses, strict=True):
                proposals[b].append(guess)
            live = [b for b in live if len(proposals[b]) < ks[b]]
            if not live:
                break
            # The next forward runs each live sequence's latest guess at its position.
            step = ScheduledStep(
                [[proposals[b][-1]] for b in live],
                [seqs[b].num_tokens + round_ for b in live],
                [[seqs[b].tables[0] for b in live]],
                [1] * len(live),
            )
        for seq, guesses in zip(seqs, proposals, strict=True):
            # Its K/V now holds every token and every guess but the last.
            seq.num_draft_computed = seq.num_tokens + len(guesses) - 1
        return proposals

    def _greedy(self, step: ScheduledStep) -> list[int]:
        logits = self.runner.forward(step).logits  # (R, V) fp32
        return argmax_rows(logits).tolist()
