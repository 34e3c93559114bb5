"""One rank's forward of a scheduled step: the KV pools, their sizes, and the logits of each row.

A step's sequences become one `ForwardBatch`: their new tokens flat, each at its position,
attending through the runner's attention backend (`qinfer.attention.backend`) over its
pools (one per block space, `qinfer.attention.block_spaces`, laid out as the backend says);
logits are computed only at the rows that ask for them: the last token of each sequence
that samples, the last 1 + k of one that verifies k proposed tokens. The step's tensors
are written in place into the runner's `StepBuffers`.

A runner is one rank's: which ranks run a step, and how a step reaches them, is the
`Executor`'s (`qinfer.runtime.executor`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qinfer.attention.backend import choose_backend
from qinfer.attention.block_spaces import BlockSpaces, window_space_blocks
from qinfer.attention.kv_pool import KVPool, paged_layers
from qinfer.attention.state_pool import StatePool, StepStates
from qinfer.attention.step_buffers import StepBuffers
from qinfer.core.errors import QinferError
from qinfer.core.forward_batch import AdapterRows, BatchImages, ForwardBatch
from qinfer.model.transformer import Transformer
from qinfer.runtime.config import DEFAULT_CPU_KV_MEMORY, RuntimeConfig
from qinfer.runtime.cuda_graphs import StepGraphs, use_cuda_graphs
from qinfer.runtime.static_decode import is_decode, padded
from qinfer.runtime.step import ScheduledStep
from qinfer.runtime.step_channel import StepChannel


def kv_heads(model: Transformer) -> int:
    """KV heads this rank's pool holds (all of them in a single process)."""
    config = model.config
    _, heads = model.parallel.attention_heads(
        config.num_attention_heads, config.num_key_value_heads
    )
    return len(heads)


def pool_budget(model: Transformer, config: RuntimeConfig) -> int | None:
    """Bytes for the pools (KV blocks and recurrent states): kv_cache_memory, or a share of
    free GPU memory, or the CPU default; None when num_kv_blocks sizes the KV pool."""
    if config.num_kv_blocks is not None:
        return None
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if model.device.type == "cuda":
        return _gpu_budget(model, config)
    return DEFAULT_CPU_KV_MEMORY


