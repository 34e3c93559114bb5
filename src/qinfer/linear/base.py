"""What every kind of Linear answers: apply it, read rows of it, and show the weight it holds.

Every kind is a `torch.nn.Module` whose tensors are buffers (inference only: no gradients),
so a model's projections show in `named_modules()`, take forward hooks, and list their
tensors in `state_dict()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from qinfer.core.errors import WeightsError
from qinfer.core.forward_batch import AdapterRows
from qinfer.core.module import Module
from qinfer.linear.logits import exact_from_rows, fp32_logits


class Linear(Module, ABC):
    """y = x W^T + b for a weight W (out_features, in_features) stored in some form.

    bias: (out_features,) in the compute dtype, or None. `dequantize()` is the weight the
    kernel multiplies by, in fp32: the reference every kind is tested against.
    """

    out_features: int
    in_features: int
    bias: torch.Tensor | None
    #: the `qinfer.weights.slots.LinearSource` it was loaded from (None: built otherwise)
    source = None
    #: whether its call takes a step's `AdapterRows` (`qinfer.linear.lora.LoraLinear`)
    takes_adapters = False

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., out_features), in x's dtype."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight (out_features, in_features) in fp32, as the kernel sees it."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of weight (and scales, and bias) a forward reads."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W at `ids` (...,) -> (..., in_features): an embedding lookup, each row
        as `dequantize` holds it (exact in fp32)."""
        raise WeightsError(f"{type(self).__name__} weights cannot serve embedding lookups")

    def has_rows(self) -> bool:
        """Whether `rows` works for this weight where it lives."""
        return False

    def exact_logits(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (R, in_features) fp32, ids (R, k) -> (R, k) fp32 logits of those rows of W,
        exactly (`qinfer.linear.logits.exact_from_rows`): the top that `logits` recomputes."""
        return exact_from_rows(self, x, ids)

    def logits(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The lm_head's call: x (R, in_features) fp32 -> fp32 logits (R, out_features),
        the weight multiplied in the compute `dtype` (`qinfer.linear.logits`)."""
        return fp32_logits(self, x, dtype)

    def same_at_any_rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x), along a path that gives a row the same output whatever the row
        count (the head's first pass: its rows are a step's sequences)."""
        return self(x)

    def _bias_nbytes(self) -> int:
        return 0 if self.bias is None else self.bias.nbytes


def linear(x: torch.Tensor, w: Linear, adapters: AdapterRows | None = None) -> torch.Tensor:
    """(..., in_features) -> (..., out_features): the layers' one call, whatever w's kind.
    adapters: the step's LoRA rows, for a projection that holds adapters (else unused)."""
    if adapters is None or not w.takes_adapters:
        return w(x)
    return w(x, adapters)
