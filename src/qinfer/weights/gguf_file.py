"""A GGUF file's header as plain Python values, parsed once and cached: the metadata
(a vocabulary held compact), and where each tensor's bytes lie, read on demand.

The `gguf` package's `GGUFReader` parses and memory-maps the file; what stays is
`GGUFFile` (metadata and `TensorInfo`s) and reads of rows or columns that never keep the
file's pages mapped. What the metadata means to a model is `qinfer.weights.gguf`'s.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from qinfer.core.errors import WeightsError
from qinfer.weights.base import ALL


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in a GGUF file, and how the `gguf` reader shapes them:
    numpy (row-major) order, block types as uint8 (rows, row_bytes)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int

    @property
    def block(self) -> tuple[int, int]:
        """(weights, stored columns) of one block: a block type's bytes ((32, 18) for Q4_0),
        BF16's two bytes (1, 2); F32 and F16, which numpy holds as they are, (1, 1)."""
        return GGML_QUANT_SIZES[self.tensor_type] if self.dtype == np.uint8 else (1, 1)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The shape in weights ((out, in) for a projection), whatever the type."""
        weights, stored = self.block
        return (*self.shape[:-1], self.shape[-1] // stored * weights)


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: the metadata as Python values and where each tensor lies."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo]

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor the file stores under `name`, or None."""
        return next((t for t in self.tensors if t.name == name), None)

    def read(self, tensor: TensorInfo, rows: slice = ALL, columns: slice = ALL) -> np.ndarray:
        """A tensor's stored data, or some of its rows and stored columns (bytes, for block
        types). Whole rows are read from the file rather than mapped, so that the file's pages
        do not stay resident in this process once the model holds its own copy; a run of
        columns is copied out of a mapping dropped right after."""
        first, last, _ = rows.indices(tensor.shape[0])
        row_shape = tensor.shape[1:]
        row_bytes = math.prod(row_shape) * tensor.dtype.itemsize
        offset = tensor.offset + first * row_bytes
        if columns != ALL:
            try:
                mapped = np.memmap(self.path, tensor.dtype, "r", offset, (last - first, *row_shape))
            except ValueError:  # the mapping would reach past the end of the file
                raise WeightsError(f"{self.path} ends inside tensor {tensor.name!r}") from None
            return np.array(mapped[:, columns])
        count = (last - first) * math.prod(row_shape)
        data = np.fromfile(self.path, dtype=tensor.dtype, count=count, offset=offset)
        if data.size != count:
            raise WeightsError(f"{self.path} ends inside tensor {tensor.name!r}")
        return data.reshape(last - first, *row_shape)


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's header; a clear error if it is not one.

    Parsing takes seconds (the reader walks a 50k-token vocabulary in Python), so the last
    two files read are kept: loading a model and then its tokenizer parses the file once.
    """
    try:
        stat = path.stat()
        return _parsed_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)
    except (ValueError, OSError, IndexError, KeyError, TypeError, EOFError) as e:
        raise WeightsError(f"{path} is not a readable GGUF file: {e}") from None


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    """One file's header; mtime and size are part of the key so a rewritten file is re-read.
    The `gguf` reader (tens of MB of per-field arrays for a large vocabulary) is dropped."""
    reader = _PlainArrayReader(path)
    tensors = [
        TensorInfo(t.name, t.tensor_type, t.data.shape, t.data.dtype, int(t.data_offset))
        for t in reader.tensors
    ]
    metadata = {key: _value(key, field) for key, field in reader.fields.items()}
    return GGUFFile(path, metadata, tensors)


#: GGUF array types held compact in a parsed header: a vocabulary's scores and token types.
_NUMBER_TYPECODES = {
    GGUFValueType.FLOAT32: "d",
    GGUFValueType.FLOAT64: "d",
    **dict.fromkeys(
        (GGUFValueType.INT8, GGUFValueType.INT16, GGUFValueType.INT32, GGUFValueType.INT64), "q"
    ),
    **dict.fromkeys((GGUFValueType.UINT8, GGUFValueType.UINT16, GGUFValueType.UINT32), "q"),
}


def _value(key: str, field: ReaderField) -> Any:
    """A field's value as the reader gives it, except the vocabulary's arrays (an entry per
    token or merge: `tokenizer.ggml.*`), held compact for as long as the header is cached:
    strings as a `StringArray`, numbers in an `array` (why: `StringArray`)."""
    if not key.startswith("tokenizer.ggml.") or field.types[:1] != [GGUFValueType.ARRAY]:
        return field.contents()
    kind = field.types[-1]
    if kind == GGUFValueType.STRING:
        return StringArray.of(field)
    if kind in _NUMBER_TYPECODES:
        return array(_NUMBER_TYPECODES[kind], field.contents())
    return field.contents()


class StringArray(Sequence[str]):
    """A GGUF array of strings (a vocabulary, its merges) as one buffer of UTF-8 bytes and
    their offsets, each string decoded when read.

    Held as Python strings, the cached header of a 151k-token vocabulary kept ~88 MB
    resident for the life of the process (Qwen3; Gemma 3 34 MB, SmolLM2 17): the strings
    themselves and the parse's freed temporaries, which the interpreter could not give back
    around them (docs/BENCHMARKS.md, "Memory after loading")."""

    def __init__(self, data: bytes, ends: np.ndarray) -> None:
        self.data, self.ends = data, ends  # ends (n,) int64: where string i's bytes end

    @classmethod
    def of(cls, field: ReaderField) -> StringArray:
        """The strings of a reader's array-of-strings field."""
        pieces = [field.parts[index] for index in field.data]
        ends = np.cumsum([len(piece) for piece in pieces], dtype=np.int64)
        data = np.concatenate(pieces).tobytes() if pieces else b""
        return cls(data, ends)

    def __len__(self) -> int:
        return len(self.ends)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self.ends)
        if not -n <= index < n:
            raise IndexError(f"string {index} of {n}")
        index %= n
        start = int(self.ends[index - 1]) if index else 0
        return self.data[start : int(self.ends[index])].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        data, start = self.data, 0
        for end in self.ends.tolist():
            yield data[start:end].decode("utf-8")
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self.data == other.data and np.array_equal(self.ends, other.ends)
        return isinstance(other, Sequence) and list(self) == list(other)


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map (same bytes, same mapping).

    Slicing numpy's `memmap` subclass costs extra Python calls per slice, and the reader
    slices a few times per vocabulary string: this view makes parsing about 3x faster.
    """

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._array = np.asarray(mapped)
