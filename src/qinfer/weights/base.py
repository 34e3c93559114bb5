"""The weights seam: every checkpoint format answers `tensor(name)` and `linear(prefix)`.

Names are always the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`); a
format with other names (GGUF) maps them. Tensors come back cast to the requested
dtype and on the requested device. Every error names the tensor and the file.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from qinfer.errors import WeightsError
from qinfer.layers.linear import Linear


class Weights(ABC):
    """A read-only map from tensor names to tensors of one checkpoint."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype = dtype
        self.device = torch.device(device)

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor name the checkpoint holds."""

    @abstractmethod
    def where(self, name: str) -> str:
        """The file a tensor lives in (or would be expected in), for error messages."""

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The stored tensor, in whatever dtype the file holds it; `name` is known to exist."""

    def has(self, name: str) -> bool:
        return name in self._name_set()

    def _name_set(self) -> set[str]:
        if not hasattr(self, "_names_cache"):
            self._names_cache = set(self.names())
        return self._names_cache

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Load `name`, check its shape when given, cast to dtype and move to device."""
        if not self.has(name):
            raise WeightsError(f"tensor {name!r} not found in {self.where(name)}")
        t = self._read(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise WeightsError(
                f"tensor {name!r} in {self.where(name)} has shape {tuple(t.shape)}, "
                f"expected {tuple(shape)}"
            )
        return t.to(device=self.device, dtype=self.dtype)

    def linear(
        self, prefix: str, shape: tuple[int, int] | None = None, bias: bool | None = None
    ) -> Linear:
        """The projection `prefix.weight` (out, in) and its bias `prefix.bias` (out,).

        bias: True when the architecture requires one (missing is an error), False when
        it has none (a stray tensor is ignored, as `transformers` does), None to take it
        when the checkpoint has it.
        """
        weight = self.tensor(f"{prefix}.weight", shape)
        bias_name = f"{prefix}.bias"
        if bias is None:
            bias = self.has(bias_name)
        return Linear(weight, self.tensor(bias_name, tuple(weight.shape[:1])) if bias else None)
