"""The attention functions: softmax(q k^T * scale + mask) v with grouped K/V heads.

`scaled_dot_product_attention_grouped` is the seed's reference (tutorial 07), written out
so that every step can be read; `torch_sdpa_grouped` keeps its contract through torch's fused
kernels. Every attention backend (`qinfer.attention`) computes with one of them, and the
tests hold all of them to the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.core.features import Features

Mask = torch.Tensor | str | None

#: An attention function: (q (B, Hq, L, D), k, v (B, Hkv, S, D), scale, mask) -> (B, Hq, L, D).
Sdpa = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, Mask], torch.Tensor]


def scaled_dot_product_attention_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: Mask = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped K/V heads, the reference implementation.

    q: (B, Hq, L, D); k, v: (B, Hkv, S, D) with Hq = Hkv * n_rep. Query head h reads
    KV head h // n_rep: q is reshaped to (B, Hkv, n_rep * L, D) so one matmul against
    each KV head serves its n_rep query heads, without copying K/V per query head.

    mask: None (every query sees every key); "causal", aligned bottom-right (the L queries
    are the last L of the S keys, so query i sees keys 0 .. S - L + i); or a tensor
    broadcastable to (B, Hq, L, S) that is boolean (True = may attend) or additive.
    Returns (B, Hq, L, D) in q's dtype.
    """
    weights = attention_weights_grouped(q, k, scale, mask).to(v.dtype)  # (B, Hq, L, S)
    return weigh_values_grouped(weights, v)


def weigh_values_grouped(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """weights (B, Hq, L, S) applied to grouped values v (B, Hkv, S, D) -> (B, Hq, L, D)."""
    B, Hq, L, S = weights.shape
    Hkv = v.shape[1]
    # (B, Hq, L, S) -> (B, Hkv, n_rep * L, S): each KV head's n_rep query heads in one matmul
    out = torch.matmul(weights.reshape(B, Hkv, -1, S), v)  # (B, Hkv, n_rep * L, D)
    return out.reshape(B, Hq, L, v.shape[-1])


def attention_weights_grouped(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: Mask = None
) -> torch.Tensor:
    """softmax(q k^T * scale + mask): the attention weights of the reference path, in fp32.

    q: (B, Hq, L, D); k: (B, Hkv, S, D); mask as in `scaled_dot_product_attention_grouped`.
    Returns (B, Hq, L, S): row (h, i) is how query i of head h spreads over the S keys
    (sums to 1; zero where the mask forbids).
    """
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    n_rep = Hq // Hkv
    q = q.reshape(B, Hkv, n_rep * L, D)  # query head h = kv_head * n_rep + r
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hkv, n_rep * L, S)
    scores = scores.reshape(B, Hkv, n_rep, L, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; use 'causal', a tensor or None")
        mask = causal_mask(L, S, q.device)
    if mask is not None:
        mask = _grouped(mask, Hkv, n_rep, L, S)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    return torch.softmax(scores.float(), dim=-1).reshape(B, Hq, L, S)


def reference_sdpa_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Mask = None
) -> torch.Tensor:
    """The reference path as the layer runs it: q, k, v in fp32, the result cast back."""
    out = scaled_dot_product_attention_grouped(q.float(), k.float(), v.float(), scale, mask)
    return out.to(q.dtype)


def causal_mask(L: int, S: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(L, S) boolean, bottom-right aligned: query i may attend to keys j <= S - L + i."""
    query = torch.arange(L, device=device)[:, None] + (S - L)
    return torch.arange(S, device=device)[None, :] <= query


def _grouped(mask: torch.Tensor, Hkv: int, n_rep: int, L: int, S: int) -> torch.Tensor:
    """A mask broadcastable to (B, Hq, L, S) as one broadcastable to (B, Hkv, n_rep, L, S)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)  # (B, 1, 1, L, S)
    return mask.reshape(mask.shape[0], Hkv, n_rep, mask.shape[2], S)


#: Queries per block of `causal_blocks`.
CAUSAL_BLOCK = 48
#: The whole prompts (L == S queries) that take `causal_blocks` on the CPU, in fp32: from
#: 128 to 1,024 it beat torch's flash attention (Qwen3-0.6B's 16 / 8 heads of 128 at 512:
#: 7.0 against 11.5 ms, at 128 0.77 against 0.89, at 1,024 27 against 33; 2 threads, AMD
#: EPYC Zen 4), past it a block's scores outgrow the caches and it falls behind.
CAUSAL_BLOCKS_RANGE = range(128, 1025)


