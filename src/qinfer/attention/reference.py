"""The reference attention backend: the seed's two calls over one contiguous cache per layer.

    keys, values, _, mask = cache.update_and_fetch(k, v, mask_length=L, mask=mask)
    out = sdpa(q, keys, values, scale, mask)

Its batches are rectangular: B rows of L new tokens each (rows of different lengths are
left-padded, and the caches mask the padding: `qinfer.attention.kv_cache`), flattened row by row
into the T = B * L tokens of a `ForwardBatch`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qinfer.attention.kv_cache import KVCache, RotatingKVCache
from qinfer.attention.sdpa import Mask, Sdpa

Cache = KVCache | RotatingKVCache


class ReferenceAttention:
    """One forward of B rows x L tokens over `caches` (indexed by layer).

    mask: the caller's mask ("causal", None or a boolean (B, 1, L, S) tensor), which each
    cache completes with its padding and window. sdpa: the attention function of every
    layer; `layer_sdpa` gives some layers their own (the inspector's recorder keeps the
    weights it computes: a hook, not a fake cache).
    """

    def __init__(
        self,
        caches: Sequence[Cache] | Mapping[int, Cache],
        batch_size: int,
        length: int,
        mask: Mask,
        sdpa: Sdpa,
        layer_sdpa: Mapping[int, Sdpa] | None = None,
    ) -> None:
        self.caches = caches
        self.batch_size, self.length = batch_size, length
        self.mask = mask
        self.sdpa = sdpa
        self.layer_sdpa = layer_sdpa or {}

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q (T, Hq, D), k, v (T, Hkv, D) with T = B * L, row-major -> (T, Hq, D)."""
        B, L = self.batch_size, self.length
        # (T, H, D) -> (B, L, H, D) -> (B, H, L, D)
        q, k, v = (x.view(B, L, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        keys, values, _, mask = self.caches[layer].update_and_fetch(
            k, v, mask_length=L, mask=self.mask
        )
        sdpa = self.layer_sdpa.get(layer, self.sdpa)
        out = sdpa(q, keys, values, scale, mask)  # (B, Hq, L, D)
        return out.transpose(1, 2).reshape(B * L, q.shape[1], q.shape[3])