def state_slots(
    model: Transformer, config: RuntimeConfig, channel: StepChannel | None = None
) -> int:
    """Slots of the recurrent-state pool (`StatePool`: a hybrid model's Gated DeltaNet
    layers), a running sequence's each: 0 for a model without such layers; max_num_seqs
    beside num_kv_blocks; else as many as half the budget (`pool_budget`) holds, at most
    max_num_seqs (the KV blocks get the rest: `kv_pool_blocks`). With speculative
    decoding a slot counts twice (its checkpoint row). A budget whose half holds no
    sequence's state is one error naming kv_cache_memory. With a channel, the fewest any
    rank holds."""
    if model.config.deltanet is None:
        return 0
    budget = pool_budget(model, config)
    slots = config.max_num_seqs
    if budget is not None:
        per_slot = StatePool.bytes_per_slot(model.config, model.dtype)
        per_slot *= 1 + bool(config.num_speculative_tokens)
        slots = min(slots, budget // 2 // per_slot)
        if slots < 1:
            raise QinferError(
                f"kv_cache_memory of {budget} bytes holds no sequence's recurrent state "
                f"({per_slot} bytes each, in at most half of it): raise kv_cache_memory"
            )
    return slots if channel is None else channel.min(slots)


def state_snapshots(model: Transformer, config: RuntimeConfig, slots: int) -> int:
    """Snapshot rows of the recurrent-state pool (a hybrid model's prefix cache,
    `StatePool`): 0 for a model without Gated DeltaNet layers; config.state_snapshots when
    set (one error naming it when the budget holds those rows and the `slots` (and their
    checkpoint rows, with speculative decoding) no more); else max_num_seqs beside
    num_kv_blocks, or as many as a quarter of the budget holds, at most max_num_seqs. (No
    channel: the DeltaNet layers run in one process only.)"""
    if model.config.deltanet is None:
        return 0
    budget = pool_budget(model, config)
    per_slot = StatePool.bytes_per_slot(model.config, model.dtype)
    running = slots * (1 + bool(config.num_speculative_tokens))  # and their checkpoints
    if config.state_snapshots is not None:
        rows = config.state_snapshots
        if budget is not None and (running + rows) * per_slot >= budget:
            raise QinferError(
                f"state_snapshots={rows}: kv_cache_memory of {budget} bytes does not hold "
                f"{running} running states, {rows} snapshots ({per_slot} bytes each) and KV "
                "blocks: lower state_snapshots or raise kv_cache_memory"
            )
        return rows
    if budget is None:
        return config.max_num_seqs
    return min(config.max_num_seqs, budget // 4 // per_slot)


def kv_pool_blocks(
    model: Transformer,
    config: RuntimeConfig,
    spaces: BlockSpaces,
    channel: StepChannel | None = None,
    states: int = 0,
) -> list[int]:
    """How many blocks each block space's pool gets (`spaces`).

    One space: num_kv_blocks, else the byte budget (`pool_budget`, less `states` rows of
    the recurrent-state pool: `state_slots` and `state_snapshots`) divided by a block's size (a block holds
    this rank's KV heads, stored as `model.kv_format` says: an int8 pool gets about 1.8x
    the blocks of a bf16 one). A window space besides space 0 (sliding layers beside
    full-attention ones): `whole` = num_kv_blocks, or the budget divided by a block of
    every layer (one space's count); the window space gets what its running sequences can
    hold at once (`window_space_blocks`, with rank 0's speculative settings), at most
    `whole` but at least what one sequence holds, and space 0 the rest of the budget (with
    num_kv_blocks: `whole`). With a channel (tensor parallelism), the fewest any rank can
    hold, so that every rank allocates the same block ids."""
    heads = kv_heads(model)
    per_block = [
        KVPool.bytes_per_block(
            model.config, config.block_size, model.kv_format, heads, spaces.num_layers(s)
        )
        for s in range(len(spaces.windows))
    ]
    if not sum(per_block):  # every layer linear attention: the pools' sizing divides by it
        raise QinferError(
            "layer_types: a model without any attention layer is not supported by the engine"
        )
    budget = pool_budget(model, config)
    if budget is None:
        whole = config.num_kv_blocks
    else:
        if states:
            budget -= states * StatePool.bytes_per_slot(model.config, model.dtype)
        whole = budget // sum(per_block)
    counts = [whole]
    if len(per_block) == 2:
        proposed = config.num_speculative_tokens
        if channel is not None:  # a worker's config has no speculative settings
            proposed = channel.rank_0(proposed)
        counts = _split(whole, budget, per_block, spaces.windows[1], config, proposed)
    if channel is not None:
        counts = [channel.min(count) for count in counts]
    if min(counts) < 1:
        raise QinferError(
            f"the KV pool budget of {budget} bytes holds no block ({sum(per_block)} bytes each): "
            "raise kv_cache_memory or gpu_memory_utilization"
        )
    return counts


def _split(
    whole: int,
    budget: int | None,
    per_block: list[int],
    window: int,
    config: RuntimeConfig,
    proposed: int,
) -> list[int]:
    """[space 0's blocks, the window space's] of `kv_pool_blocks`: the window space's
    are the most its running sequences hold, at most `whole` but at least one sequence's;
    space 0 gets `whole` (num_kv_blocks: budget None), or the rest of the budget."""
    size, step_tokens = config.block_size, config.max_num_batched_tokens
    most = window_space_blocks(window, size, config.max_num_seqs, step_tokens, proposed)
    one = window_space_blocks(window, size, 1, step_tokens, proposed)
    window_blocks = min(most, max(whole, one))
    if budget is None:
        return [whole, window_blocks]
    return [(budget - window_blocks * per_block[1]) // per_block[0], window_blocks]


def _gpu_budget(model: Transformer, config: RuntimeConfig) -> int:
    """Bytes for the pool on a GPU: gpu_memory_utilization of the memory free now, less the
    activation peak of a warm-up forward as long as the longest step (kept for the steps)."""
    device = model.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    length = min(config.max_num_batched_tokens, model.config.max_position_embeddings)
    model(torch.zeros(1, length, dtype=torch.long, device=device), last_only=True)
    activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * config.gpu_memory_utilization) - activations


@dataclass(frozen=True)
class StepOutput:
    """What one step hands back on rank 0.

    logits: fp32 (R, V), the rows the step asked for (`num_logits`), sequence by sequence;
    hidden: per sequence, None, or the final-normed fp32 rows (k, hidden) of its new
    tokens that a pooling request asked for (`hidden_rows`).
    """

    logits: torch.Tensor
    hidden: list[torch.Tensor | None]


class ModelRunner:
    """One rank's model over its own KV pools, num_blocks[s] blocks in block space s of
    `spaces`, and a recurrent-state pool of `state_slots` slots and `state_snapshots`
    snapshot rows for a hybrid model's Gated DeltaNet layers (`StatePool`; None without
    them): `forward` runs a step, attending through the backend config.attention_backend
    names (`choose_backend`)."""

    def __init__(
        self,
        model: Transformer,
        config: RuntimeConfig,
        num_blocks: list[int],
        spaces: BlockSpaces,
        state_slots: int = 0,
        state_snapshots: int = 0,
    ) -> None:
        self.model = model
        self.block_size = config.block_size
        self.spaces = spaces
        # CUDA graphs replay the bucketed decode step (`qinfer.runtime.cuda_graphs`)
        graphs = use_cuda_graphs(config.cuda_graphs, model.device)
        self.graphs = StepGraphs() if graphs else None
        self.static_decode = config.static_decode or graphs
        self.states = None
        if state_slots:
            if self.static_decode:  # its padding rows would need slots of their own
                raise QinferError(
                    "static_decode and cuda_graphs do not run hybrid (Gated DeltaNet) models yet"
                )
            checkpoints = bool(config.num_speculative_tokens)  # verifications roll back
            self.states = StatePool(
                model.config, state_slots, model.dtype, model.device, state_snapshots, checkpoints
            )
        self.backend = choose_backend(
            config.attention_backend,
            model.device,
            model.features,
            self.static_decode,
            model.dtype,
            model.kv_format.dtype,
        )
        # A bucketed decode step's padding rows write into a scratch block past each pool's
        # reported blocks (`static_decode`): no sequence is ever given it.
        self.scratch = list(num_blocks) if self.static_decode else []
        self.pools = [
            KVPool(
                model.config,
                count + int(self.static_decode),
                config.block_size,
                model.kv_format,
                model.device,
                kv_heads(model),
                spaces.num_layers(space),
                self.backend.layout,
            )
            for space, count in enumerate(num_blocks)
        ]
        self.layers = paged_layers(self.pools, spaces)
        # Every step's inputs, written in place (sized for the scheduler's largest step; a
        # longer one, or a longer block table, grows them).
        context_blocks = -(-model.config.max_position_embeddings // config.block_size)
        self.buffers = StepBuffers(
            config.block_size,
            model.device,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_blocks=min(num_blocks[0], context_blocks),
            windows=spaces.windows,
        )
        self._graphed_capacity = self.buffers.capacity  # what the graphs' buffers hold

    @property
    def num_blocks(self) -> list[int]:
        """Blocks in each block space's pool (a scratch block not counted)."""
        return [pool.num_blocks - int(self.static_decode) for pool in self.pools]

    def forward(
        self, step: ScheduledStep, hidden_rows: list[list[int] | None] | None = None
    ) -> StepOutput:
        """One step through the model over this rank's pool: the logits (R, V) of the rows
        the step asked for and, on rank 0, the pooling rows' final-normed hidden states.

        hidden_rows[b]: None, or for a pooling sequence the rows (0 .. num_new[b] - 1) of
        its new tokens whose final-normed hidden states it needs. Pooling is rank 0's alone
        (the hidden states are whole on every rank). With static_decode, a decode step runs
        padded to its bucket (`qinfer.runtime.static_decode`); the padding's logits are
        dropped; with CUDA graphs its bucket's graph is replayed (`qinfer.runtime.cuda_graphs`).
        A hybrid model's states that the step saves (`ScheduledStep.state_saves`) are copied
        once it ran."""
        num_seqs = len(step.new_tokens)
        hidden_rows = hidden_rows or [None] * num_seqs
        widths = None
        # (a step with images has per-step positions, one with adapters rows grouped by
        # adapter: each runs as it is)
        static = not step.images and step.adapters is None
        if self.static_decode and is_decode(step) and not any(hidden_rows) and static:
            _, max_rows, max_widths = self.buffers.capacity
            step, widths = padded(step, self.scratch, max_rows, list(max_widths))
            if self.graphs is not None:
                return StepOutput(self._replayed(step, widths)[:num_seqs], [None] * num_seqs)
        batch = self.forward_batch(step, widths)
        hidden = self.model.forward(batch)  # (T, hidden)
        if step.state_saves:
            self.states.copy(step.state_saves)
        logits = self.model.compute_logits(batch.logits_rows(hidden))  # (R, V)
        pooled: list[torch.Tensor | None] = []
        for start, rows in zip(batch.query_starts[:num_seqs], hidden_rows, strict=True):
            if rows is None:
                pooled.append(None)
            else:  # the final norm alone, local to this rank: no collective to match
                index = torch.tensor([start + r for r in rows], dtype=torch.long)
                pooled.append(self.model.norm(hidden[index.to(hidden.device)]).float())
        return StepOutput(logits if widths is None else logits[:num_seqs], pooled)

    def forward_batch(self, step: ScheduledStep, widths: list[int] | None = None) -> ForwardBatch:
        """The step as the model runs it: every sequence's new tokens flat, at their
        positions, over this runner's pools; logits at the last num_logits[b] rows of each;
        each space's tables padded to at least widths[s] blocks. Its tensors are views of
        this runner's `StepBuffers`, rewritten by the next step.

        A step with images (`ScheduledStep.images`) runs at (3, T) M-RoPE positions and
        carries the embeddings of its image tokens (`BatchImages`); the attention plan
        keeps the buffers' (T,) positions, which order the keys for the masks. A step with
        adapters (`ScheduledStep.adapters`) carries its rows grouped by adapter."""
        batch = self._batch(self._write(step, widths))
        if self.states is not None:
            batch = dataclasses.replace(batch, states=self._states(step))
        if step.adapters is not None:  # each sequence's rows through its adapter
            starts = batch.query_starts
            rows = AdapterRows.of_sequences(starts, step.adapters, self.model.device)
            batch = dataclasses.replace(batch, adapters=rows)
        if step.images is None:
            return batch
        return dataclasses.replace(batch, **self._images(step, batch.query_starts))

    def _states(self, step: ScheduledStep) -> StepStates:
        """The step's slots in the recurrent-state pool; a sequence whose step starts at
        position 0 (new, or recomputed after a preemption) starts from a zero state, one
        that starts from a prefix-cache hit from its snapshot (`ScheduledStep.state_restores`),
        one whose proposals were rejected from its checkpoint (`state_rollbacks`)."""
        if step.state_slots is None:
            raise QinferError("a step of a hybrid model needs its sequences' state_slots")
        for slot, computed in zip(step.state_slots, step.num_computed, strict=True):
            if computed == 0:
                self.states.reset(slot)
        self.states.rollback(step.state_rollbacks)
        self.states.copy(step.state_restores)
        slots = torch.tensor(step.state_slots, dtype=torch.long, device=self.model.device)
        return StepStates(self.states, slots, step.num_proposed)

    def _images(self, step: ScheduledStep, starts: list[int]) -> dict:
        """The `ForwardBatch` fields of a step with images: positions (3, T), each
        sequence's from its `StepImages` or, without images, its index in all three
        sections; and the image rows of the flat step with their embeddings (None: the
        step runs no image token, as when decoding)."""
        positions, rows, embeddings, deepstack = [], [], [], []
        for b, images in enumerate(step.images):
            if images is None:  # text: (n,) -> (3, n)
                computed, n = step.num_computed[b], len(step.new_tokens[b])
                positions.append(torch.arange(computed, computed + n).expand(3, -1))
                continue
            positions.append(images.positions)
            if images.rows:
                rows += [starts[b] + row for row in images.rows]
                embeddings.append(images.embeddings)
                deepstack.append(images.deepstack)
        device = self.model.device
        fields: dict = {"positions": torch.cat(positions, dim=1).to(device), "images": None}
        if rows:
            fields["images"] = BatchImages(
                rows=torch.tensor(rows, device=device),
                embeddings=torch.cat(embeddings).to(device),
                deepstack=tuple(
                    torch.cat(level).to(device) for level in zip(*deepstack, strict=True)
                ),
            )
        return fields

    def _write(self, step: ScheduledStep, widths: list[int] | None) -> ForwardBatch:
        """The step written into the buffers: a batch to plan."""
        rows, _ = step.logits_rows()
        return self.buffers.write(step.new_tokens, step.num_computed, step.tables, rows, widths)

    def _batch(self, written: ForwardBatch) -> ForwardBatch:
        return written.planned(self.backend.plan(written, self.layers))

    def _replayed(self, step: ScheduledStep, widths: list[int]) -> torch.Tensor:
        """The logits (Gb, V) of a bucketed decode step, its inputs written into the step
        buffers and its bucket's graph replayed over them (the plan is in the graph: it
        reads only those buffers)."""
        tensors = self._write(step, widths)
        if self.buffers.capacity != self._graphed_capacity:  # grown: new memory
            self.graphs.clear()
            self._graphed_capacity = self.buffers.capacity
        key = (len(step.new_tokens), tuple(widths))

        def run() -> torch.Tensor:
            # a batch of its own each run: a capture records the rotation (`Rotations`)
            batch = self._batch(tensors)
            return self.model.compute_logits(batch.logits_rows(self.model.forward(batch)))

        return self.graphs.run(key, run)
