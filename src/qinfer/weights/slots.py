"""What a built model asks of its weights: the slots that `qinfer.weights.load` fills.

A model is built from its config alone (`qinfer.model.transformer.Transformer(config)`): its layers are
`torch.nn.Module`s whose projections are empty slots and whose norms hold a placeholder on
the meta device. Each slot names what fills it, so that loading is one generic walk over
`named_modules()` (`weights/load.py`), from a checkpoint or at random:

- `LinearSlot(LinearSource)`: one projection (or several fused side by side: q/k/v,
  gate/up), replaced by the `Linear` the checkpoint's kind gives (dense, int8, int4, a
  tensor-parallel rank's part);
- `GroupedSlot([LinearSource] * E)`: a mixture of experts' E projections of one shape,
  replaced by a `GroupedLinear`;
- `TensorSlot`: a module holding one tensor of its own (a norm's weight), filled in place;
- `Placed`: a module with state that depends on where it runs (this rank's heads, the
  device of its RoPE frequencies), set before its slots are filled.

Sources hold the whole stored shapes (as the checkpoint names them); which part a
tensor-parallel rank reads is decided at load, by each source's `shard(parallel)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qinfer.core.errors import QinferError
from qinfer.core.module import Module
from qinfer.core.parallel import Parallel, Shard


def whole(parallel: Parallel) -> Shard | None:
    """The shard of a projection every rank holds whole (a router)."""
    return None


@dataclass(frozen=True)
class LinearSource:
    """Where one projection's weights come from.

    names: the checkpoint prefixes (`model.layers.0.self_attn.q_proj`), several for a fused
        projection whose output is theirs side by side; shapes: each one's whole
        (out, in) as stored.
    bias: whether each prefix has a `.bias` (the architecture's rule, not the file's).
    shard: this rank's part (`qinfer.core.parallel.Shard`, None for the whole).
    rows: the table also serves embedding lookups (`Linear.rows`: dense or int8 only).
    dense: never quantized (a router, whose choices are discrete).
    reduced: a row-parallel part all-reduces its partial sums in its call; False leaves
        them to the layer (a mixture of experts adds every expert's first, then reduces once).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    bias: bool = False
    shard: Callable[[Parallel], Shard | None] = whole
    rows: bool = False
    dense: bool = False
    reduced: bool = True

    @property
    def out_features(self) -> int:
        return sum(out for out, _ in self.shapes)

    @property
    def in_features(self) -> int:
        return self.shapes[0][1]


class LinearSlot(Module):
    """An empty projection: `load` replaces it (wherever the model holds it, a tied head
    included) with the Linear its source gives. Calling it is an error."""

    def __init__(self, source: LinearSource) -> None:
        super().__init__()
        self.source = source
        self.out_features, self.in_features = source.out_features, source.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise not_loaded(self.source.names[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise not_loaded(self.source.names[0])

    def extra_repr(self) -> str:
        return f"{', '.join(self.source.names)}: {self.out_features} x {self.in_features}"


class GroupedSlot(Module):
    """An empty grouped projection: one source per group (expert), all of one shape."""

    def __init__(self, sources: list[LinearSource]) -> None:
        super().__init__()
        self.sources = sources
        self.groups = len(sources)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        raise not_loaded(self.sources[0].names[0])

    def extra_repr(self) -> str:
        return f"{self.groups} x {self.sources[0].names[0]}"


class TensorSlot(ABC):
    """A module that holds one checkpoint tensor of its own, filled in place by `fill`.

    source: the tensor's checkpoint name (None: not read from a checkpoint, a module built
    around a given tensor); shape: its stored shape; initial: the value of a fresh model's
    tensor, around which random weights are drawn (1 for a norm's scale).
    """

    source: str | None
    shape: tuple[int, ...]
    initial: float

    @abstractmethod
    def fill(self, tensor: torch.Tensor) -> None:
        """Take `tensor` (shape `shape`, the compute dtype, on the device) as the weight."""


class Placed(ABC):
    """A module whose state depends on where it runs: `place` is called before any slot
    of the model is filled, so it may also refuse a world size, before anything loads."""

    @abstractmethod
    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        """Take on this rank's part (heads, channels), the compute dtype and the device."""


def not_loaded(name: str) -> QinferError:
    """The error of a call into a model built but not loaded."""
    return QinferError(
        f"{name} is not loaded: fill the built model with qinfer.weights.load.load "
        "(a checkpoint) or init_random"
    )
