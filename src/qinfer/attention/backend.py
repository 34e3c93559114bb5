"""The attention backend protocol: where the attention layer hands over its q, k and v.

The layer (`qinfer.layers.attention`) does the seed's steps that are the same whatever
stores K/V: the projections, QK-norm and RoPE. What remains, storing this step's k, v and
attending each query to its own sequence's visible history, is the backend's:

    out = backend.attend(layer, q, k, v, scale)
    # q (T, Hq, D), k and v (T, Hkv, D): the step's T tokens, flat (`ForwardBatch`)
    # out (T, Hq, D) in q's dtype

A backend object serves one forward: it holds the storage (caches or a block pool, which
outlive the step) and this step's metadata (row shape and mask, or block tables, slots and
history lengths). Backends:

- `ReferenceAttention` (`reference.py`): the seed's `cache.update_and_fetch` and
  `scaled_dot_product_attention_grouped` over one contiguous cache per layer, for
  rectangular batches; the oracle and the readable path.
- `PagedAttention` (`paged.py`): the engine's path over a pool of KV blocks shared by every
  sequence, any mix of decode tokens and prompt chunks in one step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from qinfer.attention.sdpa import Sdpa, reference_sdpa_fp32, torch_sdpa_grouped
from qinfer.features import Features


class AttentionBackend(Protocol):
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store k, v (T, Hkv, D) of `layer` and attend q (T, Hq, D) -> (T, Hq, D)."""
        ...


def sdpa_for(features: Features) -> Sdpa:
    """The attention function `features` asks for: both give the same result (the tests hold
    them to it); torch's fused one is faster."""
    return torch_sdpa_grouped if features.fast_sdpa else reference_sdpa_fp32
