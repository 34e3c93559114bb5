"""The engine's side of speculative decoding: who proposes, how many tokens, and counts.

Before each step the engine asks `propose` to fill `Sequence.proposed` for its decoding
sequences; after sampling it reports each verification to `verified`. k adapts per
sequence: it grows back to num_speculative_tokens while every proposal is kept, drops to
one more than the tokens kept when some are rejected, and after proposals that keep
nothing the sequence pauses proposing for 1, 3, 7 then 15 steps: a workload with nothing
to copy then pays for almost no rejected rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from qinfer.engine.block_manager import BlockManager
from qinfer.engine.sequence import Sequence
from qinfer.engine.speculative.config import SpeculativeConfig
from qinfer.engine.speculative.draft import DraftModel
from qinfer.engine.speculative.mtp import MtpDraft
from qinfer.engine.speculative.ngram import propose_ngram
from qinfer.model.loading import load_model
from qinfer.model.transformer import Transformer

#: The longest pause (in steps) of a sequence whose proposals keep nothing.
MAX_PAUSE = 15


@dataclass
class SpeculationCounts:
    """Totals since the engine started: steps that verified proposals, tokens proposed,
    tokens of those kept. Each verification also yields one token of the model's own,
    so the mean tokens per verifying step is 1 + accepted / verifications."""

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0


class _Length:
    """One sequence's adaptive k (see the module docstring)."""

    def __init__(self, k_max: int) -> None:
        self.k_max = self.k = k_max
        self.misses = 0  # consecutive verifications that kept nothing
        self.pause = 0  # steps left without proposing

    def next(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        self.k = min(self.k_max, self.k + 1) if accepted == proposed else accepted + 1
        self.misses = self.misses + 1 if accepted == 0 else 0
        self.pause = min(MAX_PAUSE, 2**self.misses - 1)


class Speculator:
    """Proposes tokens for an engine's decoding sequences (`SpeculativeConfig`).

    target: the engine's model; num_blocks, block_size: its KV pool's of block space 0 (a
    draft model's pool, and the MTP head's, mirror it). The draft checkpoint, when the config
    names a path, is loaded here on the target's device; method "mtp" drafts with
    `target.mtp`, which needs each step's hidden rows (`needs_hidden`, `took`).
    """

    def __init__(
        self, config: SpeculativeConfig, target: Transformer, num_blocks: int, block_size: int
    ) -> None:
        self.config = config
        self.draft: DraftModel | MtpDraft | None = None
        if config.method == "mtp":
            self.draft = MtpDraft(target, num_blocks, block_size)
        elif config.method == "draft":
            draft = config.model
            if not isinstance(draft, Transformer):
                draft = load_model(
                    draft, device=target.device, dtype=config.dtype, quantize=config.quantize
                )
            self.draft = DraftModel(draft, target, num_blocks, block_size)
        self.counts = SpeculationCounts()
        self._lengths: dict[str, _Length] = {}

    def propose(self, seqs: Iterable[tuple[Sequence, int]], block_manager: BlockManager) -> None:
        """Fill `proposed` of each (sequence, room) given: a decoding sequence (one
        uncomputed token) that may still generate `room` tokens. A proposal never exceeds
        room - 1 (the verification adds one token of its own), and a draft model's needs
        blocks the pool has free (speculation never preempts); the MTP head proposes for a
        sequence once it holds its hidden rows (`MtpDraft.ready`)."""
        chosen: list[tuple[Sequence, int]] = []
        for seq, room in seqs:
            length = self._lengths.setdefault(
                seq.request_id, _Length(self.config.num_speculative_tokens)
            )
            k = min(length.next(), room - 1)
            if k < 1:
                continue
            if self.draft is None:
                seq.proposed = propose_ngram(
                    seq.token_ids, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max
                )
            elif isinstance(self.draft, MtpDraft) and not self.draft.ready(seq):
                continue
            elif block_manager.can_grow(seq, seq.num_tokens + k):
                block_manager.grow(seq, seq.num_tokens + k)
                chosen.append((seq, k))
        if chosen:
            proposals = self.draft.propose([s for s, _ in chosen], [k for _, k in chosen])
            for (seq, _), guesses in zip(chosen, proposals, strict=True):
                seq.proposed = guesses

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Record that `accepted` of the `proposed` tokens of seq's step were kept (its
        num_computed_tokens already counts them, unless a hybrid model runs them again)."""
        self.counts.verifications += 1
        self.counts.proposed += proposed
        self.counts.accepted += accepted
        length = self._lengths.get(seq.request_id)
        if length is not None:
            length.update(proposed, accepted)

    @property
    def needs_hidden(self) -> bool:
        """Whether each step's sampling sequences hand their hidden rows to `took`."""
        return isinstance(self.draft, MtpDraft)

    def took(self, seq: Sequence, first: int, rows: torch.Tensor | None) -> None:
        """seq's step ran its new tokens from position `first`, their final-normed hidden
        states `rows` (n, hidden), its sampling done (`MtpDraft.took`)."""
        if isinstance(self.draft, MtpDraft):
            self.draft.took(seq, first, rows)

    def finished(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)
        if isinstance(self.draft, MtpDraft):
            self.draft.finished(request_id)
