"""Attention backends: how a runner's KV pools are laid out, what a step's attention needs
to know, and the attention itself.

The layer (`qinfer.layers.attention`) does the seed's steps that are the same whatever
stores K/V: the projections, QK-norm and RoPE. What remains, storing this step's k, v and
attending each query to its own sequence's visible history, is the step's attention:

    out = batch.attention.attend(layer, q, k, v, scale)
    # q (T, Hq, D), k and v (T, Hkv, D): the step's T tokens, flat (`ForwardBatch`)
    # out (T, Hq, D) in q's dtype

An engine's backend is a triple, each part declared once:

    backend = choose_backend(name, device, features)
    pools = [KVPool(..., layout=backend.layout) ...]    # 1. the KV layout it reads
    attention = backend.plan(batch, layers)            # 2. the step's metadata, built once
    attention.attend(layer, q, k, v, scale)            # 3. every layer, in turn

`plan` takes the one step description all backends share (the `ForwardBatch` of a
runner's buffers, before its attention: tokens' positions, slots, block tables per block
space, history lengths) and the layers' places in the pools
(`PagedLayer`). Backends:

- `PagedBackend` (`paged.py`): the CPU's, pools heads first; decode reads the values where
  they sit (the CPU's decode op, or embedding_bag), sequences are grouped by new tokens and
  history length (not decode steps through the op, which plan static steps too); the only
  one with batch-invariant arithmetic.
- `GatheredBackend` (`gathered.py`): pools slots first (vLLM's and flash-attn's layout);
  every sequence's blocks gathered, then one sdpa call over the step, queries padded to
  the longest: a few lines over any device's sdpa.

`ReferenceAttention` (`reference.py`) answers `attend` too, without a pool: the seed's
`cache.update_and_fetch` and `scaled_dot_product_attention_grouped` over one contiguous
cache per layer, for rectangular batches; the oracle and the readable path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from qinfer import kernels
from qinfer.attention.gathered import GatheredBackend
from qinfer.attention.kv_pool import KVLayout, PagedLayer
from qinfer.attention.paged import PagedBackend
from qinfer.attention.sdpa import sdpa_for
from qinfer.core.errors import QinferError
from qinfer.core.features import Features, check_attention_backend
from qinfer.core.forward_batch import ForwardBatch, StepAttention


class AttentionBackend(Protocol):
    """A way of keeping K/V in a runner's pools and attending over them (the module's
    docstring): `layout` of every pool, `plan` of every step."""

    layout: KVLayout
    #: plans a step of one decode token per sequence, of shapes it has seen, with no host
    #: work and no new tensor: only views of the step's buffers and ops over them
    #: (`qinfer.runtime.static_decode`)
    static_decode: bool

    def plan(self, step: ForwardBatch, layers: list[PagedLayer]) -> StepAttention:
        """The attention of one step (its metadata built here, once) over the pools that
        `layers` place."""
        ...


def choose_backend(
    name: str,
    device: torch.device,
    features: Features,
    static_decode: bool = False,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """The backend `name` asks for, set up for `features`, a model computing in `dtype` and
    storing K/V as `kv_dtype`. auto: paged on every device (the one measured; a GPU has not
    run either yet), and for static decode steps where it plans them (its CPU decode op:
    kernels built, fp32 or bf16 queries, fp32, bf16 or int8 K/V), else gathered. Batch
    invariance is the paged backend's alone."""
    check_attention_backend(name)
    sdpa = sdpa_for(features)
    decode_kernel = (
        device.type == "cpu"
        and dtype in kernels.ACTIVATION_DTYPES
        and kv_dtype in (*kernels.ACTIVATION_DTYPES, torch.int8)
        and kernels.in_use()
    )
    paged = PagedBackend(sdpa, features.batch_invariant, decode_kernel)
    if name == "auto":
        name = "gathered" if static_decode and not paged.static_decode else "paged"
    if name == "gathered":
        if features.batch_invariant:
            raise QinferError(
                "attention_backend 'gathered' has no batch-invariant arithmetic: "
                "use 'paged' (or auto) with batch_invariant"
            )
        return GatheredBackend(sdpa)
    if static_decode and not paged.static_decode:
        raise QinferError(
            "attention_backend 'paged' plans static decode steps only through its CPU decode "
            "op (CPU kernels built, fp32 or bf16 queries and K/V, not batch_invariant): use "
            "'gathered' (or auto) with static_decode"
        )
    return paged