def causal_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The bottom-right causal attention of `scaled_dot_product_attention_grouped`, a block
    of CAUSAL_BLOCK queries at a time: each block's scores only against the keys it may see
    (block [s, e) of the L queries sees keys 0 .. S - L + e - 1, the last e - s of them
    masked above the diagonal), then softmax and the values, as batched matmuls over the
    B x Hkv heads with each head's n_rep query heads stacked. A causal prompt skips the
    half of the scores that flash attention's tiles partly compute; the same result up to
    fp32 summation. q (B, Hq, L, D), k, v (B, Hkv, S, D), S >= L -> (B, Hq, L, D)."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    heads, n_rep = B * Hkv, Hq // Hkv
    q = q.reshape(heads, n_rep, L, D)
    keys_t = k.reshape(heads, S, D).transpose(1, 2)  # (B Hkv, D, S)
    values = v.reshape(heads, S, D)
    out = q.new_empty(heads, n_rep, L, D)
    for start in range(0, L, CAUSAL_BLOCK):
        stop = min(L, start + CAUSAL_BLOCK)
        n, seen = stop - start, S - L + stop  # queries, keys they may see
        block = q[:, :, start:stop].reshape(heads, n_rep * n, D)
        scores = torch.bmm(block, keys_t[:, :, :seen]).mul_(scale).view(heads, n_rep, n, seen)
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., seen - n :].masked_fill_(above, float("-inf"))
        weights = torch.softmax(scores, dim=-1).view(heads, n_rep * n, seen)
        out[:, :, start:stop] = torch.bmm(weights, values[:, :seen]).view(heads, n_rep, n, D)
    return out.view(B, Hq, L, D)


def torch_sdpa_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Mask = None
) -> torch.Tensor:
    """The contract of `scaled_dot_product_attention_grouped` through torch's fused kernels.

    Those kernels accumulate the softmax in fp32 whatever the input dtype, so q, k, v may
    stay in the model's dtype. A single query (decoding) folds its n_rep query heads into
    the query axis, (B, Hq, 1, D) -> (B, Hkv, n_rep, D), so that no kernel repeats K/V per
    query head; longer queries use `enable_gqa`. Causal fp32 queries on an AVX-512 CPU take
    the compiled op (`kernels.causal_attention`: K/V fp32 or bf16, each query's bits its own);
    without it, a whole fp32 prompt within CAUSAL_BLOCKS_RANGE takes `causal_blocks` instead
    of torch's flash attention.
    """
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; use 'causal', a tensor or None")
        if _causal_op_takes(q, k, v):
            return kernels.causal_attention(q, k, v, scale)
        if L == S and L in CAUSAL_BLOCKS_RANGE and _fp32_on_cpu(q, k, v):
            return causal_blocks(q, k, v, scale)
        if L == S:  # torch's is_causal is top-left aligned: equal to ours only when L == S
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        mask = None if L == 1 else causal_mask(L, S, q.device)  # one query sees every key
    if L == 1:
        n_rep = Hq // Hkv
        if mask is not None:  # (B, Hq or 1, 1, S) -> (B, Hkv or 1, n_rep or 1, S)
            mask = _grouped(mask, Hkv, n_rep, 1, S).squeeze(-2)
        out = F.scaled_dot_product_attention(
            q.reshape(B, Hkv, n_rep, D), k, v, attn_mask=mask, scale=scale
        )
        return out.reshape(B, Hq, 1, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _causal_op_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `kernels.causal_attention` runs this attention: fp32 queries on the CPU, K/V
    of one dtype, fp32 or bf16, where the compiled ops are in use on an AVX-512 path (the
    op's fast one; its other is scalar)."""
    return (
        q.dtype == torch.float32
        and q.device.type == "cpu"
        and k.dtype == v.dtype
        and k.dtype in (torch.float32, torch.bfloat16)
        and kernels.in_use()
        and kernels.norm_auto_path() == "avx512"
    )


def _fp32_on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def sdpa_for(features: Features) -> Sdpa:
    """The attention function `features` asks for: both give the same result (the tests hold
    them to it); torch's fused one is faster."""
    return torch_sdpa_grouped if features.fast_sdpa else reference_sdpa_fp32
