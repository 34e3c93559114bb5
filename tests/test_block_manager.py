"""The KV block pool: reference counts, prefix caching, collision safety, LRU eviction."""

import pytest

from qinfer.engine import block_manager
from qinfer.engine.block_manager import BlockManager
from qinfer.engine.sequence import Sequence
from qinfer.engine.state_snapshots import StateSnapshots

BLOCK = 4


def computed(manager: BlockManager, request_id: str, tokens: list[int]) -> Sequence:
    """A sequence admitted, its whole token list computed and registered."""
    seq = Sequence(request_id, tokens)
    manager.allocate_prefix(seq)
    manager.grow(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    manager.register_computed(seq)
    return seq


def test_grow_takes_blocks_and_free_returns_them():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = Sequence("a", list(range(10)))
    manager.grow(seq, 10)
    assert len(seq.tables[0]) == 3  # ceil(10 / 4)
    assert manager.num_free_blocks == 5
    manager.free(seq)
    assert manager.num_free_blocks == 8 and seq.tables[0] == []


def test_shared_prefix_blocks_are_reference_counted():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    first = computed(manager, "a", list(range(9)))
    second = Sequence("b", list(range(8)) + [99, 98])
    assert manager.allocate_prefix(second) == 8
    assert second.tables[0] == first.tables[0][:2]
    assert [manager.pools[0].blocks[i].ref_count for i in second.tables[0]] == [2, 2]
    manager.free(first)
    assert [manager.pools[0].blocks[i].ref_count for i in second.tables[0]] == [1, 1]
    manager.free(second)
    assert manager.num_free_blocks == 8


def test_fully_cached_prompt_leaves_its_last_block_to_compute():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    manager.free(computed(manager, "a", list(range(8))))
    again = Sequence("b", list(range(8)))
    assert manager.allocate_prefix(again) == 4  # not 8: the last token's logits are needed
    assert again.num_uncomputed_tokens == 4


def test_prefix_hit_stops_at_the_first_different_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    manager.free(computed(manager, "a", list(range(12))))
    other = Sequence("b", [0, 1, 2, 3, 7, 7, 7, 7, 8, 9, 10, 11, 12])
    assert manager.allocate_prefix(other) == 4


def test_hash_collision_is_caught_by_the_stored_tokens(monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: 0)
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    manager.free(computed(manager, "a", [1, 2, 3, 4, 5]))
    other = Sequence("b", [5, 6, 7, 8, 9])
    assert manager.allocate_prefix(other) == 0


def test_hash_collision_with_equal_tokens_after_another_prefix_is_a_miss(monkeypatch):
    # Every block hashes alike; block 1 of "a" holds [5, 6, 7, 8] after [1, 2, 3, 4].
    # A prompt starting with [5, 6, 7, 8] has the same tokens but no parent: a miss.
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: 0)
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    manager.free(computed(manager, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    other = Sequence("b", [5, 6, 7, 8, 0])
    assert manager.allocate_prefix(other) == 0


def test_least_recently_freed_cached_block_is_evicted_first():
    manager = BlockManager(num_blocks=2, block_size=BLOCK)
    manager.free(computed(manager, "old", [1, 2, 3, 4]))
    manager.free(computed(manager, "new", [5, 6, 7, 8]))
    taker = Sequence("c", [0])
    manager.grow(taker, 1)  # evicts the block of "old"
    assert manager.allocate_prefix(Sequence("d", [1, 2, 3, 4, 0])) == 0
    assert manager.allocate_prefix(Sequence("e", [5, 6, 7, 8, 0])) == 4


def test_growing_past_the_pool_is_an_error():
    manager = BlockManager(num_blocks=2, block_size=BLOCK)
    with pytest.raises(Exception, match="free blocks"):
        manager.grow(Sequence("a", list(range(9))), 9)


def test_cached_free_block_count_follows_frees_hits_and_evictions():
    manager = BlockManager(num_blocks=3, block_size=BLOCK)

    def counted() -> int:
        (pool,) = manager.pools
        return sum(pool.blocks[i].content_id is not None for i in pool.free_blocks)

    manager.free(computed(manager, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))  # 2 full blocks cached
    assert manager.num_cached_free_blocks == counted() == 2
    hit = Sequence("b", [1, 2, 3, 4, 0])
    manager.allocate_prefix(hit)
    assert manager.num_cached_free_blocks == counted() == 1
    manager.grow(Sequence("c", [0] * 8), 8)  # the uncached block, then an eviction
    assert manager.num_cached_free_blocks == counted() == 0


def test_flush_forgets_free_prefixes_and_keeps_the_held_ones():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    manager.free(computed(manager, "a", list(range(9))))  # 2 full blocks cached, free
    held = computed(manager, "b", [7] * 9)  # 2 full blocks cached, held
    flush = manager.flush_prefix_cache()
    assert (flush.dropped_blocks, flush.kept_blocks) == (2, 2)
    assert manager.num_cached_free_blocks == 0
    assert manager.allocate_prefix(Sequence("c", list(range(9)))) == 0  # forgotten
    assert manager.allocate_prefix(Sequence("d", [7] * 9)) == 8  # still held: still found
    manager.free(held)
    assert manager.flush_prefix_cache().dropped_blocks == 0  # "d" holds them now


def test_a_hybrid_hit_ends_where_a_state_snapshot_is():
    """A model with a recurrent state (one slot, two snapshot rows after it): a prompt's
    chunk ends at its last full block, whose state is saved; a prompt sharing it starts
    from that snapshot; one that shares only a block before it finds no state there, so it
    starts from nothing and its chunk ends where it diverged."""
    manager = BlockManager(num_blocks=16, block_size=BLOCK, state_slots=1, state_snapshots=2)
    first = Sequence("a", list(range(10)))
    assert manager.allocate_prefix(first) == 0
    assert manager.cut_at_snapshot(first, 10) == 8  # its last full block ends at 8
    assert first.snapshot_row == 1  # the first row after the slot
    manager.grow(first, 8)
    first.num_computed_tokens = 8
    manager.register_computed(first)  # the step ran: row 1 holds the state at 8
    assert first.snapshot_row is None and len(manager.snapshots) == 1
    manager.free(first)

    again = Sequence("b", list(range(10)) + [99])
    assert manager.allocate_prefix(again) == 8
    assert again.snapshot_source == 1 and again.state_slot == 0
    assert manager.cut_at_snapshot(again, 3) == 3  # no point past 8 before its end
    manager.free(again)

    diverging = Sequence("c", list(range(6)) + [50] * 6)
    assert manager.allocate_prefix(diverging) == 0  # block 0 is cached, its state is not
    assert diverging.snapshot_source is None and diverging.shared_prefix_end == BLOCK
    assert manager.cut_at_snapshot(diverging, 12) == BLOCK
    manager.free(diverging)  # the step did not run: its row is free again
    assert diverging.snapshot_row is None and manager.snapshots.reserve(shared=False) == 2


def test_state_snapshots_keep_shared_prefixes_over_prompt_ends():
    """Two rows: a prompt's end takes a free or tentative row, never a shared one; a hit
    makes a tentative snapshot shared; the same prefix saved twice keeps one row."""
    snapshots = StateSnapshots(range(4, 6))
    end = snapshots.reserve(shared=False)
    snapshots.bind(end, 10, shared=False)
    system = snapshots.reserve(shared=True)
    snapshots.bind(system, 11, shared=True)
    assert (end, system) == (4, 5)
    assert snapshots.reserve(shared=False) == end and not snapshots.holds(10)
    assert snapshots.reserve(shared=False) is None  # the shared row is kept
    snapshots.bind(end, 11, shared=False)  # 11 is held already: the row is free again
    assert len(snapshots) == 1
    row = snapshots.reserve(shared=False)
    snapshots.bind(row, 12, shared=False)
    assert snapshots.find(12) == row  # a hit: 12 is shared now
    assert snapshots.reserve(shared=False) is None
    assert snapshots.reserve(shared=True) == system  # the least recently used shared one
    assert snapshots.forget() == 1 and snapshots.reserve(shared=False) == row
