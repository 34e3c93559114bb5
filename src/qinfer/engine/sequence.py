"""One request as the scheduler sees it: its tokens, its KV blocks, how far it is computed;
and the runtime's step (`scheduled_step`) made of the sequences a step runs."""

from __future__ import annotations

import enum

from qinfer.attention.block_spaces import BlockSpaces, first_block
from qinfer.engine.images import SequenceImages
from qinfer.lora.adapters import Loaded
from qinfer.runtime.step import ScheduledStep


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The token ids of one request (prompt, then generated) and the blocks holding their K/V.

    `num_computed_tokens` tokens have their K/V in the pool (at positions 0 .. n-1, in the
    blocks of `tables`, one table per block space of the model,
    `qinfer.attention.block_spaces`: space 0's first, sized by the block manager); the rest
    still have to run through the model. A window space's entries before the window are
    `NULL_BLOCK` (released). A decoding
    sequence has exactly one uncomputed token, the one it sampled last; a preempted one
    has none computed and prefills prompt and output again.

    `proposed` holds the tokens a speculative proposer guessed to follow (never part of
    `token_ids`): a step runs them after the uncomputed ones, and the verification keeps
    those the model agrees with (`qinfer.engine.speculative`).

    `images` (a vision-language model's prompt with images: `qinfer.engine.images`) holds
    where their tokens are, their M-RoPE positions, their cache keys and their embeddings.

    `state_slot`: a hybrid model's, its slot in the runner's recurrent-state pool while it
    runs (the block manager's to give and take; None otherwise). Its prefix cache
    (`engine.block_manager`): `snapshot_source`, the snapshot row its state starts from
    (a hit, until its first step ran); `snapshot_row`, the row reserved for its state after
    the step being scheduled; `shared_prefix_end`, where its K/V hit ended at admission
    when beyond the snapshots (a point to snapshot; 0: none). `state_rollback`: its next
    step sets its state back to the checkpoint before its last proposals (some were
    rejected: `qinfer.engine.speculative`).
    `adapter` (a request with a LoRA adapter: `qinfer.lora.adapters.Loaded`) names its
    key, which keys its blocks in the prefix cache: an adapter's K/V never serve the base
    model or another adapter; `adapter_slot`, the slot its rows run through, is the
    engine's to set when the scheduler admits it and the adapter is made resident
    (`Engine._adapter_ready`), and holds until it finishes.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        uses_prefix_cache: bool = True,
        images: SequenceImages | None = None,
        adapter: Loaded | None = None,
    ) -> None:
        self.request_id = request_id
        self.images = images
        self.adapter = adapter
        self.adapter_slot: int | None = None
        # False: starts from no cached block (a pooling that needs every prompt row)
        self.uses_prefix_cache = uses_prefix_cache
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        # per block space, the block ids holding positions 0, B, 2B, ...
        self.tables: list[list[int]] = [[]]
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        # (hash, content id) of the last of those: the parent of the next one registered
        self.last_block_key: tuple[int, int] | None = None
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.proposed: list[int] = []  # guessed next tokens, to verify in the next step
        self.num_draft_computed = 0  # leading tokens with K/V in a draft model's pool
        self.state_slot: int | None = None
        self.snapshot_source: int | None = None
        self.snapshot_row: int | None = None
        self.shared_prefix_end = 0
        self.state_rollback = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the next step would run: the uncomputed ones and the proposed ones."""
        return self.num_uncomputed_tokens + len(self.proposed)

    def block_key(self, start: int, end: int) -> tuple[int | bytes, ...]:
        """What the prefix cache keys its block of positions start .. end - 1 on: their
        token ids, then the digests of the images whose tokens they hold (the same ids
        with another image's pixels are another block), then its LoRA adapter's key."""
        key = tuple(self.token_ids[start:end])
        if self.images is not None:
            key += self.images.digests_in(start, end)
        if self.adapter is not None:
            key += (b"lora:%d" % self.adapter.key,)
        return key

    def new_tokens(self, n: int) -> list[int]:
        """The next n tokens to run: uncomputed ones first, then proposed ones."""
        start = self.num_computed_tokens
        pending = self.token_ids[start : start + n]
        return pending + self.proposed[: n - len(pending)]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.tables})"
        )


def scheduled_step(
    seqs: list[Sequence],
    num_new: list[int],
    num_logits: list[int],
    spaces: BlockSpaces,
    block_size: int,
) -> ScheduledStep:
    """The step that runs num_new[b] new tokens of each sequence (their blocks already
    allocated): its uncomputed tokens, then its proposed ones (`Sequence.proposed`);
    num_logits[b] of them, counted from the last, produce logits (0: a prompt chunk that
    leaves more of its prompt for later steps, or a pooling sequence); its tables in each
    of the model's block spaces, a window space's from the first block the step reads;
    the positions and image embeddings of its sequences with images (encoded already);
    the state slots of a hybrid model's sequences, the snapshots the step restores and
    saves (`engine.block_manager`), its proposals and rollbacks.
    Token ids are not checked: the engine checked every prompt when it came in, sampled
    ids come from the logits, and proposed ids from the vocabulary."""
    tables = [
        [
            _read_table(seq.tables[space], seq.num_computed_tokens, window, block_size)
            for seq in seqs
        ]
        for space, window in enumerate(spaces.windows)
    ]
    images = [
        None if seq.images is None else seq.images.step(seq.num_computed_tokens, n)
        for seq, n in zip(seqs, num_new, strict=True)
    ]
    slots = [seq.state_slot for seq in seqs]
    restores = [(s.snapshot_source, s.state_slot) for s in seqs if s.snapshot_source is not None]
    saves = [(s.state_slot, s.snapshot_row) for s in seqs if s.snapshot_row is not None]
    proposed = [len(seq.proposed) for seq in seqs]
    adapters = [seq.adapter_slot for seq in seqs]
    return ScheduledStep(
        [seq.new_tokens(n) for seq, n in zip(seqs, num_new, strict=True)],
        [seq.num_computed_tokens for seq in seqs],
        tables,
        list(num_logits),
        images if any(image is not None for image in images) else None,
        state_slots=None if None in slots else slots,
        adapters=adapters if any(slot is not None for slot in adapters) else None,
        state_restores=restores,
        state_saves=saves,
        num_proposed=proposed if any(proposed) else None,
        state_rollbacks=[seq.state_slot for seq in seqs if seq.state_rollback],
    )


def _read_table(table: list[int], num_computed: int, window: int | None, size: int) -> list[int]:
    """The entries of a sequence's table in a space of this window that a step whose
    queries start at num_computed reads: all of them, or a window's from its first block."""
    return table if window is None else table[first_block(num_computed, window, size) :]
