"""The checkpoint's own multi-token-prediction head as the draft (`qinfer.model.mtp_head`).

At position i the head reads the model's final-normed hidden state h_i and the token at
i + 1 and guesses the token at i + 2. So for a decoding sequence whose last token t_n
(sampled, at position n) the model has not run yet, one head forward at position n - 1
(token t_n, state h_{n-1}) guesses t_{n+1}; each further guess runs the head at the next
position on its previous guess and its own output g in place of h.

Its cache: the head's one attention layer keeps K/V for every earlier position, in a paged
pool of its own with as many blocks as the target's block space 0, addressed through each
sequence's table of that space (as a draft model's: `draft.py`), so nothing is recomputed
and no allocator is added. Cost: one layer's K/V per block beside the target's layers'
(Qwen3.5-0.8B: 6 full-attention layers, so a sixth more KV memory, outside the pool's
budget), and per proposal one head forward over the positions it has not seen plus k - 1
one-row forwards.

The head needs h at every position whose K/V it writes: the engine asks the step for the
final-normed hidden rows of each sampling sequence's new tokens (`ModelRunner.forward`'s
hidden rows) and hands them to `took`; they are held per sequence from the first position
the head has not run (`Sequence.num_draft_computed`) until the next proposal consumes them:
a prompt's rows (hidden x 4 bytes each) until its first decode step, then the 1 + accepted
rows of each verification (a step that hands rows over runs as it is: no static-decode
padding, no CUDA graph replay). Rows computed by a verification whose proposals were partly
rejected are kept for the accepted tokens: a hybrid model runs those again after its state
rollback, and their first values serve the head as well. A sequence lacking rows (a
prefix-cache hit's cached positions, whose K/V in the head's pool are whatever wrote
those blocks last) proposes from what it has: the guesses are only less likely kept.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from qinfer.attention.block_spaces import BlockSpaces
from qinfer.core.errors import QinferError
from qinfer.engine.sequence import Sequence
from qinfer.model.transformer import Transformer
from qinfer.request.sampling import argmax_rows
from qinfer.runtime.config import RuntimeConfig
from qinfer.runtime.runner import ModelRunner
from qinfer.runtime.step import ScheduledStep


class MtpDraft:
    """Greedy proposals from `target.mtp` over the target's block tables of space 0
    (num_blocks blocks of block_size tokens)."""

    def __init__(self, target: Transformer, num_blocks: int, block_size: int) -> None:
        if target.mtp is None:
            raise QinferError(
                "speculative method 'mtp' needs the model's MTP head: give the engine the "
                "checkpoint's path, or load it with load_model(path, mtp=True)"
            )
        self.target, self.head = target, target.mtp
        spaces = BlockSpaces.whole(self.head.config)
        self.runner = ModelRunner(
            self.head, RuntimeConfig(block_size=block_size), [num_blocks], spaces
        )
        # request id -> (position of the first row, (P, hidden) fp32 final-normed rows)
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}

    def took(self, seq: Sequence, first: int, rows: torch.Tensor | None) -> None:
        """A step ran seq's new tokens from position `first`; rows: their final-normed
        hidden states (n, hidden). Keeps those at positions whose token is the sequence's
        (accepted), from the first the head has not run."""
        if rows is None or seq.is_finished:
            return
        rows = rows[: max(0, seq.num_tokens - 1 - first)]
        start, held = self._hidden.get(seq.request_id, (first, rows[:0]))
        if start <= first <= start + len(held):  # continues (or rewrites) what is held
            held = torch.cat([held[: first - start], rows])
        else:  # recomputed from earlier (a preemption), or a gap (a prefix-cache hit)
            start, held = first, rows
        lo = seq.num_draft_computed  # the head's K/V holds the positions before
        if start < lo:
            held, start = held[lo - start :], lo
        self._hidden[seq.request_id] = (start, held)

    def ready(self, seq: Sequence) -> bool:
        """Whether seq's hidden rows reach its last computed position (n - 1 for the last
        token at n), and the head has a position to run."""
        start, held = self._hidden.get(seq.request_id, (0, None))
        return held is not None and len(held) > 0 and start + len(held) == seq.num_tokens - 1

    def finished(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        """ks[b] greedy guesses for each (`ready`) sequence after its last token (its blocks
        cover positions up to num_tokens + ks[b] - 2, the last the head writes)."""
        device = self.target.device
        proposals: list[list[int]] = [[] for _ in seqs]
        tokens, starts, hidden = [], [], []
        for seq in seqs:  # each catches up from its first held row to its last token
            start, held = self._hidden[seq.request_id]
            tokens.append(seq.token_ids[start + 1 : seq.num_tokens])
            starts.append(start)
            hidden.append(held)
        h = torch.cat(hidden).to(device)  # (T, hidden)
        live = list(range(len(seqs)))
        for round_ in range(max(ks, default=0)):
            step = ScheduledStep(
                [tokens[b] for b in live],
                [starts[b] for b in live],
                [[seqs[b].tables[0] for b in live]],
                [1] * len(live),
            )
            batch = self.runner.forward_batch(step)
            g = self.head.hidden(batch, h, self.target)  # (T, hidden)
            g = batch.logits_rows(g)  # each sequence's last row: (R, hidden)
            guesses = argmax_rows(self.head.logits(g, self.target)).tolist()
            for b, guess in zip(live, guesses, strict=True):
                proposals[b].append(guess)
            going = [i for i, b in enumerate(live) if len(proposals[b]) < ks[b]]
            if not going:
                break
            # the next forward: each live sequence's guess at the next position, on its g
            live = [live[i] for i in going]
            h = g[torch.tensor(going, device=g.device)]
            for b in live:  # guess round_ + 1 ran at position n + round_ (n: the last token's)
                tokens[b], starts[b] = [proposals[b][-1]], seqs[b].num_tokens - 1 + round_
        for seq, held in zip(seqs, hidden, strict=True):
            # its head K/V now holds every position before its last token; the rows are spent
            seq.num_draft_computed = seq.num_tokens - 1
            self._hidden[seq.request_id] = (seq.num_tokens - 1, held[:0])
        return proposals
