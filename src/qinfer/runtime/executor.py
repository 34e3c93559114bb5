"""Who runs a step: the `Executor` owns the ranks the model is split over.

    executor = Executor(model, runtime_config)             # one process
    executor = Executor(shard, runtime_config, group)      # rank 0 of a tensor-parallel group
    output = executor.execute(step)                        # ScheduledStep -> StepOutput
    executor.close()                                       # stops the workers (if any)

The engine talks to the executor only: it never sees a rank, a group or a channel. In one
process the executor's `ModelRunner` runs the step. Under tensor parallelism the executor is
rank 0's: it broadcasts each step to the workers (`StepChannel`) and runs it on its own
shard, while every worker runs `follow` (the same steps, in the same order, over pools of
the same block spaces and numbers of blocks). A failed collective becomes the group's one-line
`TensorParallelError`, naming the rank that died.

`ParallelConfig(tensor, pipeline)` says how the ranks are laid out: `pipeline` stages of
`tensor` ranks each, rank r in stage r // tensor. Only one stage runs today (pipeline > 1 is
refused); a pipeline would give each stage its layers and its tensor group
(`tensor_group_ranks`), and the executor would pass hidden states from stage to stage,
with no change to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.attention.block_spaces import BlockSpaces
from qinfer.core.errors import QinferError
from qinfer.model.transformer import Transformer
from qinfer.runtime.config import RuntimeConfig
from qinfer.runtime.distributed import TensorParallelGroup
from qinfer.runtime.runner import (
    ModelRunner,
    StepOutput,
    kv_pool_blocks,
    state_slots,
    state_snapshots,
)
from qinfer.runtime.step import ScheduledStep
from qinfer.runtime.step_channel import StepChannel


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks split the model: tensor (ranks that split every layer's heads and
    channels) x pipeline (stages that would each run some of the layers; 1 for now)."""

    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QinferError(
                    f"ParallelConfig.{name} must be a positive integer, got {value!r}"
                )
        if self.pipeline != 1:
            raise QinferError(
                f"pipeline parallelism is not supported yet: pipeline must be 1, got {self.pipeline}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    def tensor_group_ranks(self) -> list[range]:
        """The ranks of each stage's tensor-parallel group, stage by stage (one group of
        every rank while pipeline is 1: the default process group)."""
        return [range(s * self.tensor, (s + 1) * self.tensor) for s in range(self.pipeline)]


class Executor:
    """Runs each step on every rank of the model and hands rank 0's result back.

    group: the tensor-parallel group whose rank 0 this process is (model is its shard),
    or None for one process. The pools of every rank have the same block spaces and
    numbers of blocks (the fewest any rank can hold), so a block id means the same slots
    everywhere. `spaces`: the model's block spaces (`qinfer.attention.block_spaces`).
    """

    def __init__(
        self, model: Transformer, config: RuntimeConfig, group: TensorParallelGroup | None = None
    ) -> None:
        self.group = group
        self.parallel = ParallelConfig(tensor=1 if group is None else group.parallel.world_size)
        self._channel = None if group is None else StepChannel(group)
        self.spaces, blocks, rows = pool_layout(model, config, self._channel)
        self.runner = ModelRunner(model, config, blocks, self.spaces, *rows)

    @property
    def model(self) -> Transformer:
        """Rank 0's model (its shard under tensor parallelism)."""
        return self.runner.model

    @property
    def num_blocks(self) -> list[int]:
        """Blocks in each block space's KV pool (the same on every rank)."""
        return self.runner.num_blocks

    @property
    def state_slots(self) -> int:
        """Slots of the recurrent-state pool (0: the model has no Gated DeltaNet layer)."""
        states = self.runner.states
        return 0 if states is None else states.slots

    @property
    def state_snapshots(self) -> int:
        """Snapshot rows of the recurrent-state pool (a hybrid model's prefix cache)."""
        states = self.runner.states
        return 0 if states is None else states.snapshots

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes this process's KV pools and recurrent-state pool take (rank 0's under
        tensor parallelism)."""
        states = self.runner.states
        return sum(pool.nbytes for pool in self.runner.pools) + (states.nbytes if states else 0)

    def execute(
        self, step: ScheduledStep, hidden_rows: list[list[int] | None] | None = None
    ) -> StepOutput:
        """Run one step on every rank; rank 0's logits (and pooled hidden rows, see
        `ModelRunner.forward`). Under tensor parallelism a rank that died or a collective
        that failed raises a `TensorParallelError` naming it."""
        if self._channel is None:
            return self.runner.forward(step, hidden_rows)
        try:
            self._channel.send(step)
            return self.runner.forward(step, hidden_rows)
        except RuntimeError as error:  # torch.distributed's errors
            raise self.group.failure(error) from None

    def close(self) -> None:
        """Stop the workers and leave the group (nothing in one process); idempotent."""
        if self.group is not None:
            group, self.group = self.group, None
            try:
                self._channel.stop()
            except RuntimeError:  # a worker is gone already
                pass
            group.close()


def follow(model: Transformer, config: RuntimeConfig, group: TensorParallelGroup) -> None:
    """A worker rank: size the same pools as every rank, then run rank 0's steps, in its
    order, until it stops."""
    channel = StepChannel(group)
    spaces, blocks, rows = pool_layout(model, config, channel)
    runner = ModelRunner(model, config, blocks, spaces, *rows)
    while (step := channel.receive()) is not None:
        runner.forward(step)


def pool_layout(
    model: Transformer, config: RuntimeConfig, channel: StepChannel | None
) -> tuple[BlockSpaces, list[int], tuple[int, int]]:
    """The model's block spaces, each one's blocks (`kv_pool_blocks`) and the slots and
    snapshot rows of its recurrent-state pool (`state_slots`, `state_snapshots`, out of the
    same budget). A draft model
    reads space 0's tables for its own pool, so with one, space 0 keeps whole histories.
    Under tensor parallelism every rank takes rank 0's word for that (a worker's config has
    no speculative settings: the draft model is rank 0's)."""
    drafted = config.whole_space_0
    if channel is not None:
        drafted = bool(channel.rank_0(int(drafted)))
    spaces = BlockSpaces.of(model.config, whole_space_0=drafted)
    slots = state_slots(model, config, channel)
    snapshots = state_snapshots(model, config, slots)
    checkpoints = slots if config.num_speculative_tokens else 0  # a row per slot
    blocks = kv_pool_blocks(model, config, spaces, channel, slots + snapshots + checkpoints)
    return spaces, blocks, (slots, snapshots)
