"""Continuous batching: budgets per step, chunked prefill, preemption of the newest."""

from qinfer.engine.block_manager import BlockManager
from qinfer.engine.config import EngineConfig
from qinfer.engine.scheduler import Scheduler
from qinfer.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, **config):
    manager = BlockManager(num_blocks, block_size)
    return Scheduler(EngineConfig(block_size=block_size, **config), manager), manager


def run(scheduler, step) -> None:
    """What the engine does after the model ran: advance each sequence, sample one token."""
    for seq, n in zip(*step, strict=True):
        scheduler.advance(seq, n)
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(0)


def test_step_respects_the_sequence_budget():
    scheduler, _ = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add(Sequence(str(i), [1, 2, 3]))
    seqs, _ = scheduler.schedule()
    assert [s.request_id for s in seqs] == ["0", "1"]
    assert len(scheduler.waiting) == 1


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    scheduler, _ = make(max_num_seqs=2, max_num_batched_tokens=8)
    scheduler.add(Sequence("long", list(range(20))))
    chunks = []
    for _ in range(3):
        step = scheduler.schedule()
        chunks.append(step[1][0])
        run(scheduler, step)
    assert chunks == [8, 8, 4]


def test_decodes_and_a_new_prefill_share_a_step():
    scheduler, _ = make(max_num_seqs=4, max_num_batched_tokens=6)
    scheduler.add(Sequence("a", [1, 2]))
    run(scheduler, scheduler.schedule())
    scheduler.add(Sequence("b", list(range(10))))
    step = scheduler.schedule()
    assert [(s.request_id, n) for s, n in zip(*step, strict=True)] == [
        ("a", 1),
        ("b", 5),
    ]


def test_newest_sequence_is_preempted_when_blocks_run_out():
    scheduler, manager = make(num_blocks=2, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    old, new = Sequence("old", [1, 2, 3, 4]), Sequence("new", [5, 6, 7, 8])
    scheduler.add(old)
    scheduler.add(new)
    run(scheduler, scheduler.schedule())  # each holds one full block; the next token needs another
    seqs, _ = scheduler.schedule()
    assert seqs == [old] and scheduler.num_preempted == 1
    assert new.status is SequenceStatus.WAITING and new.tables[0] == []
    assert scheduler.waiting[0] is new


def test_finishing_frees_blocks_at_once():
    scheduler, manager = make(num_blocks=4)
    seq = Sequence("a", [1, 2, 3, 4, 5])
    scheduler.add(seq)
    run(scheduler, scheduler.schedule())
    scheduler.finish(seq)
    assert manager.num_free_blocks == 4 and not scheduler.has_unfinished()
