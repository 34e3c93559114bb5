"""Who owns which KV block: reference-counted pools of fixed-size blocks with prefix caching.

A pool (`BlockPool`) holds `num_blocks` blocks of `block_size` token positions each. A
sequence owns a block table in each block space of the model (`qinfer.attention.block_spaces`:
one space for most models; two, each with a pool of its own, for a model with sliding-window
and full-attention layers): block ids for its positions 0..B-1, B..2B-1, ... Blocks are
reference counted so that several sequences can share the full blocks of a common prefix.

Window spaces. A space of window W (its layers slide) gives a block back as soon as no query
can read it any more: once a sequence's first c tokens are computed, its next queries start
at position c and read from c - W + 1 on, so after each step (`register_computed`) every
block wholly before that is released and its table entry becomes `NULL_BLOCK`. A sequence
then holds about W / B + 2 blocks of that space, however long it grows.

Prefix caching. Once a block is full and its K/V computed, it is registered under a hash
chained over (parent block's hash, its token ids and the digests of the images whose
tokens it holds: `Sequence.block_key`), so that the hash of block i names the
whole prefix 0..i. A new prompt walks its full blocks from the start and takes every
registered block it finds, until the first miss. A hash is only an index: a hit must also
match the stored key and the parent's *content id* (a number given to each distinct
prefix content), so a hash collision can never hand one sequence another's K/V. The walk is
space 0's; a window space registers each block under the hash and content id of space 0's
block at that index, and a hit of N tokens takes from it only the blocks the sequence's next
step reads (positions N - W + 1 .. N - 1; before them, NULL_BLOCK): the hit is the longest
for which every space holds what it needs. When every layer slides, space 0 is a window
space: its released blocks stay registered, and a hit needs the whole chain still there.

Disk. With a disk tier (`qinfer.engine.disk_cache`), a hit in memory is extended by the
blocks that follow it on disk (`_read_from_disk`: read into fresh blocks, registered as if
computed), and a finished sequence's registered blocks are handed to it (`save_to_disk`).
A block's `generation` (times allocated) tells the tier's writer thread whether a block it
was handed has been reused since.

Freed (and released) blocks keep their K/V and their registration in a least-recently-used
free list: allocating a fresh block takes the least recently freed one and only then forgets
what it held. A sequence frees its blocks last-to-first, so a prompt's tail is evicted before
its head (the head is the part other prompts are likely to share).

State slots. A hybrid model (Gated DeltaNet layers) keeps a fixed-size recurrent state per
running sequence in the runner's state pool (`qinfer.attention.state_pool`): the manager
gives a sequence one of its `state_slots` when it is admitted (`allocate_prefix`) and takes
it back with its blocks (`free`: finished, aborted or preempted; a preempted sequence is
recomputed from its first token, so its state need not be kept). A sequence is admitted
only while a slot is free (`can_admit`).

State snapshots (a hybrid model's prefix cache). The K/V of a cached prefix are not enough
for a hybrid model: its DeltaNet layers need their state after exactly those tokens, which
no block holds (the state is the whole history folded into a fixed size). So the cache
also keeps snapshots, each a copy of one sequence's state (every DeltaNet layer's conv
window and fp32 matrix) at a block boundary, in a snapshot row of the runner's state pool
(`attention.state_pool`), indexed by the content id of the prefix's last block
(`engine.state_snapshots`). A hit is then the longest registered chain of blocks whose
last block has a snapshot: the sequence takes those blocks and its slot gets a copy of the
snapshot before its first step (`Sequence.snapshot_source`); what it reports cached is
what it skipped. Blocks beyond the last snapshot are recomputed (their twins registered).

Snapshots are taken where the scheduler makes a prompt's prefill chunk end
(`cut_at_snapshot`: the chunk is cut short there, a row reserved, and the runner copies
the state in after the step), at two points of a prompt: the end of its last full block,
for a prompt sent again or continued (a chat's next turn); and where its K/V hit ended at admission when the snapshots had less
(`Sequence.shared_prefix_end`): the point where it diverged from a prompt seen before, so
where the next prompts that share that prefix (a system prompt) will diverge too. A block
boundary every N blocks would find such points only by luck, at N times the snapshots.

Memory: a snapshot is a state slot's worth (Qwen3.5-0.8B: 18.6 MiB, as much as ~100 KV
blocks of 16 tokens of its attention layers; `StatePool`'s docstring), so snapshots are
few: `EngineConfig.state_snapshots` rows (by default at most a quarter of the pool's
budget and at most max_num_seqs), a prompt's end never taking the row of a prefix that
served a hit or where prompts diverged, least recently used first (`StateSnapshots`). A
snapshot outlives its blocks only until its row is taken (a hit needs both); a flush
forgets them all. The disk tier keeps the snapshots held after a finished sequence's blocks
beside those blocks (`save_to_disk`); a disk hit ends at the last of them it finds.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from qinfer.attention.block_spaces import NULL_BLOCK, first_block
from qinfer.core.errors import CacheError
from qinfer.engine.disk_cache import DiskCache
from qinfer.engine.sequence import Sequence
from qinfer.engine.state_snapshots import StateSnapshots


def block_hash(parent_hash: int | None, key: tuple[int | bytes, ...]) -> int:
    """The prefix-cache hash of a full block: over its parent's hash and its key (its token
    ids, then its images' digests: `Sequence.block_key`)."""
    return hash((parent_hash, key))


