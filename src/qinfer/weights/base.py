"""The weights seam: every checkpoint format answers `tensor(name)` and `linear(prefix)`.

Names are always the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`); a
format with other names (GGUF) maps them. `tensor` gives a dense tensor in the compute
dtype on the requested device (norm weights); `linear` gives a callable `qinfer.linear.Linear`
whose kind (dense, int8, int4 groups) follows the file and the `Quantize` choice it is
given (`weights/load.py` fills a built model's slots through these two calls). Every
error names the tensor and the file. Under tensor parallelism `linear(..., shard=)` reads only
a rank's part of a projection (`qinfer.core.parallel.Shard`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qinfer.core.errors import WeightsError
from qinfer.core.parallel import Shard
from qinfer.linear import (
    Int4Groups,
    Int8Blocks,
    Linear,
    RowParallelLinear,
    StoredWeight,
    VocabParallelLinear,
    make_linear,
    quantize_int4,
    quantize_int8,
)

QUANTIZE_KINDS = ("int8", "int4")

#: The whole of a dimension, as a slice (a reader's `rows` and `columns` default).
ALL = slice(None)


@dataclass(frozen=True)
class Quantize:
    """Weight-only quantization of dense weights at load: "int8" (per output channel) or
    "int4" (groups of `group_size` input columns; a GGUF file's int8 blocks too). Tables
    read by embedding lookups take int8 either way (int4 kernels cannot read single rows)."""

    kind: str
    group_size: int = 32


class Weights(ABC):
    """A read-only map from tensor names to tensors of one checkpoint."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        # our name -> (stored name, first row, rows): parts of a fused tensor (split_fused)
        self._parts: dict[str, tuple[str, int, int]] = {}

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor name the checkpoint holds."""

    @abstractmethod
    def where(self, name: str) -> str:
        """The file a tensor lives in (or would be expected in), for error messages."""

    @abstractmethod
    def _shape(self, name: str) -> tuple[int, ...]:
        """The stored tensor's shape in weights ((out, in) for a projection), from the file's
        header: nothing is read. `name` is known to exist."""

    @abstractmethod
    def _read(self, name: str, rows: slice = ALL, columns: slice = ALL) -> torch.Tensor:
        """The stored tensor, or the given rows and columns of it (a tensor-parallel rank's
        part), in whatever dtype the file holds it; `name` is known to exist. A reader reads
        only what it is asked for wherever the format allows."""

    def _stored(self, name: str, rows: slice = ALL, columns: slice = ALL) -> StoredWeight:
        """The weight (or its rows and columns) as stored: dense here; a reader that keeps
        quantized blocks overrides."""
        return self._read(name, rows, columns)

    def has(self, name: str) -> bool:
        return name in self._name_set() or name in self._parts

    def split_fused(self, fused: str, parts: Sequence[tuple[str, int]]) -> None:
        """Name the row blocks of tensor `fused.weight` (and of `fused.bias` where there is
        one) as tensors of their own: parts are (prefix, rows) in stored order, so that
        `linear(prefix)` reads a part's rows of the fused tensor. A no-op where the
        checkpoint has no such tensor."""
        for suffix in ("weight", "bias"):
            stored = f"{fused}.{suffix}"
            if not self.has(stored):
                continue
            total = sum(rows for _, rows in parts)
            if self._shape(stored)[0] != total:
                raise WeightsError(
                    f"tensor {stored!r} in {self.where(stored)} has {self._shape(stored)[0]} "
                    f"rows, expected {total} ({' + '.join(str(rows) for _, rows in parts)})"
                )
            first = 0
            for prefix, rows in parts:
                self._parts[f"{prefix}.{suffix}"] = (stored, first, rows)
                first += rows

    def _located(self, name: str, rows: slice) -> tuple[str, slice]:
        """The stored tensor and rows that hold `rows` of `name` (itself, unless a part of
        a fused tensor)."""
        if name not in self._parts:
            return name, rows
        stored, first, count = self._parts[name]
        start, stop, _ = rows.indices(count)
        return stored, slice(first + start, first + stop)

    def _name_set(self) -> set[str]:
        if not hasattr(self, "_names_cache"):
            self._names_cache = set(self.names())
        return self._names_cache

    def _checked_shape(self, name: str, expected: tuple[int, ...] | None) -> tuple[int, ...]:
        """The stored shape of `name`, which must exist and match `expected` when given."""
        if not self.has(name):
            raise WeightsError(f"tensor {name!r} not found in {self.where(name)}")
        if name in self._parts:  # a part of a fused tensor: its rows, the stored columns
            stored, _, rows = self._parts[name]
            shape = (rows, *self._shape(stored)[1:])
        else:
            shape = tuple(self._shape(name))
        if expected is not None and shape != tuple(expected):
            raise WeightsError(
                f"tensor {name!r} in {self.where(name)} has shape {shape}, "
                f"expected {tuple(expected)}"
            )
        return shape

    def tensor(
        self, name: str, shape: tuple[int, ...] | None = None, rows: slice = ALL
    ) -> torch.Tensor:
        """Load `name` (or its `rows`) dense, check its whole shape when given, cast to dtype
        and move to device."""
        self._checked_shape(name, shape)
        return self._read(*self._located(name, rows)).to(device=self.device, dtype=self.dtype)

    def linear(
        self,
        prefix: str | Sequence[str],
        shape: tuple[int, int] | Sequence[tuple[int, int]] | None = None,
        bias: bool | None = None,
        *,
        rows: bool = False,
        shard: Shard | None = None,
        quantize: Quantize | None = None,
    ) -> Linear:
        """The projection `prefix.weight` (out, in) with its bias `prefix.bias` (out,).

        prefix: one name, or several (q, k, v) loaded as one fused projection whose output
            is theirs side by side; shape then gives one (out, in) per prefix.
        bias: True when the architecture requires one (missing is an error), False when
            it has none (a stray tensor is ignored, as `transformers` does), None to take it
            when the checkpoint has it.
        rows: the table also serves embedding lookups (`Linear.rows`), so it must be of a
            kind that can read single rows (dense or int8).
        shard: this rank's part under tensor parallelism (None: the whole). Only that part
            is read and quantized; shape still names the whole stored weights. "out": rows
            `shard.ranges[i]` of part i and of its bias, a plain Linear; "in" (one prefix):
            columns `shard.ranges[0]`, a `RowParallelLinear` holding the whole bias; "vocab":
            rows `shard.ranges[0]`, a `VocabParallelLinear`.
        quantize: what dense weights become (None: they stay dense); quantized blocks a
            reader keeps stay as they are.
        """
        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        shapes = [shape] * len(prefixes) if shape is None or isinstance(shape[0], int) else shape
        parts, biases = [], []
        for part_prefix, part_shape, (part_rows, part_columns) in zip(
            prefixes, shapes, _slices(shard, len(prefixes)), strict=True
        ):
            name = f"{part_prefix}.weight"
            whole = self._checked_shape(name, part_shape)
            stored, stored_rows = self._located(name, part_rows)
            weight = self._stored(stored, stored_rows, part_columns)
            split = "" if part_columns == ALL else f" split over {shard.parallel.world_size} ranks"
            parts.append(_quantized(f"{name!r}{split}", weight, rows, quantize))
            bias_name = f"{part_prefix}.bias"
            wanted = self.has(bias_name) if bias is None else bias
            biases.append(self.tensor(bias_name, whole[:1], part_rows) if wanted else None)
        if shard is None or shard.split == "out":
            return make_linear(parts, biases, self.dtype, self.device)
        if shard.split == "in":  # the bias joins once, after the ranks' sums are added
            local = make_linear(parts, [None], self.dtype, self.device)
            return RowParallelLinear(local, biases[0], shard.parallel)
        local = make_linear(parts, biases, self.dtype, self.device)
        return VocabParallelLinear(local, shard.ranges[0], whole[0], shard.parallel)


def _quantized(
    what: str, weight: StoredWeight, rows: bool, quantize: Quantize | None
) -> StoredWeight:
    """The weight in the kind it will be used in (see `Quantize`); `what` names it."""
    if isinstance(weight, torch.Tensor):
        if quantize is None:
            return weight
        if quantize.kind == "int4" and not rows:
            return quantize_int4(weight, quantize.group_size, what)
        return quantize_int8(weight)
    if rows and isinstance(weight, Int4Groups):
        return quantize_int8(weight.dequantize())
    if quantize is not None and quantize.kind == "int4" and isinstance(weight, Int8Blocks):
        return weight if rows else quantize_int4(weight.dequantize(), quantize.group_size, what)
    return weight


def _slices(shard: Shard | None, parts: int) -> list[tuple[slice, slice]]:
    """(rows, columns) of each part's stored weight that this rank reads."""
    if shard is None:
        return [(ALL, ALL)] * parts
    if shard.split == "in":
        columns = shard.ranges[0]
        return [(ALL, slice(columns.start, columns.stop))]
    return [(slice(r.start, r.stop), ALL) for r in shard.ranges]
