"""Who runs next: continuous batching over a waiting queue and a running list.

Each step first serves the running sequences, oldest first: one token for a decoding
sequence (and the tokens proposed after it, with speculative decoding), the next chunk
of its prompt for one still prefilling. When the pool has no
block left for a running sequence, the newest running sequence is preempted: its blocks
are freed (their full blocks stay in the prefix cache) and it goes back to the front of
the waiting queue, to be recomputed later. Then waiting sequences are admitted, oldest
first, while the step has tokens and sequences to spare and the pool has blocks; a long
prompt is admitted with a first chunk and continues in later steps (chunked prefill). A
hybrid model's prompt chunk ends early where the prefix cache snapshots its state
(`BlockManager.cut_at_snapshot`). A sequence whose LoRA adapter cannot be made resident
yet (every `max_loras` slot held by unfinished requests) waits at the head of the queue
until one frees, as vLLM's scheduler holds such a request back.

The oldest running sequence is never preempted by another, so every step makes progress.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from qinfer.engine.block_manager import BlockManager
from qinfer.engine.config import EngineConfig
from qinfer.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Picks each step's batch under max_num_seqs and max_num_batched_tokens."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        adapter_ready: Callable[[Sequence], bool] = lambda seq: True,
    ) -> None:
        """adapter_ready(seq): whether seq's LoRA adapter (if any) is resident, made so
        now if a slot can be had; the engine's (`Engine._adapter_ready`)."""
        self.adapter_ready = adapter_ready
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found there
        self.num_preempted = 0  # sequences sent back to the waiting queue, ever

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[int]]:
        """The next step's sequences and how many new tokens each runs through the model:
        running sequences first (preempting the newest when blocks run out), then waiting
        ones while tokens, sequence slots and blocks remain (the engine makes the step the
        runtime runs of them: `qinfer.engine.sequence.scheduled_step`)."""
        seqs: list[Sequence] = []
        num_new: list[int] = []
        preempted = False
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self.block_manager.cut_at_snapshot(seq, self._fit_proposals(seq, budget))
            while not self.block_manager.can_grow(seq, seq.num_computed_tokens + n):
                self._preempt(self.running.pop())
                preempted = True
                if seq.status is SequenceStatus.WAITING:
                    break  # `seq` itself was the newest
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.grow(seq, seq.num_computed_tokens + n)
                seqs.append(seq)
                num_new.append(n)
                budget -= n
                i += 1

        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not preempted  # the pool is full: do not admit only to preempt
            and self.block_manager.can_admit()  # a state slot, when the model keeps state
        ):
            seq = self.waiting[0]
            if not self.adapter_ready(seq):
                break
            cached = self.block_manager.allocate_prefix(seq)
            n = self.block_manager.cut_at_snapshot(seq, min(seq.num_uncomputed_tokens, budget))
            if not self.block_manager.can_grow(seq, seq.num_computed_tokens + n):
                self.block_manager.free(seq)
                break
            self.block_manager.grow(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        return seqs, num_new

    def advance(self, seq: Sequence, n: int) -> None:
        """n more of a running sequence's tokens have their K/V in the pool (a step's
        uncomputed tokens once it ran; its verified proposals, which joined `token_ids`):
        the one place a step advances its progress (the block manager sets it otherwise: a
        prefix-cache hit, a preemption). Its full blocks are registered in the prefix
        cache, its window spaces' blocks that no later query reads released, and its
        images' embeddings dropped once every image token ran."""
        seq.num_computed_tokens += n
        seq.state_rollback = False  # the step that ran did it
        self.block_manager.register_computed(seq)
        if seq.images is not None:
            seq.images.ran(seq.num_computed_tokens)

    def _fit_proposals(self, seq: Sequence, budget: int) -> int:
        """The tokens a running sequence runs this step: its uncomputed ones, then its
        proposed ones (speculative decoding) as far as the token budget and the free
        blocks allow: proposals are dropped rather than preempting anyone."""
        n = min(seq.num_scheduled_tokens, budget)
        kept = max(0, n - seq.num_uncomputed_tokens)
        if kept and not self.block_manager.can_grow(seq, seq.num_computed_tokens + n):
            n, kept = n - kept, 0
        del seq.proposed[kept:]
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.num_preempted += 1
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
