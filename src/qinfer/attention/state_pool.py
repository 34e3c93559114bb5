"""The recurrent-state pool: where the Gated DeltaNet layers of a hybrid model keep each
sequence's state, beside the KV block pool of its attention layers.

A DeltaNet layer's state does not grow with the sequence: per sequence it is the conv's
window (the last K - 1 inputs of q/k/v, (C, K - 1)) and the delta rule's matrix
(Hv, d_k, d_v), fp32. So the pool is a slot per running sequence, not blocks:

    conv[layer]       (slots, K - 1, C)        compute dtype
    recurrent[layer]  (slots, Hv, d_k, d_v)    fp32

A sequence takes a slot (`allocate`, zeroed: a new sequence's state) and keeps it until it
ends (`free`); a step names the slots of its sequences in order (`StepStates`, carried by
`ForwardBatch.states`), and each DeltaNet layer reads and writes those rows. The reference
path (`Transformer.make_cache`) makes a pool of B slots for B rows; the engine's runner
holds one pool beside its KV pools, sized with them (`runtime.runner.state_slots`), and the
engine gives each running sequence a slot (`engine.block_manager`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.core.errors import QinferError
from qinfer.core.model_config import ModelConfig


class StatePool:
    """`slots` sequences' states for every DeltaNet layer of `config` (layer index -> its
    tensors), on `device`; the conv windows in `dtype`, the recurrent states in fp32."""

    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shapes = config.deltanet
        if shapes is None:
            raise QinferError(f"model_type {config.model_type!r} has no linear-attention layers")
        if slots < 1:
            raise QinferError(f"a state pool needs at least one slot, got slots={slots}")
        self.slots = slots
        layers = [i for i in range(config.num_hidden_layers) if config.linear(i)]
        window = (slots, shapes.conv_kernel - 1, shapes.conv_dim)
        matrix = (slots, shapes.num_value_heads, shapes.key_head_dim, shapes.value_head_dim)
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
        """Bytes the pool holds, every slot of every layer."""
        tensors = [*self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

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


@dataclass(frozen=True)
class StepStates:
    """The recurrent state of one step: the pool, and the slot of each of the step's
    sequences, in `ForwardBatch.query_starts` order ((S,) long, on the pool's device)."""

    pool: StatePool
    slots: torch.Tensor