class Block:
    """One block of a pool: who uses it and, once registered, which prefix it holds."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.generation = 0  # times allocated: a reader elsewhere sees a reuse by it
        self.reset()

    def reset(self) -> None:
        """Forget the registered content (the block is about to hold new K/V)."""
        self.hash: int | None = None
        self.key: tuple[int | bytes, ...] = ()  # its token ids, then its images' digests
        self.content_id: int | None = None  # equal for blocks holding equal prefixes
        self.parent_content_id: int | None = None


class BlockPool:
    """The blocks of one block space: who holds each, which are free (least recently
    freed first), and which prefix each registered one holds."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody uses, least recently freed first (the next to be evicted).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_free_blocks = 0  # free blocks still holding registered K/V
        self.cached: dict[int, int] = {}  # hash -> id of a registered block

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (some still hold reusable prefix K/V)."""
        return len(self.free_blocks)

    def allocate(self) -> int:
        """A fresh block for one holder: the least recently freed, which forgets the prefix
        it held."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.content_id is not None:  # evict: forget the prefix it held
            self._forget(block)
        block.ref_count = 1
        block.generation += 1
        return block_id

    def _forget(self, block: Block) -> None:
        """Unregister a free block's prefix: no lookup finds it any more."""
        self.num_cached_free_blocks -= 1
        if self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
        block.reset()

    def forget_free(self) -> int:
        """Forget the prefixes of every free block (they become the first to allocate);
        how many there were. Blocks that sequences hold keep theirs."""
        cached = [b for b in self.free_blocks if self.blocks[b].content_id is not None]
        for block_id in cached:
            self._forget(self.blocks[block_id])
            self.free_blocks.move_to_end(block_id, last=False)
        return len(cached)

    @property
    def num_cached_held_blocks(self) -> int:
        """Registered blocks that sequences hold (a flush keeps them)."""
        return sum(1 for b in self.blocks if b.ref_count and b.content_id is not None)

    def take(self, block: Block) -> int:
        """One more holder of a registered block (a prefix-cache hit); its id."""
        if block.ref_count == 0:
            del self.free_blocks[block.block_id]
            self.num_cached_free_blocks -= 1
        block.ref_count += 1
        return block.block_id

    def release(self, block_id: int) -> None:
        """One holder fewer. A block nobody holds joins the free list: evicted last when it
        holds a registered prefix (its K/V stay cached), first when it holds nothing."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None  # most recently used: evicted last
            if block.content_id is None:
                self.free_blocks.move_to_end(block_id, last=False)  # nothing to keep
            else:
                self.num_cached_free_blocks += 1

    def lookup(
        self, h: int, key: tuple[int | bytes, ...], parent_content: int | None
    ) -> Block | None:
        """The registered block for this hash, if it really holds this key (tokens, images)
        after this parent."""
        block_id = self.cached.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.key != key or block.parent_content_id != parent_content:
            return None  # a hash collision: another prefix lives under this key
        return block

    def holding(self, h: int, content_id: int) -> Block | None:
        """The block registered under this hash, if it holds that content."""
        block_id = self.cached.get(h)
        if block_id is None or self.blocks[block_id].content_id != content_id:
            return None
        return self.blocks[block_id]

    def register(
        self,
        block_id: int,
        h: int,
        key: tuple[int | bytes, ...],
        parent_content: int | None,
        content_id: int,
    ) -> None:
        """Record the prefix a computed block holds (once). The hash finds it from now on,
        unless another block holds that content already (the same prefix computed twice:
        children of either chain match)."""
        block = self.blocks[block_id]
        if block.content_id is not None:
            return
        block.hash, block.key = h, key
        block.parent_content_id, block.content_id = parent_content, content_id
        if self.holding(h, content_id) is None:  # a new prefix (or the key held a colliding one)
            self.cached[h] = block_id


@dataclass(frozen=True)
class CacheFlush:
    """What `BlockManager.flush_prefix_cache` did, in space 0's blocks: prefixes forgotten
    (free blocks) and kept (blocks that running sequences hold: forgotten once freed and
    reused, never taken from them); and the disk tier's files removed, blocks and a hybrid
    model's states (0 without one)."""

    dropped_blocks: int
    kept_blocks: int
    dropped_disk_blocks: int = 0


