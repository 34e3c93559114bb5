"""Who owns which KV block: a reference-counted pool of fixed-size blocks with prefix caching.

The pool holds `num_blocks` blocks of `block_size` token positions each. A sequence owns
a block table (block ids for its positions 0..B-1, B..2B-1, ...); blocks are reference
counted so that several sequences can share the full blocks of a common prefix.

Prefix caching. Once a block is full and its K/V computed, it is registered under a hash
chained over (parent block's hash, its token ids), so that the hash of block i names the
whole prefix 0..i. A new prompt walks its full blocks from the start and takes every
registered block it finds, until the first miss. A hash is only an index: a hit must also
match the stored token ids and the parent's *content id* (a number given to each distinct
prefix content), so a hash collision can never hand one sequence another's K/V.

Freed blocks keep their K/V and their registration in a least-recently-used free list:
allocating a fresh block takes the least recently freed one and only then forgets what it
held. A sequence frees its blocks last-to-first, so a prompt's tail is evicted before its
head (the head is the part other prompts are likely to share).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as TokenIds

from qinfer.engine.sequence import Sequence
from qinfer.errors import CacheError


def block_hash(parent_hash: int | None, token_ids: TokenIds[int]) -> int:
    """The prefix-cache key of a full block: a hash over its parent's key and its tokens."""
    return hash((parent_hash, tuple(token_ids)))


class Block:
    """One block of the pool: who uses it and, once registered, which prefix it holds."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        """Forget the registered content (the block is about to hold new K/V)."""
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.content_id: int | None = None  # equal for blocks holding equal prefixes
        self.parent_content_id: int | None = None


class BlockManager:
    """Allocates, shares and frees the blocks of the KV pool for sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody uses, least recently freed first (the next to be evicted).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_free_blocks = 0  # free blocks still holding registered K/V
        self.cached: dict[int, int] = {}  # hash -> id of a registered block
        self._content_ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (some still hold reusable prefix K/V)."""
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh blocks `seq` needs so that its table covers positions 0..num_tokens-1."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks to `seq`'s table until it covers num_tokens positions."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self.free_blocks):
            raise CacheError(f"KV pool has {len(self.free_blocks)} free blocks, {needed} needed")
        for _ in range(needed):
            block_id, _ = self.free_blocks.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            if block.content_id is not None:  # evict: forget the prefix it held
                self.num_cached_free_blocks -= 1
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.reset()
            block.ref_count = 1
            seq.block_table.append(block_id)

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        At least one token is always left to compute, so that the step that finishes the
        prompt produces the logits of its last token. A sequence that does not use the
        prefix cache (`Sequence.uses_prefix_cache`) gets none. Returns the tokens found.
        """
        if seq.block_table:
            raise CacheError(f"sequence {seq.request_id!r} already holds blocks")
        looks_up = self.enable_prefix_caching and seq.uses_prefix_cache
        hits = self._match_prefix(seq.token_ids) if looks_up else []
        for block in hits:
            if block.ref_count == 0:
                del self.free_blocks[block.block_id]
                self.num_cached_free_blocks -= 1
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens = seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens *= self.block_size
        return seq.num_computed_tokens

    def _match_prefix(self, token_ids: list[int]) -> list[Block]:
        hits: list[Block] = []
        parent_hash, parent_content = None, None
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            tokens = tuple(token_ids[start : start + self.block_size])
            h = block_hash(parent_hash, tokens)
            block = self._lookup(h, tokens, parent_content)
            if block is None:
                break
            hits.append(block)
            parent_hash, parent_content = h, block.content_id
        return hits

    def _lookup(self, h: int, tokens: tuple[int, ...], parent_content: int | None) -> Block | None:
        """The registered block for this hash, if it really holds these tokens after this parent."""
        block_id = self.cached.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tokens or block.parent_content_id != parent_content:
            return None  # a hash collision: another prefix lives under this key
        return block

    def register_computed(self, seq: Sequence) -> None:
        """Register every full block of `seq` whose K/V are now computed (call after a step)."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // size):
            block = self.blocks[seq.block_table[i]]
            parent = self.blocks[seq.block_table[i - 1]] if i > 0 else None
            if block.content_id is None:
                tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
                parent_hash = parent.hash if parent else None
                parent_content = parent.content_id if parent else None
                block.hash = block_hash(parent_hash, tokens)
                block.token_ids = tokens
                block.parent_content_id = parent_content
                twin = self._lookup(block.hash, tokens, parent_content)
                if twin is None:  # a new prefix (or the key held a colliding one)
                    block.content_id = next(self._content_ids)
                    self.cached[block.hash] = block.block_id
                else:  # the same prefix computed twice: children of either chain match
                    block.content_id = twin.content_id
            seq.num_hashed_blocks = i + 1

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finished, aborted or preempted); its K/V stay cached."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.content_id is None:
                    self.free_blocks[block_id] = None
                    self.free_blocks.move_to_end(block_id, last=False)  # nothing to keep
                else:
                    self.free_blocks[block_id] = None  # most recently used: evicted last
                    self.num_cached_free_blocks += 1
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.num_draft_computed = 0  # the draft's K/V sat in the same blocks
        seq.proposed = []
