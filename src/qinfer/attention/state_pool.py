"""The recurrent-state pool: where the Gated DeltaNet layers of a hybrid model keep each
sequence's state, beside the KV block pool of its attention layers.

A DeltaNet layer's state does not grow with the sequence: per sequence it is the conv's
window (the last K - 1 inputs of q/k/v, (K - 1, C)) and the delta rule's matrix
(Hv, d_k, d_v), fp32. So the pool is a slot per running sequence, not blocks:

    conv[layer]       (slots, K - 1, C)        compute dtype
    recurrent[layer]  (slots, Hv, d_k, d_v)    fp32

A sequence takes a slot (`allocate`, zeroed: a new sequence's state) and keeps it until it
ends (`free`); a step names the slots of its sequences in order (`StepStates`, carried by
`ForwardBatch.states`), and each DeltaNet layer reads and writes those rows. The reference
path (`Transformer.make_cache`) makes a pool of B slots for B rows; the engine's runner
holds one pool beside its KV pools, sized with them (`runtime.runner.state_slots`), and the
engine gives each running sequence a slot (`engine.block_manager`).

Snapshots. Rows past the slots (`snapshots` of them, numbered slots .. slots + snapshots - 1)
hold copies of a sequence's state at a block boundary, for the prefix cache: a prompt that
shares the first p tokens of an earlier one starts from the copy of the state after them
instead of recomputing it (`engine.block_manager` says which rows hold what, and when a
copy is made). `copy` moves whole rows, every layer's window and matrix, in one go: into a
snapshot row after a step that ended a sequence at p, into a sequence's slot before the
step that starts it from p. A row costs `bytes_per_slot`: for Qwen3.5-0.8B's shapes (18
DeltaNet layers, 16 heads of 128 x 128, conv 6144 x 3, bf16) 18 x (1 MiB + 36 KiB) = 18.6
MiB, as much as ~100 KV blocks of 16 tokens of its 6 attention layers (192 KiB each).

Checkpoints (speculative decoding). A step that verifies k proposed tokens runs them
through the state after the sequence's own tokens, but only the state after the last
accepted one may stay. So with `checkpoints`, each slot s has a row of its own after the
snapshots (`checkpoint_row(s)`): the DeltaNet layer copies the slot's state there after
the sequence's own tokens, before its proposals (`keep`; `StepStates.proposed` says how
many there are), and a later step that must forget the proposals' effect copies it back
(`rollback`). That doubles the slots' memory, and only with speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.core.errors import QinferError
from qinfer.core.model_config import ModelConfig


class StatePool:
    """`slots` sequences' states for every DeltaNet layer of `config` (layer index -> its
    tensors), then `snapshots` rows of saved states, then (with `checkpoints`) a
    checkpoint row per slot, on `device`; the conv windows in `dtype`, the recurrent
    states in fp32."""

    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        snapshots: int = 0,
        checkpoints: bool = False,
    ) -> None:
        shapes = config.deltanet
        if shapes is None:
            raise QinferError(f"model_type {config.model_type!r} has no linear-attention layers")
        if slots < 1:
            raise QinferError(f"a state pool needs at least one slot, got slots={slots}")
        if snapshots < 0:
            raise QinferError(f"a state pool's snapshots must be 0 or more, got {snapshots}")
        self.slots, self.snapshots = slots, snapshots
        self.device = torch.device(device)
        layers = [i for i in range(config.num_hidden_layers) if config.linear(i)]
        rows = slots + snapshots + slots * checkpoints
        window = (rows, shapes.conv_kernel - 1, shapes.conv_dim)
        matrix = (rows, shapes.num_value_heads, shapes.key_head_dim, shapes.value_head_dim)
        self.conv = {i: torch.zeros(window, dtype=dtype, device=device) for i in layers}
        self.recurrent = {
            i: torch.zeros(matrix, dtype=torch.float32, device=device) for i in layers
        }
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes, every DeltaNet layer's conv window in `dtype`
        and fp32 matrix."""
        shapes = config.deltanet
        window = shapes.conv_dim * (shapes.conv_kernel - 1) * dtype.itemsize
        matrix = shapes.num_value_heads * shapes.key_head_dim * shapes.value_head_dim * 4
        layers = sum(config.linear(i) for i in range(config.num_hidden_layers))
        return layers * (window + matrix)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds, every slot and snapshot row of every layer."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, its state zeroed (a new sequence's); an error naming the pool's
        size when none is free."""
        if not self._free:
            raise QinferError(f"the recurrent-state pool's {self.slots} slots are all in use")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give `slot` back (its sequence finished, was aborted or preempted)."""
        if not 0 <= slot < self.slots or slot in self._free:
            raise QinferError(f"state slot {slot} is not in use")
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero `slot`'s state in every layer: the state before a sequence's first token."""
        for tensors in (self.conv, self.recurrent):
            for t in tensors.values():
                t[slot].zero_()

    def read_row(self, row: int) -> list[torch.Tensor]:
        """Copies of `row`'s state on the CPU: every layer's conv window, then every layer's
        matrix (a snapshot as the disk tier stores it)."""
        return [t[row].to("cpu", copy=True) for t in self._tensors()]

    def row_shapes(self) -> list[tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of each of `read_row`'s tensors."""
        return [(t.shape[1:], t.dtype) for t in self._tensors()]

    def write_row(self, row: int, tensors: list[torch.Tensor]) -> None:
        """Set `row`'s state to `tensors`, as `read_row` gives them."""
        for t, value in zip(self._tensors(), tensors, strict=True):
            t[row].copy_(value)

    def _tensors(self) -> list[torch.Tensor]:
        """Every layer's conv windows, then every layer's matrices (rows x ...)."""
        return [*self.conv.values(), *self.recurrent.values()]

    def checkpoint_row(self, slot: int) -> int:
        """The row where `slot`'s state before a step's proposed tokens is kept."""
        return self.slots + self.snapshots + slot

    def keep(self, layer: int, slots: torch.Tensor) -> None:
        """Copy `layer`'s state of `slots` ((n,) long) into their checkpoint rows."""
        rows = slots + (self.slots + self.snapshots)
        for t in (self.conv[layer], self.recurrent[layer]):
            t.index_copy_(0, rows, t[slots])

    def rollback(self, slots: list[int]) -> None:
        """Set `slots`' state back to their checkpoints, in every layer."""
        self.copy([(self.checkpoint_row(slot), slot) for slot in slots])

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """For each (source, destination) pair of rows (slots or snapshot rows), the
        destination's state becomes the source's, in every layer. Every source is read
        before any destination is written."""
        if not pairs:
            return
        sources, destinations = torch.tensor(pairs, device=self.device).T  # (P,) each
        for tensors in (self.conv, self.recurrent):
            for t in tensors.values():
                t.index_copy_(0, destinations, t[sources])


@dataclass(frozen=True)
class StepStates:
    """The recurrent state of one step: the pool, and the slot of each of the step's
    sequences, in `ForwardBatch.query_starts` order ((S,) long, on the pool's device);
    proposed: how many of each sequence's last tokens are proposals to verify, the state
    before them kept in the slot's checkpoint row (None: no sequence has any)."""

    pool: StatePool
    slots: torch.Tensor
    proposed: list[int] | None = None
