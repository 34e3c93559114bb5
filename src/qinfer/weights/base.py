"""The weights seam: every checkpoint format answers `tensor(name)` and `linear(prefix)`.

Names are always the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`); a
format with other names (GGUF) maps them. `tensor` gives a dense tensor in the compute
dtype on the requested device (norm weights); `linear` gives a callable `qinfer.linear.Linear`
whose kind (dense, int8, int4 groups) follows the file and the `Quantize` choice. Every
error names the tensor and the file.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qinfer.errors import WeightsError
from qinfer.linear import (
    Int4Groups,
    Linear,
    StoredWeight,
    make_linear,
    quantize_int4,
    quantize_int8,
)

QUANTIZE_KINDS = ("int8", "int4")


@dataclass(frozen=True)
class Quantize:
    """Weight-only quantization of dense weights at load: "int8" (per output channel) or
    "int4" (groups of `group_size` input columns). Tables read by embedding lookups take
    int8 either way (int4 kernels cannot read single rows)."""

    kind: str
    group_size: int = 32


class Weights(ABC):
    """A read-only map from tensor names to tensors of one checkpoint."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device | str, quantize: Quantize | None = None
    ) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantize = quantize

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor name the checkpoint holds."""

    @abstractmethod
    def where(self, name: str) -> str:
        """The file a tensor lives in (or would be expected in), for error messages."""

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The stored tensor, in whatever dtype the file holds it; `name` is known to exist."""

    def _stored(self, name: str) -> StoredWeight:
        """The weight as stored: dense here; a reader that keeps quantized blocks overrides."""
        return self._read(name)

    def has(self, name: str) -> bool:
        return name in self._name_set()

    def _name_set(self) -> set[str]:
        if not hasattr(self, "_names_cache"):
            self._names_cache = set(self.names())
        return self._names_cache

    def _check(self, name: str, t: StoredWeight, shape: tuple[int, ...] | None) -> None:
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise WeightsError(
                f"tensor {name!r} in {self.where(name)} has shape {tuple(t.shape)}, "
                f"expected {tuple(shape)}"
            )

    def _require(self, name: str) -> None:
        if not self.has(name):
            raise WeightsError(f"tensor {name!r} not found in {self.where(name)}")

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Load `name` dense, check its shape when given, cast to dtype and move to device."""
        self._require(name)
        t = self._read(name)
        self._check(name, t, shape)
        return t.to(device=self.device, dtype=self.dtype)

    def linear(
        self,
        prefix: str | Sequence[str],
        shape: tuple[int, int] | Sequence[tuple[int, int]] | None = None,
        bias: bool | None = None,
        *,
        rows: bool = False,
    ) -> Linear:
        """The projection `prefix.weight` (out, in) with its bias `prefix.bias` (out,).

        prefix: one name, or several (q, k, v) loaded as one fused projection whose output
            is theirs side by side; shape then gives one (out, in) per prefix.
        bias: True when the architecture requires one (missing is an error), False when
            it has none (a stray tensor is ignored, as `transformers` does), None to take it
            when the checkpoint has it.
        rows: the table also serves embedding lookups (`Linear.rows`), so it must be of a
            kind that can read single rows (dense or int8).
        """
        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        shapes = [shape] * len(prefixes) if shape is None or isinstance(shape[0], int) else shape
        parts, biases = [], []
        for part_prefix, part_shape in zip(prefixes, shapes, strict=True):
            name = f"{part_prefix}.weight"
            self._require(name)
            weight = self._stored(name)
            self._check(name, weight, part_shape)
            parts.append(self._quantized(name, weight, rows))
            bias_name = f"{part_prefix}.bias"
            wanted = self.has(bias_name) if bias is None else bias
            biases.append(self.tensor(bias_name, tuple(weight.shape[:1])) if wanted else None)
        return make_linear(parts, biases, self.dtype, self.device)

    def _quantized(self, name: str, weight: StoredWeight, rows: bool) -> StoredWeight:
        """The weight in the kind it will be used in (see `Quantize`)."""
        if isinstance(weight, torch.Tensor):
            if self.quantize is None:
                return weight
            if self.quantize.kind == "int4" and not rows:
                return quantize_int4(weight, self.quantize.group_size, f"{name!r}")
            return quantize_int8(weight)
        if rows and isinstance(weight, Int4Groups):
            return quantize_int8(weight.dequantize())
        return weight
