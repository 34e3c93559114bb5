"""One request as the scheduler sees it: its tokens, its KV blocks, how far it is computed."""

from __future__ import annotations

import enum


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The token ids of one request (prompt, then generated) and the blocks holding their K/V.

    `num_computed_tokens` tokens have their K/V in the pool (at positions 0 .. n-1, in the
    blocks of `block_table`); the rest still have to run through the model. A model with
    sliding-window and full-attention layers keeps the sliding layers' K/V in a block space
    of its own (`qinfer.runtime.block_spaces`), in the blocks of `window_table`, whose
    entries before the window are `NULL_BLOCK` (released). A decoding
    sequence has exactly one uncomputed token, the one it sampled last; a preempted one
    has none computed and prefills prompt and output again.

    `proposed` holds the tokens a speculative proposer guessed to follow (never part of
    `token_ids`): a step runs them after the uncomputed ones, and the verification keeps
    those the model agrees with (`qinfer.speculative`).
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], uses_prefix_cache: bool = True
    ) -> None:
        self.request_id = request_id
        # False: starts from no cached block (a pooling that needs every prompt row)
        self.uses_prefix_cache = uses_prefix_cache
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []  # block ids holding positions 0, B, 2B, ...
        self.window_table: list[int] = []  # the same in block space 1 (if the model has it)
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        # (hash, content id) of the last of those: the parent of the next one registered
        self.last_block_key: tuple[int, int] | None = None
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.proposed: list[int] = []  # guessed next tokens, to verify in the next step
        self.num_draft_computed = 0  # leading tokens with K/V in a draft model's pool

    @property
    def tables(self) -> tuple[list[int], list[int]]:
        """Its block tables in block space 0 and space 1, as they are (not copies)."""
        return self.block_table, self.window_table

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
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
