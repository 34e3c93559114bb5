"""The seed's full grouped-query attention layer (tutorial 07), in PyTorch.

q/k/v projections -> reshape to heads -> QK-norm (Qwen3) -> RoPE -> KV cache
-> grouped scaled-dot-product attention in fp32 -> o projection.

Under tensor parallelism (`qinfer.parallel`) a rank holds Hq / N query heads and the KV heads
they read: q/k/v are column-parallel (the rank's heads), QK-norm, RoPE and attention run on
those heads alone, and o_proj is row-parallel (its call all-reduces the ranks' sums).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.features import Features
from qinfer.layers.norm import load_rms_norm
from qinfer.layers.rope import NoRoPE, RoPE
from qinfer.linear import linear
from qinfer.parallel import SINGLE, Parallel
from qinfer.weights.base import Weights

Mask = torch.Tensor | str | None


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


def torch_sdpa_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Mask = None
) -> torch.Tensor:
    """The contract of `scaled_dot_product_attention_grouped` through torch's fused kernels.

    Those kernels accumulate the softmax in fp32 whatever the input dtype, so q, k, v may
    stay in the model's dtype. A single query (decoding) folds its n_rep query heads into
    the query axis, (B, Hq, 1, D) -> (B, Hkv, n_rep, D), so that no kernel repeats K/V per
    query head; longer queries use `enable_gqa`.
    """
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; use 'causal', a tensor or None")
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


class Attention:
    """The seed's attention layer. Shapes: x (B, L, hidden) -> (B, L, hidden).

    num_heads and num_kv_heads are this rank's (all of them in a single process).
    """

    def __init__(
        self,
        layer_prefix: str,
        config: ModelConfig,
        weights: Weights,
        features: Features,
        parallel: Parallel = SINGLE,
        *,
        layer: int,
    ):
        """layer: the layer's index, which picks its RoPE settings (`config.rope_for`) and
        its window."""
        self.hidden_size = config.hidden_size
        self.head_dim = D = config.head_dim
        self.features = features
        # This rank's heads: Hq / N query heads and their KV heads (Hkv / N, or one shared
        # with other ranks when Hkv < N).
        q_heads, kv_heads = parallel.attention_heads(
            config.num_attention_heads, config.num_key_value_heads
        )
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)

        # The scale factor for attention scores: 1/sqrt(head_dim), or the family's
        # (Gemma: 1/sqrt(query_pre_attn_scalar)).
        self.scale = config.attention_scale
        wiring = config.wiring

        # Each head is D consecutive rows of its projection (columns of o_proj).
        q_rows = range(q_heads.start * D, q_heads.stop * D)
        kv_rows = range(kv_heads.start * D, kv_heads.stop * D)
        q_out = config.num_attention_heads * D
        kv_out = config.num_key_value_heads * D
        prefix = f"{layer_prefix}.self_attn"
        # q, k and v loaded as one projection (rows stacked): one kernel call per step.
        self.qkv_sizes = [len(q_rows), len(kv_rows), len(kv_rows)]
        self.wqkv = weights.linear(
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            [(q_out, self.hidden_size), (kv_out, self.hidden_size), (kv_out, self.hidden_size)],
            wiring.qkv_bias,
            shard=parallel.split_out(q_rows, kv_rows, kv_rows),
        )
        self.wo = weights.linear(
            f"{prefix}.o_proj",
            (self.hidden_size, q_out),
            wiring.o_bias,
            shard=parallel.split_in(q_rows),
        )

        # RoPE frequencies are shared by every layer with the same settings (layers/rope.py);
        # a layer's settings may be its own (Gemma 3's sliding layers: `config.rope_for`),
        # or none (SmolLM3's NoPE layers: q and k pass through).
        rope = config.rope_for(layer)
        self.rope = (
            NoRoPE()
            if rope is None
            else RoPE(self.head_dim, config.max_position_embeddings, rope, weights.device)
        )

        # Per-head QK-norm (Qwen3, Gemma 3): RMSNorm over head_dim, on q and k, before RoPE.
        self.q_norm = self.k_norm = None
        if wiring.qk_norm:
            self.q_norm = load_rms_norm(weights, f"{prefix}.q_norm.weight", D, config)
            self.k_norm = load_rms_norm(weights, f"{prefix}.k_norm.weight", D, config)

    @property
    def sdpa(self) -> Callable[..., torch.Tensor]:
        """The attention function `features` asks for: both give the same result (the tests
        hold them to it); torch's fused one is faster."""
        return torch_sdpa_grouped if self.features.fast_sdpa else reference_sdpa_fp32

    def __call__(self, x: torch.Tensor, offsets: int | torch.Tensor, cache, mask: Mask = None):
        """x: (B, L, hidden); offsets: position of each row's first token (int or (B,)), or
        of every token ((B, L));
        cache: any object with the KV-cache protocol (`qinfer.kv_cache`); mask as in
        `scaled_dot_product_attention_grouped`, handed to the cache to complete."""
        B, L, _ = x.shape

        # Step 1: project to Q, K, V (one fused projection, split into its three parts).
        # (B, L, (Hq + 2 Hkv) * D) -> 3 x (B, L, H * D) -> (B, L, H, D); Hq and Hkv are
        # this rank's heads (Hq / N and Hkv / N, or 1, under tensor parallelism).
        projection_q, projection_k, projection_v = linear(x, self.wqkv).split(self.qkv_sizes, -1)
        projection_q = projection_q.reshape(B, L, self.num_heads, self.head_dim)
        projection_k = projection_k.reshape(B, L, self.num_kv_heads, self.head_dim)
        projection_v = projection_v.reshape(B, L, self.num_kv_heads, self.head_dim)

        # Step 2: per-head QK-norm, within each head, before RoPE.
        if self.q_norm is not None:
            projection_q = self.q_norm(projection_q)
            projection_k = self.k_norm(projection_k)

        # Step 3: RoPE on Q and K (not V), both rotated by one lookup of cos and sin.
        cos, sin = self.rope.rotation(offsets, L, projection_q.dtype)
        projection_q = self.rope.apply(projection_q, cos, sin)
        projection_k = self.rope.apply(projection_k, cos, sin)

        # Step 4: (B, L, H, D) -> (B, H, L, D)
        projection_q = projection_q.transpose(1, 2)
        projection_k = projection_k.transpose(1, 2)
        projection_v = projection_v.transpose(1, 2)

        # Steps 5-6: the cache stores this step's K/V and attends over the whole visible
        # history with the mask that matches it (padding, sliding window, causal). Its
        # default (`kv_cache.Attends.attend`) is the seed's two calls:
        #     keys, values, _, mask = cache.update_and_fetch(k, v, mask_length=L, mask=mask)
        #     x = sdpa(q, keys, values, scale, mask)      # (B, Hq, L, D)
        # a paged cache may instead attend where its K/V already live.
        x = cache.attend(projection_q, projection_k, projection_v, self.scale, mask, self.sdpa)

        # Step 7: (B, Hq, L, D) -> (B, L, Hq * D) -> output projection -> (B, L, hidden).
        # Under tensor parallelism o_proj is row-parallel: the rank's heads give a partial
        # sum, and its call all-reduces the ranks' sums (the layer's one collective).
        x = x.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim)
        return linear(x, self.wo)