class BlockManager:
    """Allocates, shares and frees the blocks of each block space for sequences.

    num_blocks: each space's pool size (an int: one space); windows: each space's window
    (None: it keeps whole histories), as `BlockSpaces.windows`. A sequence's table in
    space s is `seq.tables[s]`. The pool statistics (num_blocks, num_free_blocks,
    num_cached_free_blocks) are space 0's, the one that bounds the context held.
    state_slots: the recurrent-state pool's slots, one per running sequence (0: the model
    keeps no such state); state_snapshots: its snapshot rows, numbered after the slots
    (rows of a hybrid model's prefix cache: none without prefix caching).
    """

    def __init__(
        self,
        num_blocks: int | list[int],
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: tuple[int | None, ...] = (None,),
        state_slots: int = 0,
        disk: DiskCache | None = None,
        state_snapshots: int = 0,
    ) -> None:
        counts = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(windows):
            raise CacheError(f"{len(counts)} pool sizes for {len(windows)} block spaces")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(count) for count in counts]
        self.windows = tuple(windows)
        self._window_spaces = [s for s, window in enumerate(windows) if window is not None]
        self._content_ids = itertools.count()
        self.state_slots = state_slots
        self._free_slots = list(range(state_slots - 1, -1, -1))  # popped: slot 0 first
        # a hybrid model's prefix cache: which snapshot rows hold which prefix's state
        # (None: the model keeps no state, or the cache is off)
        self.snapshots = None
        if state_slots and enable_prefix_caching:
            self.snapshots = StateSnapshots(range(state_slots, state_slots + state_snapshots))
        # the disk tier (`qinfer.engine.disk_cache`; None: memory only): the engine gives
        # one only for models whose every space keeps whole histories
        self.disk = disk
        if disk is not None:
            disk.block_pools, disk.snapshots = self.pools, self.snapshots

    @property
    def num_blocks(self) -> int:
        return self.pools[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Space 0's blocks no sequence uses (some still hold reusable prefix K/V)."""
        return self.pools[0].num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pools[0].num_cached_free_blocks

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def can_admit(self) -> bool:
        """Whether a new sequence can start: a state slot is free, or none is needed."""
        return not self.state_slots or bool(self._free_slots)

    def flush_prefix_cache(self) -> CacheFlush:
        """Forget every cached prefix no sequence holds, in every space, every state
        snapshot, and the disk tier's files of this model (`/flush_cache`)."""
        if self.snapshots is not None:
            self.snapshots.forget()
        dropped = [pool.forget_free() for pool in self.pools]
        on_disk = 0 if self.disk is None else self.disk.forget()
        return CacheFlush(dropped[0], self.pools[0].num_cached_held_blocks, on_disk)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s tables in this manager's spaces (one each, made here when it has none)."""
        tables = seq.tables
        if len(tables) < len(self.pools):
            tables += [[] for _ in range(len(self.pools) - len(tables))]
        return tables

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Fresh blocks `seq` needs in each space so that its tables cover positions
        0..num_tokens-1."""
        blocks = -(-num_tokens // self.block_size)
        return [max(0, blocks - len(table)) for table in self._tables(seq)]

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        blocks = -(-num_tokens // self.block_size)
        spaces = zip(self.pools, self._tables(seq), strict=True)
        return all(blocks - len(table) <= len(pool.free_blocks) for pool, table in spaces)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks to `seq`'s tables until they cover num_tokens positions."""
        needed = self.blocks_needed(seq, num_tokens)
        if not any(needed):  # most decode steps
            return
        for space, (n, pool) in enumerate(zip(needed, self.pools, strict=True)):
            if n > pool.num_free_blocks:
                raise CacheError(
                    f"KV pool of block space {space} has {pool.num_free_blocks} free blocks, "
                    f"{n} needed"
                )
        for n, pool, table in zip(needed, self.pools, self._tables(seq), strict=True):
            table.extend(pool.allocate() for _ in range(n))

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        At least one token is always left to compute, so that the step that finishes the
        prompt produces the logits of its last token. A sequence that does not use the
        prefix cache (`Sequence.uses_prefix_cache`) gets none. Returns the tokens found.
        """
        if any(self._tables(seq)):
            raise CacheError(f"sequence {seq.request_id!r} already holds blocks")
        if self.state_slots:
            if not self._free_slots:
                raise CacheError(f"no state slot is free for sequence {seq.request_id!r}")
            seq.state_slot = self._free_slots.pop()
        looks_up = self.enable_prefix_caching and seq.uses_prefix_cache
        hits = self._match_prefix(seq) if looks_up else []
        # each space's block of each hit index, None where a window space lacks it
        held = [hits] + [
            [pool.holding(b.hash, b.content_id) for b in hits] for pool in self.pools[1:]
        ]
        n = self._longest_hit(held)
        size = self.block_size
        if self.snapshots is not None and n:  # its state starts from the snapshot there
            seq.snapshot_source = self.snapshots.find(hits[n - 1].content_id)
        if self.snapshots is not None and len(hits) > n:  # snapshot where it diverges
            seq.shared_prefix_end = len(hits) * size
        spaces = zip(self.pools, self.windows, self._tables(seq), held, strict=True)
        for pool, window, table, blocks in spaces:
            first = first_block(n * size, window, size)  # the next step reads from here
            table.extend([NULL_BLOCK] * first)
            table.extend(pool.take(block) for block in blocks[first:n])
        seq.num_hashed_blocks, seq.num_computed_tokens = n, n * size
        seq.last_block_key = (hits[n - 1].hash, hits[n - 1].content_id) if n else None
        # an adapter's key is this process's load count: another process's file under it
        # could be another adapter's K/V, so adapters stay in memory
        if looks_up and self.disk is not None and seq.adapter is None:
            self._read_from_disk(seq)
        return seq.num_computed_tokens

    def _match_prefix(self, seq: Sequence) -> list[Block]:
        """Space 0's registered blocks of the longest prefix of seq's tokens (but its last)."""
        pool = self.pools[0]
        hits: list[Block] = []
        parent_hash, parent_content = None, None
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            key = seq.block_key(start, start + self.block_size)
            h = block_hash(parent_hash, key)
            block = pool.lookup(h, key, parent_content)
            if block is None:
                break
            hits.append(block)
            parent_hash, parent_content = h, block.content_id
        return hits

    def _read_from_disk(self, seq: Sequence) -> None:
        """Extend a sequence's prefix hit with the blocks that follow it on disk: each read
        into a fresh block of every space and registered as a computed one would be, until
        the first block missing there, or until a space has fewer than two free blocks. A
        hybrid model's hit must end where a state is: it runs to the last block with a state
        file, that state read into the sequence's slot (its own: no other step reads it),
        every block up to it read, or the hit stays what it was (the blocks read are given
        back, still cached)."""
        size, first = self.block_size, seq.num_hashed_blocks
        last = (seq.num_tokens - 1) // size  # at least one token is left to compute
        if first >= last:
            return
        names = self.disk.digests(seq, last, size)
        state = None
        if self.state_slots:
            # the last block with a state after it (a prompt sent again: its last, at once)
            end = next(
                (i for i in range(last, first, -1) if self.disk.has_state(names[i - 1][0])), 0
            )
            # its blocks and one for the tokens left to compute
            if not end or any(pool.num_free_blocks < end - first + 1 for pool in self.pools):
                return
            last = end
            state = self.disk.read_state(*names[last - 1])
            if state is None:
                return
        computed, last_key = seq.num_computed_tokens, seq.last_block_key  # the hit before
        for i in range(first, last):
            # this block and one for the tokens left to compute
            if any(pool.num_free_blocks < 2 for pool in self.pools):
                break
            parts = self.disk.read(*names[i])
            if parts is None:
                break
            spaces = zip(self.pools, self.disk.pools, self._tables(seq), parts, strict=True)
            for pool, kv, table, part in spaces:
                table.append(pool.allocate())
                kv.write_block(table[-1], part)
            seq.num_computed_tokens += size
            self._register(seq)
        read = seq.num_computed_tokens - computed
        if state is None:
            self.disk.tokens_read += read
        elif read == (last - first) * size:
            self.disk.states.write_row(seq.state_slot, state)
            seq.snapshot_source = None  # the slot holds the state at the hit's new end
            self.disk.tokens_read += read
        else:  # short of the state's block: no state to start from past the hit
            for pool, table in zip(self.pools, self._tables(seq), strict=True):
                for _ in range(read // size):
                    pool.release(table.pop())
            seq.num_computed_tokens, seq.last_block_key = computed, last_key
            seq.num_hashed_blocks = first

    def save_to_disk(self, seq: Sequence) -> None:
        """Hand the disk tier every full block of `seq` registered in the prefix cache
        (call before `free`): it writes those not on disk yet, in the background."""
        if self.disk is None or seq.adapter is not None or not seq.num_hashed_blocks:
            return
        names = self.disk.digests(seq, seq.num_hashed_blocks, self.block_size)
        tables = self._tables(seq)
        self.disk.save([(*name, [table[i] for table in tables]) for i, name in enumerate(names)])
        if self.snapshots is not None:  # the states held after its blocks
            blocks = self.pools[0].blocks
            held = tables[0][: len(names)]
            rows = [self.snapshots.row_of(blocks[block].content_id) for block in held]
            self.disk.save_states(
                [(*name, row) for name, row in zip(names, rows, strict=True) if row is not None]
            )

    def _longest_hit(self, held: list[list[Block | None]]) -> int:
        """The most leading blocks of a prefix hit (held: each space's blocks of its indices)
        for which every space holds the blocks that a step from the hit's end reads, and,
        for a model that keeps a recurrent state, a snapshot holds the state there."""
        n, size = len(held[0]), self.block_size
        while n:
            missing = [
                j
                for window, blocks in zip(self.windows, held, strict=True)
                for j in range(first_block(n * size, window, size), n)
                if blocks[j] is None
            ]
            if missing:
                n = max(missing)  # a shorter hit must end before the block that is missing
            elif self.state_slots and not (
                self.snapshots is not None and self.snapshots.holds(held[0][n - 1].content_id)
            ):
                n -= 1  # no state to start from there
            else:
                return n
        return 0

    def cut_at_snapshot(self, seq: Sequence, n: int) -> int:
        """The tokens of `seq`'s next step, n of them asked for, cut so that the step ends
        at the sequence's next snapshot point if it would pass it (a hybrid model's prefix
        cache, the module's docstring); a snapshot row is then reserved for the state
        after the step (`Sequence.snapshot_row`). n itself without a snapshot to take or a
        row to take it in."""
        if self.snapshots is None:
            return n
        start, size = seq.num_computed_tokens, self.block_size
        # its prompt's last block boundary that a hit can use (no point in generated text)
        last = min(seq.num_tokens - 1, seq.num_prompt_tokens) // size * size
        points = [p for p in (seq.shared_prefix_end, last) if p > start]
        if not points or start + n < min(points):
            return n
        point = min(points)
        seq.snapshot_row = self.snapshots.reserve(shared=point == seq.shared_prefix_end)
        return n if seq.snapshot_row is None else point - start

    def register_computed(self, seq: Sequence) -> None:
        """Register every full block of `seq` whose K/V are now computed, in every space,
        then release the blocks of its window spaces that no later query reads (call after
        a step)."""
        if self.enable_prefix_caching:
            self._register(seq)
        if self.snapshots is not None:  # the step restored and saved what it had to
            seq.snapshot_source = None
            if seq.snapshot_row is not None:  # the state after the prefix's last block
                shared = seq.num_computed_tokens == seq.shared_prefix_end
                self.snapshots.bind(seq.snapshot_row, seq.last_block_key[1], shared)
                seq.snapshot_row = None
        for space in self._window_spaces:
            pool, table = self.pools[space], seq.tables[space]
            end = first_block(seq.num_computed_tokens, self.windows[space], self.block_size)
            start = end  # the blocks released by an earlier step come before
            while start > 0 and table[start - 1] != NULL_BLOCK:
                start -= 1
            for i in range(start, end):
                pool.release(table[i])
                table[i] = NULL_BLOCK

    def _register(self, seq: Sequence) -> None:
        size = self.block_size
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // size):
            key = seq.block_key(i * size, (i + 1) * size)
            parent_hash, parent_content = seq.last_block_key or (None, None)
            h = block_hash(parent_hash, key)
            # a twin: the same prefix computed before (children of either chain match)
            twin = self.pools[0].lookup(h, key, parent_content)
            content = next(self._content_ids) if twin is None else twin.content_id
            for pool, table in zip(self.pools, self._tables(seq), strict=True):
                pool.register(table[i], h, key, parent_content, content)
            seq.num_hashed_blocks = i + 1
            seq.last_block_key = (h, content)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks and state slot (finished, aborted or preempted); its
        K/V stay cached."""
        for pool, table in zip(self.pools, self._tables(seq), strict=True):
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    pool.release(block_id)
        seq.tables = [[] for _ in self.pools]
        if seq.state_slot is not None:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = None
        if seq.snapshot_row is not None:  # reserved for a step that did not run
            self.snapshots.release(seq.snapshot_row)
        seq.snapshot_row = seq.snapshot_source = None
        seq.shared_prefix_end = 0
        seq.state_rollback = False  # recomputed or restored from a snapshot instead
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_key = None
        seq.num_draft_computed = 0  # the draft's K/V sat in the same blocks
        seq.proposed = []
